"""`plain`: specloom itself without speculation, on the candidate's weights (same dtype, same KV type)."""

from __future__ import annotations

from . import Peer, PeerRun, register


@register("plain")
class SpecloomPlain(Peer):
    def __init__(self, ctx):
        super().__init__(ctx)
        from ...engine import Engine

        e = ctx.engine
        self.engine = Engine(e.model, e.tokenizer, None, e.max_model_len, kv_dtype=e.kv_dtype)

    @property
    def label(self) -> str:
        return f"specloom-plain ({self.ctx.dtype})"

    def settings(self) -> dict:
        return {"dtype": self.ctx.dtype}

    def run(self, ids, max_tokens):
        r = self.engine.generate(prompt_token_ids=ids, max_tokens=max_tokens)
        return PeerRun(r.token_ids, r.total_seconds, r.num_target_passes, 0, 0)
