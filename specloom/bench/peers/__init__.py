"""Baselines for `specloom bench --baseline NAME[,NAME...]`: other engines (and specloom itself) decoding the same
token ids greedily, timed in the same run as the candidate.

One module per peer registers its class by name with `@register("name")`; the harness only knows this registry.
Every peer has the same shape: `Peer(ctx)` loads what it needs (raising `SpecloomError` with an install hint when a
package is missing), `peer.run(ids, max_tokens)` returns a `PeerRun` (the new token ids and the wall seconds
*including prefill*, plus whatever the peer can count: target passes, drafted and accepted tokens), and
`peer.settings()` the configuration it ran with, for the report.

Registered: `plain` (specloom without speculation), `hf` (transformers `generate`), `hf-assisted`
(`generate(assistant_model=...)`), `hf-lookup` (`prompt_lookup_num_tokens`), `llama.cpp` (llama-cpp-python,
plain), `llama.cpp-lookup` (llama-cpp-python's `LlamaPromptLookupDecoding`), `llama.cpp-draft` (llama.cpp's own
draft-model speculation: its `llama-speculative-simple` tool, built by scripts/build_llama_speculative.sh).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...errors import SpecloomError

PEERS: dict[str, type["Peer"]] = {}


def register(name: str):
    def deco(cls):
        if name in PEERS:
            raise ValueError(f"peer baseline {name!r} registered twice")
        cls.name = name
        PEERS[name] = cls
        return cls

    return deco


@dataclass
class PeerContext:
    """What a peer may need to know about the run it joins."""
    model: str  # the target as the user named it (alias, .gguf, HF directory)
    eos_token_ids: frozenset  # specloom's EOS set: every peer stops at the same tokens
    threads: int  # torch's intra-op threads; llama.cpp peers use as many
    n_ctx: int  # longest prompt + max_tokens (+ a little): the context a peer must hold
    dtype: str = "fp32"  # the candidate's dtype (specloom plain runs in it; HF peers: fp32 on CPU, this on a GPU)
    engine: object = None  # the candidate's Engine (plain shares its weights and tokenizer)
    draft_model: str | None = None  # hf-assisted / llama.cpp-draft: the draft model
    draft_tokens: int | None = None  # tokens drafted per step (None: each peer's own default)
    lookup_tokens: int = 10  # hf-lookup / llama.cpp-lookup: tokens copied per lookup
    lookup_ngram: int = 2  # ... and the longest n-gram matched (both libraries' default)
    shared: dict = field(default_factory=dict)  # what peers of one run share (one HF copy of the target)


@dataclass
class PeerRun:
    tokens: list[int]
    seconds: float  # wall time including prefill
    passes: int | None = None  # target forward passes when the peer can count them
    drafted: int | None = None  # draft tokens proposed / accepted, when known
    accepted: int | None = None
    prompt_tokens: int | None = None  # what the peer itself tokenized, when it tokenizes (llama.cpp-draft)
    text: str | None = None  # set by a peer that reports text, not ids: identity is then judged on the text
    counted_tokens: int | None = None  # the peer's own count of generated tokens, when `tokens` is re-tokenized
    wall_seconds: float | None = None  # a peer timing itself inside a process: the process's wall time too
    prefill_pass: bool = True  # passes[0] is a prefill yielding one token (specloom, llama-cpp-python); False:
    # every pass verifies a draft and yields its accepted tokens + 1 (HF assisted/lookup verify the prompt with
    # the first draft; llama-speculative-simple reports decode passes only)

    @property
    def num_tokens(self) -> int:
        return self.counted_tokens if self.counted_tokens is not None else len(self.tokens)


class Peer:
    name = "?"

    def __init__(self, ctx: PeerContext):
        self.ctx = ctx

    @property
    def label(self) -> str:
        return self.name

    @classmethod
    def preflight(cls, model: str, draft_model: str | None) -> None:
        """Fail fast, before anything loads, when this peer cannot run here (a package or program missing)."""

    def settings(self) -> dict:
        return {}

    def run(self, ids: list[int], max_tokens: int) -> PeerRun:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


def names() -> list[str]:
    return list(PEERS)


def parse_baselines(spec: "str | list[str] | tuple[str, ...]") -> list[str]:
    """'hf,llama.cpp' -> ['hf', 'llama.cpp']: known names, each once, in the order given."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for raw in items:
        name = raw.strip()
        if not name:
            continue
        if name not in PEERS:
            raise SpecloomError(f"unknown baseline {name!r}; known: {', '.join(PEERS)} (comma-separated for several)")
        if name not in out:
            out.append(name)
    if not out:
        raise SpecloomError(f"--baseline names no baseline; known: {', '.join(PEERS)}")
    return out


def create(name: str, ctx: PeerContext) -> Peer:
    if name not in PEERS:
        raise SpecloomError(f"unknown baseline {name!r}; known: {', '.join(PEERS)}")
    return PEERS[name](ctx)


def stop_at_eos(tokens: list[int], eos, max_tokens: int) -> list[int]:
    """Cut a peer's output the way specloom cuts its own: at the first EOS (kept) or at max_tokens."""
    out = []
    for t in tokens[:max_tokens]:
        out.append(t)
        if t in eos:
            break
    return out


from . import plain, hf, llamacpp, llamacpp_draft  # noqa: E402,F401  (registration, in report order)
