"""Medusa: K heads on the target's last (post-norm) hidden state; head k predicts x_{t+2+k} (drafters.md §1).

One definition for training and inference: `MedusaHeads` is a ModuleList whose head k is
`Sequential(ResBlock x num_layers [, Linear(H, V)])` — state_dict names `{k}.{l}.linear.{weight,bias}` and, when
heads own an LM head, `{k}.{num_layers}.weight` (Medusa v0.1). Without own heads (Medusa "version 2", the
default here: 5 heads cost 1.7M parameters instead of 140M) the target's LM head scores every head. ResBlocks are
independent modules (as vLLM; the reference ties them when num_layers > 1), W zero-initialised.

Truncated head vocabulary (vLLM's `token_map` idea): with a `token_map` buffer (sorted target ids, V_d of them)
the heads score only those tokens -- shared heads through the target's LM-head rows for them (a V_d x H copy made
at attach time), own heads through their V_d-row output layers -- and head ids map back through `token_map`.
SmolLM2-135M's 49,152-token head is most of a Medusa step; 4096 rows cost a twelfth. Drafts only: verification
scores every token, so the output is unchanged.

Drafting: no drafter pass at all. The verification pass already computed the hidden state at the deepest accepted
node; the heads turn it into top-10 lists and the static tree `medusa_choices` (paths of top-k ranks, one head
per depth) picks the candidates. Candidates are deterministic, so the verifier treats them as one-hot drafts:
greedy and sampling are both exact (Medusa's own typical acceptance is not lossless; it is not offered).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import SpecloomError
from ...models.cpu_packing import compute_dtype
from ...tree import DraftTree
from ..base import DraftContext, Drafter, TREE_KEYS, register

TOPK = 10


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=True)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x):
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.ModuleList):
    def __init__(self, hidden: int, num_heads: int, num_layers: int = 1, vocab: int | None = None,
                 token_map: torch.Tensor | None = None):
        heads = []
        for _ in range(num_heads):
            mods = [ResBlock(hidden) for _ in range(num_layers)]
            if vocab:
                mods.append(nn.Linear(hidden, vocab, bias=False))
            heads.append(nn.Sequential(*mods))
        super().__init__(heads)
        self.hidden, self.num_heads, self.num_layers, self.vocab = hidden, num_heads, num_layers, vocab
        self.register_buffer("token_map", None if token_map is None else token_map.long())
        self._shared = {"head": None}  # the target's LM head (or its token_map rows): not owned, not saved

    def attach_target(self, target, pack: bool = False) -> None:
        """Share the target's LM head; with a token_map and no own heads, a copy of its rows for those tokens
        (`pack`: in the kernel the host picks for dense drafter weights, as at inference)."""
        V = target.config.vocab_size
        full = V if self.token_map is None else self.token_map.numel()
        if self.vocab is not None and self.vocab != full:
            raise SpecloomError(f"Medusa heads score {self.vocab} tokens, the target has {V}"
                                + ("" if self.token_map is None else f" and the token_map holds {full}"))
        head = target.lm_head
        if self.token_map is not None and self.vocab is None:
            w = head.weight
            sub = nn.Linear(w.shape[1], full, bias=False, device=w.device, dtype=w.dtype).requires_grad_(False)
            with torch.no_grad():
                sub.weight.copy_(w.detach()[self.token_map.to(w.device)])
            holder = nn.ModuleDict({"head": sub})
            if pack:
                from ...models.cpu_packing import pack_linears

                pack_linears(holder)
            head = holder["head"]
        self._shared["head"] = head

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (..., H) post-norm target hidden -> (K, ..., V or V_d) fp32 logits over the head vocabulary."""
        x = h.to(self[0][0].linear.weight.dtype)
        if self.vocab:
            return torch.stack([head(x).float() for head in self])
        # heads sharing the target's LM head: one head call over all K rows (it reads the 49k x H weight once)
        y = torch.stack([head(x) for head in self])
        head_lm = self._shared["head"]
        return head_lm(y.to(compute_dtype(head_lm))).float()

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Head-vocabulary ids -> target token ids (the identity without a token_map)."""
        return ids if self.token_map is None else self.token_map[ids]


def default_choices(num_heads: int, accuracy: list[list[float]] | None, num_nodes: int) -> list[list[int]]:
    """Grow a tree greedily by estimated path probability (product of per-head top-rank accuracies, Medusa's
    `generate_tree` idea); without measured accuracies assume a geometric fall-off."""
    if not accuracy:
        accuracy = [[0.5 * 0.6 ** r * 0.8 ** h for r in range(TOPK)] for h in range(num_heads)]
    paths: list[tuple[float, list[int]]] = []
    frontier = [(accuracy[0][r], [r]) for r in range(min(TOPK, len(accuracy[0])))]
    while frontier and len(paths) < num_nodes:
        frontier.sort(key=lambda x: -x[0])
        p, path = frontier.pop(0)
        paths.append((p, path))
        d = len(path)
        if d < num_heads:
            frontier += [(p * accuracy[d][r], path + [r]) for r in range(min(TOPK, len(accuracy[d])))]
    return sorted((pp for _, pp in paths), key=lambda x: (len(x), x))


@register("medusa", {"num_draft_tokens": TREE_KEYS["num_draft_tokens"]}, (".trainer",),
          no_export="Medusa has no speculators kind; the Medusa directory specloom writes is the layout vLLM reads "
                    'with "method": "medusa"')
class MedusaDrafter(Drafter):
    # Idle steps are free: the state is one reference to the target's hidden state at the last accepted node
    # (set by every `on_verified`); there is nothing to catch up.
    idle_free = True

    def __init__(self, heads: MedusaHeads, choices: list[list[int]], feature_id: int, topk_accuracy=None):
        self.heads = heads
        self.topk_accuracy = topk_accuracy
        self.needs_hidden = (feature_id,)
        self.choices = sorted(choices, key=lambda x: (len(x), x))
        self._check_choices()
        self.depth = max(len(c) for c in self.choices)

    def memory(self) -> dict:
        from ..base import module_bytes

        own = self.heads.token_map is not None and self.heads.vocab is None  # the copied LM-head rows
        return {"weights": module_bytes(self.heads, *([self.heads._shared["head"]] if own else [])),
                "kv_per_1k_tokens": 0}

    def _check_choices(self) -> None:
        have = {tuple(c) for c in self.choices}
        for c in self.choices:
            if len(c) > self.heads.num_heads or any(not 0 <= r < TOPK for r in c):
                raise SpecloomError(f"medusa_choices path {c}: needs <= {self.heads.num_heads} heads, ranks < {TOPK}")
            if len(c) > 1 and tuple(c[:-1]) not in have:
                raise SpecloomError(f"medusa_choices path {c}: its parent {c[:-1]} is missing")

    @classmethod
    def check(cls, spec, target_config) -> None:
        from ..checkpoint import find_drafter_dir, read_drafter_config

        read_drafter_config(find_drafter_dir(spec.model, "medusa", target_config), "medusa")

    @classmethod
    def create(cls, spec, target, tokenizer) -> "MedusaDrafter":
        from ..checkpoint import find_drafter_dir, load_drafter

        path = find_drafter_dir(spec.model, "medusa", target.config)
        heads, meta = load_drafter(path, "medusa", target, tokenizer)
        choices = None if spec.num_draft_tokens else meta.get("medusa_choices")
        choices = choices or default_choices(
            heads.num_heads, meta.get("topk_accuracy"), spec.num_draft_tokens or meta.get("num_draft_tokens") or 16)
        if spec.num_speculative_tokens:
            choices = [c for c in choices if len(c) <= spec.num_speculative_tokens]
        d = cls(heads, choices, target.config.num_layers, meta.get("topk_accuracy"))
        d.checkpoint = {"path": path, "meta": meta}
        return d

    @property
    def num_speculative_tokens(self) -> int:
        return self.depth

    def new_state(self) -> dict:
        return {"h": None}  # the target's hidden state at the deepest accepted node

    def prefill(self, ctx: DraftContext, target_out) -> None:
        ctx.state["h"] = target_out.hidden[self.needs_hidden[0]][0, -1]

    def on_verified(self, ctxs, results, target_out) -> None:
        hid = target_out.hidden[self.needs_hidden[0]]
        for b, (ctx, res) in enumerate(zip(ctxs, results)):
            ctx.state["h"] = hid[b, res.path[-1]].clone()  # not a view: a replayed pass reuses its buffers

    @torch.inference_mode()
    def propose(self, ctxs) -> list[DraftTree]:
        """All rows' heads in one call (K, B, V); each row's static tree cut to its depth."""
        top = self.heads.logits(torch.stack([c.state["h"] for c in ctxs])).topk(TOPK, dim=-1).indices
        top = self.heads.target_ids(top).tolist()
        trees = []
        for b, ctx in enumerate(ctxs):
            root = ctx.tokens[-1]
            node_of = {(): 0}
            tokens, parents = [root], [-1]
            for c in self.choices:
                if len(c) > ctx.k:
                    continue
                node_of[tuple(c)] = len(tokens)
                parents.append(node_of[tuple(c[:-1])])
                tokens.append(top[len(c) - 1][b][c[-1]])
            trees.append(DraftTree(tokens, parents))
        return trees
