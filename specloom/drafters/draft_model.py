"""A separate small causal LM as drafter: its own KV cache, a chain of k tokens per step.

The draft model must share the target's tokenizer (same vocabulary, same ids); anything else is refused. Under
sampling each draft token is drawn from q = probs_from_logits(draft logits, same params) and q travels in the
tree, so verification is exact; under greedy the drafts are q's argmax.

With `"tree_width": w > 1` (ours; vLLM's draft_model has no tree) the drafter grows a tree instead of a chain:
at each of the k depths it expands the top-w tokens of every frontier node and keeps the w best new nodes by
cumulative log-probability (beam-style, one draft pass of w rows per depth, the tree nodes cached with a mask
that hides sibling branches). The candidates are chosen deterministically, so the tree carries no q: the
verifier treats them as one-hot drafts, which is exact (sampling y ~ p and checking the candidates in order).

State: the draft KV holds a prefix of the sequence. `propose` feeds what it has not seen (at least the root),
then its own drafts; `on_verified` truncates its KV to what the target accepted (a tree's nodes are dropped and
the accepted tokens re-fed next step, one pass of a few rows).
"""

from __future__ import annotations

import torch

from ..errors import SpecloomError
from ..sampling import probs_from_logits
from ..tree import DraftTree
from .base import DraftContext, Drafter, register

DEFAULT_K = 4


def check_same_token_ids(target_tok, draft_tok, name: str) -> None:
    """Same vocabulary size is checked up front (`check`); here the token ids themselves must agree."""
    if target_tok is not None and draft_tok is not None and target_tok.hf.get_vocab() != draft_tok.hf.get_vocab():
        raise SpecloomError(f"draft model {name!r} uses another tokenizer than the target (token ids differ)")


@register("draft_model")
class DraftModelDrafter(Drafter):
    def __init__(self, model, k: int = DEFAULT_K, tree_width: int = 1):
        if tree_width < 1:
            raise SpecloomError(f"tree_width must be >= 1, got {tree_width}")
        self.model = model
        self.k = k
        self.width = tree_width
        self.kv = None
        self._seen = 0  # sequence tokens whose KV the draft cache holds

    def memory(self) -> dict:
        from .base import kv_bytes_per_1k, module_bytes

        c = self.model.config
        dt = self.kv.dtype if self.kv is not None else torch.float32
        return {"weights": module_bytes(self.model),
                "kv_per_1k_tokens": kv_bytes_per_1k(c.num_layers, c.num_kv_heads, c.head_dim, dt)}

    @classmethod
    def check(cls, spec, target_config) -> None:
        from ..loading import load_config, resolve

        if not spec.model:
            raise SpecloomError('method "draft_model" needs "model": the draft model (alias, .gguf or directory)')
        draft_vocab = load_config(resolve(spec.model))[0].vocab_size  # the header only, no weights
        if draft_vocab != target_config.vocab_size:
            raise SpecloomError(
                f"draft model {spec.model!r} has a vocabulary of {draft_vocab} tokens, the target "
                f"{target_config.vocab_size}: a draft model must use the target's tokenizer"
            )

    @classmethod
    def create(cls, spec, target, tokenizer) -> "DraftModelDrafter":
        from ..loading import load_target, resolve

        cls.check(spec, target.config)
        source = getattr(target, "source", None)
        draft_source = resolve(spec.model)
        if source is not None and draft_source.path == source.path:
            model, draft_tok = target, tokenizer  # the target drafting for itself: share the weights
        else:
            model, draft_tok = load_target(spec.model, target.dtype, progress=False)
        check_same_token_ids(tokenizer, draft_tok, spec.model)
        return cls(model, spec.num_speculative_tokens or DEFAULT_K, spec.tree_width or 1)

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    def _ensure_kv(self, need: int) -> None:
        if self.kv is None or self.kv.max_len < need:
            self.kv = self.model.new_kv(max(need, 2048))
            self._seen = 0

    def prefill(self, ctx: DraftContext, target_out) -> None:
        self._ensure_kv(len(ctx.tokens) + 4096)
        self.kv.reset()
        self._seen = 0

    @torch.inference_mode()
    def _step(self, tokens: list[int]) -> torch.Tensor:
        """Feed `tokens` at the next positions; return the logits (V,) after the last one."""
        start = self.kv.length
        x = torch.tensor([tokens], device=self.model.device)
        pos = torch.arange(start, start + len(tokens), device=self.model.device)[None]
        logits = self.model(x, pos, self.kv, num_logits=1).logits[0, -1]
        self.kv.commit()
        return logits

    def propose(self, ctx: DraftContext) -> DraftTree:
        root = ctx.tokens[-1]
        if ctx.k <= 0:
            return DraftTree.chain(root, [])
        self._ensure_kv(len(ctx.tokens) + ctx.k * self.width + 1)
        self.kv.truncate(min(self._seen, len(ctx.tokens) - 1))
        logits = self._step(ctx.tokens[self.kv.length:])
        if self.width > 1:
            return self._propose_tree(ctx, logits)
        drafts, qs = [], []
        for i in range(ctx.k):
            if ctx.params.greedy:
                tok = int(logits.argmax())
            else:
                q = probs_from_logits(logits, ctx.params)
                tok = int(torch.multinomial(q, 1, generator=ctx.generator))
                qs.append(q)
            drafts.append(tok)
            if i + 1 < ctx.k:
                logits = self._step([tok])
        self._seen = self.kv.length  # = len(tokens) + k - 1
        return DraftTree.chain(root, drafts, torch.stack(qs) if qs else None)

    @torch.inference_mode()
    def _propose_tree(self, ctx: DraftContext, root_logits: torch.Tensor) -> DraftTree:
        base = len(ctx.tokens)  # the draft KV holds the whole sequence, root included
        tokens, parents, score = [ctx.tokens[-1]], [-1], [0.0]
        frontier, frontier_logits = [0], root_logits[None]  # tree nodes whose children are expanded next
        anc = [[]]  # tree-node ancestors of each node (root excluded: it is in the prefix)
        for depth in range(1, ctx.k + 1):
            logp = torch.log_softmax(frontier_logits.float(), dim=-1)  # (F, V)
            top = logp.topk(self.width, dim=-1)
            cand = [(score[f] + float(v), f, int(t)) for i, f in enumerate(frontier)
                    for v, t in zip(top.values[i].tolist(), top.indices[i].tolist())]
            cand.sort(key=lambda c: -c[0])
            new = []
            for s_, f, t in cand[:self.width]:
                parents.append(f)
                tokens.append(t)
                score.append(s_)
                anc.append(anc[f] + ([f] if f else []))
                new.append(len(tokens) - 1)
            if depth == ctx.k:
                break
            # one draft pass over the new nodes: each sees the prefix, its own tree ancestors and itself
            start = self.kv.length
            T = len(new)
            mask = torch.zeros(T, start + T, dtype=torch.bool, device=self.model.device)
            mask[:, :base] = True
            for row, node in enumerate(new):
                for a in anc[node]:
                    mask[row, base + a - 1] = True  # tree node a sits at draft-KV slot base + a - 1
                mask[row, start + row] = True
            x = torch.tensor([[tokens[n] for n in new]], device=self.model.device)
            pos = torch.full((1, T), base - 1 + depth, device=self.model.device)
            frontier_logits = self.model(x, pos, self.kv, attn_mask=mask).logits[0]
            self.kv.commit()
            frontier = new
        self.kv.truncate(base)  # drop the tree nodes; accepted tokens are re-fed next step
        self._seen = base
        return DraftTree(tokens, parents)

    def on_verified(self, ctx: DraftContext, result, target_out) -> None:
        # valid draft KV: the sequence up to the root, plus the accepted drafts that were fed (all but the last)
        self._seen = min(self._seen, len(ctx.tokens) + result.num_accepted)
