"""A separate small causal LM as drafter: its own KV cache, a chain of k tokens per step.

The draft model must share the target's tokenizer (same vocabulary, same ids); anything else is refused. Under
sampling each draft token is drawn from q = probs_from_logits(draft logits, same params) and q travels in the
tree, so verification is exact; under greedy the drafts are q's argmax.

With `"tree_width": w > 1` (ours; vLLM's draft_model has no tree) the drafter grows a tree instead of a chain:
at each of the k depths it expands the top-w tokens of every frontier node and keeps the w best new nodes by
cumulative log-probability (beam-style, one draft pass of w rows per depth, the tree nodes cached with a mask
that hides sibling branches). The candidates are chosen deterministically, so the tree carries no q: the
verifier treats them as one-hot drafts, which is exact (sampling y ~ p and checking the candidates in order).

With `"draft_vocab": N` (FR-Spec; `"token_map"` names the frequency ranking, else the one bundled for the
tokenizer: drafters/token_map.py) the draft model's head scores only the N most frequent tokens: a head of N rows,
drafts are argmaxes or samples of q renormalised over those tokens (zero elsewhere, the q the verifier uses), so
the output is unchanged and only the drafting pass gets cheaper.

State: the draft KV holds a prefix of the sequence. `propose` feeds what it has not seen (at least the root),
then its own drafts; `on_verified` truncates its KV to what the target accepted (a tree's nodes are dropped and
the accepted tokens re-fed next step, one pass of a few rows).
"""

from __future__ import annotations

import torch

from ...errors import DrafterMismatch, SpecloomError
from ...tree import DraftTree
from ..base import VOCAB_KEYS, DraftContext, Drafter, TREE_KEYS, register
from ..rows import chains, draw, fitting_groups, own_store
from ..token_map import expand_logits, reduced_vocabulary, sliced_head

DEFAULT_K = 4


def check_same_token_ids(target_tok, draft_tok, name: str) -> None:
    """Same vocabulary size is checked up front (`check`); here the token ids themselves must agree."""
    if target_tok is not None and draft_tok is not None and target_tok.hf.get_vocab() != draft_tok.hf.get_vocab():
        raise SpecloomError(f"draft model {name!r} uses another tokenizer than the target (token ids differ)")


def _kernel_key(name, v):
    """`K` (one-row drafting passes run K, multi-row catch-up feeds the host-fitted kernel), `K+M` or `auto`."""
    from ...models.cpu_packing import KERNELS

    parts = v.split("+") if isinstance(v, str) else [None]
    if not (v == "auto" or (len(parts) <= 2 and parts[0] in KERNELS and parts[-1] in ("auto", *KERNELS))):
        raise SpecloomError(f"{name} must be auto, a kernel ({', '.join(KERNELS)}) or SINGLE+MULTI "
                            f"(e.g. int8+auto), got {v!r}")
    return v if v == "auto" or "+" in v else f"{v}+auto"


@register("draft_model", {"tree_width": TREE_KEYS["tree_width"], **VOCAB_KEYS, "draft_kernel": _kernel_key},
          (".trainer",),
          no_export='a draft model is an ordinary HF checkpoint: give vLLM its directory as "model"')
class DraftModelDrafter(Drafter):
    keeps_kv = True
    # Idle steps are free: nothing happens at depth 0 (`seen` stays), the next `propose` feeds the draft model
    # every token it has not seen in one ragged pass.
    idle_free = True

    def __init__(self, model, k: int = DEFAULT_K, tree_width: int = 1, vocab: torch.Tensor | None = None):
        if tree_width < 1:
            raise SpecloomError(f"tree_width must be >= 1, got {tree_width}")
        self.model = model
        self.k = k
        self.width = tree_width
        self.vocab = self.head = None  # the reduced draft vocabulary (sorted target ids) and its head
        if vocab is not None:
            from ...loading.formats import apply_kernels

            lm = model.lm_head
            if not isinstance(getattr(lm, "weight", None), torch.Tensor) or lm.weight.dim() != 2:
                raise SpecloomError("draft_vocab needs the draft model's LM head as a dense weight; this one "
                                    f"runs {type(lm).__name__} without one")
            holder = torch.nn.Module()
            holder.head = sliced_head(lm, vocab)
            apply_kernels(holder, choice=getattr(model, "kernel_choice", None))  # the kernel its linears run
            self.vocab, self.head = vocab.to(holder.head.weight.device), holder.head

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden (..., H) -> fp32 logits over the draft vocabulary (all of it, or the reduced one)."""
        return self.model.logits(h, self.head)

    def _to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.vocab is None else self.vocab[ids]

    def _full_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits -> target-vocabulary logits (-inf outside the reduced vocabulary)."""
        return logits if self.vocab is None else expand_logits(logits, self.vocab, self.model.config.vocab_size)

    def memory(self) -> dict:
        from ..base import kv_bytes_per_1k, module_bytes

        c = self.model.config
        return {"weights": module_bytes(self.model, *([self.head] if self.head is not None else [])),
                "kv_per_1k_tokens": kv_bytes_per_1k(c.num_layers, c.num_kv_heads, c.head_dim,
                                                    self.model.kv_dtype(self.kv_cache_dtype))}

    @classmethod
    def check(cls, spec, target_config) -> None:
        from ...loading import load_config, resolve

        if not spec.model:
            raise SpecloomError('method "draft_model" needs "model": the draft model (alias, .gguf or directory)')
        draft_vocab = load_config(resolve(spec.model))[0].vocab_size  # the header only, no weights
        if draft_vocab != target_config.vocab_size:
            raise DrafterMismatch(
                f"draft model {spec.model!r} has a vocabulary of {draft_vocab} tokens, the target "
                f"{target_config.vocab_size}: a draft model must use the target's tokenizer"
            )

    @classmethod
    def create(cls, spec, target, tokenizer) -> "DraftModelDrafter":
        from ...loading import load_target, resolve

        cls.check(spec, target.config)
        source = getattr(target, "source", None)
        draft_source = resolve(spec.model)
        if source is not None and draft_source.path == source.path:
            if spec.draft_kernel not in (None, "auto"):
                raise SpecloomError("draft_kernel picks the kernel of a separate draft model; this draft model is "
                                    "the target itself, whose kernel is --linear-kernel")
            model, draft_tok = target, tokenizer  # the target drafting for itself: share the weights
        else:
            model, draft_tok = load_target(spec.model, target.dtype, progress=False, device=target.device,
                                           kernel=spec.draft_kernel or "auto")
        check_same_token_ids(tokenizer, draft_tok, spec.model)
        vocab = None
        if spec.draft_vocab:
            vocab = reduced_vocabulary(spec.draft_vocab, spec.token_map, tokenizer, target.config.vocab_size,
                                          tuple(getattr(tokenizer, "eos_token_ids", ()) or ()))
        elif spec.token_map:
            raise SpecloomError('"token_map" ranks the tokens for "draft_vocab": give "draft_vocab": N as well')
        return cls(model, spec.num_speculative_tokens or DEFAULT_K, spec.tree_width or 1, vocab)

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    def new_state(self) -> dict:
        return {"seen": 0}  # sequence tokens whose KV the drafter's store holds

    def _store(self, ctx):
        return own_store(ctx, self, lambda rows, n: self.model.new_kv(n, dtype=self.kv_cache_dtype, batch=rows))

    def prefill(self, ctx: DraftContext, target_out) -> None:
        self._store(ctx).truncate(0, row=ctx.row)
        ctx.state["seen"] = 0

    def _feed(self, store, ctxs, tokens: list[list[int]], positions: list[list[int]], mask=None,
              last_only: bool = True) -> torch.Tensor:
        """One draft pass over every row's `tokens` (ragged) -> logits (B, V) after each row's last token, or
        (B, T, V) for all of them (`mask` (B, T, T'): the rows' tree masks)."""
        dev = self.model.device
        m = [len(t) for t in tokens]
        M = max(m)
        x = torch.tensor([t + [0] * (M - len(t)) for t in tokens], device=dev)
        pos = torch.tensor([p + [p[-1]] * (M - len(p)) for p in positions], device=dev)
        kvp = store.begin([c.row for c in ctxs], m)
        L = self.model.config.num_layers
        # the final hidden state of every position (no head in the pass), then the head where it is read
        h = kvp.pick(self.model(kvp.spread(x), kvp.spread(pos), kvp,
                                attn_mask=None if mask is None else kvp.spread(mask, True), capture=(L,),
                                num_logits=0).hidden[L])
        if last_only:  # logits at each row's last position only
            h = h[torch.arange(len(m), device=dev), torch.tensor(m, device=dev) - 1]
        out = self._logits(h)
        store.commit()
        return out

    @torch.inference_mode()
    def propose(self, ctxs) -> list[DraftTree]:
        store = self._store(ctxs[0])
        feed, pos = [], []
        for c in ctxs:  # feed what the store has not seen (at least the root)
            have = min(c.state["seen"], len(c.tokens) - 1)
            store.truncate(have, row=c.row)
            feed.append(c.tokens[have:])
            pos.append(list(range(have, len(c.tokens))))
        logits = torch.empty(len(ctxs), self.model.config.vocab_size if self.vocab is None else len(self.vocab),
                             device=self.model.device)
        for g in fitting_groups(ctxs, [len(f) for f in feed], store):  # a just-prefilled row feeds its prompt
            sub = [ctxs[i] for i in g]
            logits[g] = self._feed(store, sub, [feed[i] for i in g], [pos[i] for i in g])
        if self.width > 1:
            return self._propose_tree(ctxs, store, logits)
        K = max(c.k for c in ctxs)
        drafts = [[] for _ in ctxs]
        qs = [[] for _ in ctxs]
        for i in range(K):
            draw(ctxs, logits, [i < c.k for c in ctxs], drafts, qs, self._to_target, self._full_vocab)
            if i + 1 < K:
                logits = self._feed(store, ctxs, [[d[-1]] for d in drafts],
                                    [[len(c.tokens) + i] for c in ctxs])
        for c in ctxs:
            c.state["seen"] = len(c.tokens) + c.k - 1
        return chains(ctxs, drafts, qs)

    def _propose_tree(self, ctxs, store, root_logits: torch.Tensor) -> list[DraftTree]:
        """Beam-style trees for all rows at once: per depth the w best new nodes of each row, one draft pass."""
        w, B, dev = self.width, len(ctxs), root_logits.device
        K = max(c.k for c in ctxs)
        base = [len(c.tokens) for c in ctxs]  # the store holds the whole sequence, root included
        logp = torch.log_softmax(root_logits.float(), -1)[:, None]  # (B, F=1, V)
        score = torch.zeros(B, 1, device=dev)
        node_tok, node_par = [], []  # per depth (B, w): tokens, parent node ids
        anc = torch.zeros(B, 1, 0, dtype=torch.bool, device=dev)  # frontier ancestors among tree slots
        eye = torch.eye(w, dtype=torch.bool, device=dev).expand(B, w, w)
        for depth in range(1, K + 1):
            Fn = logp.shape[1]
            top = logp.topk(w, dim=-1)  # (B, F, w)
            cand = (score[..., None] + top.values).reshape(B, Fn * w)
            sel = cand.topk(w, -1).indices  # (B, w), best first
            par = sel // w  # frontier index of each new node's parent
            first = 0 if depth == 1 else 1 + (depth - 2) * w  # node id of frontier index 0
            node_tok.append(self._to_target(top.indices.reshape(B, Fn * w).gather(1, sel)))
            node_par.append(par if depth == 1 else first + par)
            if depth == 1:
                node_par[-1] = torch.zeros_like(par)
            if depth == K:
                break
            score = cand.gather(1, sel)
            anc = torch.cat([anc.gather(1, par[..., None].expand(B, w, anc.shape[-1])),
                             torch.nn.functional.one_hot(par, w).bool() if depth > 1 else
                             torch.zeros(B, w, 0, dtype=torch.bool, device=dev)], -1)
            mask = torch.cat([anc, eye], -1)
            toks = node_tok[-1].tolist()
            logits = self._feed(store, ctxs, toks, [[b - 1 + depth] * w for b in base], mask, last_only=False)
            logp = torch.log_softmax(logits.float(), -1)  # (B, w, V)
        tok_l = torch.cat(node_tok, 1).tolist()
        par_l = torch.cat(node_par, 1).tolist()
        trees = []
        for b, c in enumerate(ctxs):
            store.truncate(base[b], row=c.row)  # drop the tree nodes; accepted tokens are re-fed next step
            c.state["seen"] = base[b]
            n = c.k * w
            trees.append(DraftTree([c.tokens[-1]] + tok_l[b][:n], [-1] + par_l[b][:n]))
        return trees

    def on_verified(self, ctxs, results, target_out) -> None:
        # valid draft KV: the sequence up to the root, plus the accepted drafts that were fed (all but the last)
        for c, res in zip(ctxs, results):
            c.state["seen"] = min(c.state["seen"], len(c.tokens) + res.num_accepted)
