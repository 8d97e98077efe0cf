"""The block drafter network (DFlash, DFlash 2, DSpark): one definition for training and inference (drafters.md §5.1,
§5.4, §6.1).

    C = hidden_norm(fc(cat[target features]))            context, one row per committed position
    x = target.embed([anchor, MASK, ..., MASK])          a block of B tokens at positions s .. s+B-1
    per draft layer (Qwen3-style): queries = the block; keys/values = [k_norm(k_proj(C)), v_proj(C)] at the context
        positions (each layer projects C with its own k/v) + the block's own keys; NON-causal inside the block
    h = norm(x); U = target.logits(h)                     the target's embedding and LM head, not owned
    DSpark extras: logits = U + Markov bias B(x_{k-1}) (vanilla | gated | rnn), confidence c_k = sigmoid(proj(...))
    DFlash 2 extras: a two-tap grouped dynamic causal conv along the block around each attention and MLP sublayer
        (`GroupedDynamicConv`), and the candidate selector: per slot the top-k of U, rescored with the token chosen
        before it, score_k = U_k + <P[x_{k-1}] * W h, S[cand_k]> (`CandidateSelector`); q over those k only

`anchor_predicts` False (DFlash): slot p predicts the token at position s+p, drafts = slots 1..B-1.
True (DSpark, speculators `sample_from_anchor`): slot p predicts the token at s+p+1, drafts = slots 0..B-1.
Feature ids are HF `hidden_states` indices (z-lab / DeepSpec decoder-layer-output id k == our k + 1).

Inference keeps a `KVCache` (one entry per draft layer) of context keys/values of committed positions only; the
block's own keys are computed per pass and never stored. Training runs many anchors of a padded batch at once:
block j sees the context of its own sequence before its anchor plus its whole block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...config import RopeScaling
from ...kv import KVCache, default_kv_dtype
from ...models.layers import RMSNorm, Rope, apply_rope
from ..eagle.model import DraftConfigDict, DraftMLP

MARKOV_TYPES = ("vanilla", "gated", "rnn")


@dataclass
class BlockDraftConfig(DraftConfigDict):
    hidden_size: int
    num_layers: int  # draft layers
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    mask_token_id: int
    feature_ids: tuple[int, ...]  # HF hidden_states ids read from the target
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    rope_scaling: RopeScaling | None = None
    anchor_predicts: bool = False  # False: DFlash (drafts = B-1); True: DSpark (drafts = B)
    markov_rank: int = 0  # 0 = no Markov head
    markov_head_type: str = "vanilla"
    confidence_head: bool = False
    confidence_with_markov: bool = True  # the confidence head also reads W1[x_{k-1}] (when there is a Markov head)
    max_position: int = 32768
    conv_kernel_size: int = 0  # DFlash 2: taps of the grouped dynamic causal conv (0 = none, DFlash / DSpark)
    conv_group_size: int = 1  # channels per group sharing one dynamic tap weight
    selector_rank: int = 0  # DFlash 2: rank of the candidate selector's pair score (0 = no selector)
    selector_top_k: int = 16  # candidates per slot the selector chooses among
    input_embedding_scale: float = 1.0  # the block embedding times this (DFlash 2 checkpoints may set it)
    output_multiplier: float = 1.0  # draft logits times this ...
    final_logit_softcapping: float | None = None  # ... then cap * tanh(logits / cap) when set
    # speculators' reduced draft vocabulary (0: none): an own `lm_head` and `markov_w2` of that many rows and
    # `d2t` (draft id i -> target id i + d2t[i]); read and served, never trained here
    draft_vocab_size: int = 0

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.anchor_predicts else self.block_size - 1

    @property
    def first_slot(self) -> int:
        return 0 if self.anchor_predicts else 1



def block_attention(q, kc, vc, kb, vb, ctx_mask, block_size: int, scale: float) -> torch.Tensor:
    """q, kb, vb: (B, h|h_kv, N, d) block rows, N = anchors * block_size, consecutive `block_size` rows forming one
    block; kc, vc: (B, h_kv, S, d) context keys/values; ctx_mask (B, N, S) bool or None (= all context visible).
    Every row attends to the allowed context keys and to all keys of its own block. Returns (B, h, N, d)."""
    dt = kc.dtype
    q, kb, vb = q.to(dt), kb.to(dt), vb.to(dt)
    B, h, N, d = q.shape
    rep = h // kc.shape[1]
    if rep > 1:
        kc, vc, kb, vb = (t.repeat_interleave(rep, 1) for t in (kc, vc, kb, vb))
    S, A = kc.shape[2], N // block_size
    sc = (q @ kc.transpose(-1, -2)) * scale  # (B, h, N, S)
    if ctx_mask is not None:
        sc = sc.masked_fill(~ctx_mask[:, None], float("-inf"))
    qb = q.view(B, h, A, block_size, d)
    sb = (qb @ kb.view(B, h, A, block_size, d).transpose(-1, -2)) * scale  # (B, h, A, bs, bs)
    w = torch.softmax(torch.cat([sc, sb.reshape(B, h, N, block_size)], -1).float(), -1).to(dt)
    ob = w[..., S:].reshape(B, h, A, block_size, block_size) @ vb.view(B, h, A, block_size, d)
    return w[..., :S] @ vc + ob.reshape(B, h, N, d)


class GroupedDynamicConv(nn.Module):
    """DFlash 2's causal conv along a block (drafters.md §5.4): K taps; tap o of the output at slot t reads slot
    t - o (zero before the block's start) through a static per-channel weight base[o] plus a dynamic weight, one per
    group of G channels, projected from the input at slot t. `prepare` wraps the sublayer's input and returns the
    dynamic weights of its output side, which `finish` applies to the sublayer's output. Starts as the identity
    (base tap 0 = 1, the rest and the projection zero): a DFlash layer until trained."""

    def __init__(self, hidden: int, taps: int, group: int):
        super().__init__()
        if hidden % group:
            raise ValueError(f"conv_group_size {group} does not divide the hidden size {hidden}")
        self.taps, self.group = taps, group
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * (hidden // group), bias=False)
        nn.init.zeros_(self.kernel_projection.weight)

    def _conv(self, x, base, dyn, block: int):
        """x (B, N, H), N = blocks x `block`; base (K, H); dyn (B, N, K, H/G) -> (B, N, H)."""
        B, N, H = x.shape
        xb = x.view(B, N // block, block, H)
        dyn = dyn.view(B, N // block, block, self.taps, -1)
        y = None
        for o in range(min(self.taps, block)):
            shifted = xb if o == 0 else torch.nn.functional.pad(xb[:, :, :block - o], (0, 0, o, 0))
            w = base[o].to(x.dtype) + dyn[..., o, :].repeat_interleave(self.group, -1).to(x.dtype)
            y = shifted * w if y is None else y + shifted * w
        return y.view(B, N, H)

    def prepare(self, x, block: int):
        B, N, H = x.shape
        d = self.kernel_projection(x).view(B, N, 2, self.taps, H // self.group)
        return self._conv(x, self.base_kernel[0], d[:, :, 0], block), d[:, :, 1]

    def finish(self, z, d1, block: int):
        return self._conv(z, self.base_kernel[1], d1, block)


class CandidateSelector(nn.Module):
    """DFlash 2's selector (drafters.md §5.4): among the top-k candidates of a slot's logits U, score_k = U[cand_k] +
    sum_r P[prev]_r (W h)_r S[cand_k]_r, prev the token chosen at the slot before (the root at the first). The
    draft distribution is softmax(score) over those k only. The codebooks are stored without `.weight` (z-lab)."""

    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        nn.init.zeros_(self.hidden_projection.weight)  # starts as plain top-k of U (the pair score is zero)

    def scores(self, logits, h, prev, cand=None, vocab=None):
        """logits (..., V) fp32, h (..., H), prev (...,) -> (scores (..., k) fp32, candidates (..., k)).
        `vocab`: the target ids of a reduced draft vocabulary's logits (the codebooks are indexed by target id)."""
        if cand is None:
            cand = logits.topk(min(self.top_k, logits.shape[-1]), -1).indices
        unary = logits.gather(-1, cand)
        hp = self.hidden_projection(h).float() * self.predecessor_codebook[prev].float()  # (..., r)
        succ = self.successor_codebook[cand if vocab is None else vocab[cand]]
        pair = (succ.float() @ hp[..., :, None]).squeeze(-1)  # (..., k)
        return unary + pair, cand

    def full(self, logits, h, prev, vocab=None):
        """The scores as logits over the whole (draft) vocabulary, -inf outside the candidates (what drafting
        draws from: its argmax is the selector's choice, its softmax the q verification needs)."""
        sc, cand = self.scores(logits, h, prev, vocab=vocab)
        return torch.full_like(logits, float("-inf")).scatter_(-1, cand, sc)


class BlockAttention(nn.Module):
    def __init__(self, c: BlockDraftConfig):
        super().__init__()
        H = c.hidden_size
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(H, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(H, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(H, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, H, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.scale = c.head_dim ** -0.5

    def keys(self, x, cos, sin):
        """(B, T, H) -> k, v (B, h_kv, T, d): used for the context C and for the block alike."""
        B, T, _ = x.shape
        k = apply_rope(self.k_norm(self.k_proj(x).view(B, T, self.n_kv, self.head_dim)), cos, sin)
        return k.transpose(1, 2), self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)

    def query(self, x, cos, sin):
        B, T, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)), cos, sin)
        return q.transpose(1, 2)

    def out(self, o):  # (B, h, T, d) -> (B, T, H)
        B, h, T, d = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, h * d))


class BlockLayer(nn.Module):
    def __init__(self, c: BlockDraftConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = BlockAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DraftMLP(c.hidden_size, c.intermediate_size)
        if c.conv_kernel_size:
            self.attention_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)
            self.mlp_conv = GroupedDynamicConv(c.hidden_size, c.conv_kernel_size, c.conv_group_size)

    def forward(self, x, cos, sin, kc, vc, ctx_mask, block_size: int):
        a = self.self_attn
        conv = hasattr(self, "attention_conv")
        xn = self.input_layernorm(x)
        if conv:
            xn, d = self.attention_conv.prepare(xn, block_size)
        kb, vb = a.keys(xn, cos, sin)
        o = a.out(block_attention(a.query(xn, cos, sin), kc, vc, kb, vb, ctx_mask, block_size, a.scale).to(x.dtype))
        x = x + (self.attention_conv.finish(o, d, block_size) if conv else o)
        m = self.post_attention_layernorm(x)
        if conv:
            m, d = self.mlp_conv.prepare(m, block_size)
        m = self.mlp(m)
        return x + (self.mlp_conv.finish(m, d, block_size) if conv else m)


class MarkovHead(nn.Module):
    """Logit bias from the previous token (§6.1): vanilla W2(W1[x]); gated W2(sigmoid(gate_proj([h; W1[x]])) *
    W1[x]); rnn z = [s; W1[x]; h], (g, c, o) = joint_proj(z), s <- sig(g) s + (1 - sig(g)) tanh(c), W2(tanh(o))."""

    def __init__(self, c: BlockDraftConfig):
        super().__init__()
        r, H = c.markov_rank, c.hidden_size
        self.kind, self.rank = c.markov_head_type, r
        self.markov_w1 = nn.Embedding(c.vocab_size, r)
        self.markov_w2 = nn.Linear(r, c.draft_vocab_size or c.vocab_size, bias=False)
        if self.kind == "gated":
            self.gate_proj = nn.Linear(H + r, r)
        elif self.kind == "rnn":
            self.joint_proj = nn.Linear(2 * r + H, 3 * r)

    def forward(self, prev: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None = None, w2=None):
        """prev (...,) previous tokens, h (..., H) slot hidden -> (bias (..., V) fp32, new rnn state or None).
        `w2`: the output rows of a reduced draft vocabulary (default all of `markov_w2`)."""
        e = self.markov_w1(prev).to(h.dtype)
        if self.kind == "vanilla":
            z = e
        elif self.kind == "gated":
            z = torch.sigmoid(self.gate_proj(torch.cat([h, e], -1))) * e
        else:
            s = torch.zeros_like(e) if state is None else state.to(e.dtype)
            g, cand, o = self.joint_proj(torch.cat([s, e, h], -1)).chunk(3, -1)
            g = torch.sigmoid(g)
            state = g * s + (1 - g) * torch.tanh(cand)
            z = torch.tanh(o)
        return (self.markov_w2 if w2 is None else w2)(z).float(), state


class ConfidenceHead(nn.Module):
    """c_k = sigmoid(proj([h_k; W1[x_{k-1}]])): the chance that slot k is accepted given its prefix was."""

    def __init__(self, c: BlockDraftConfig):
        super().__init__()
        extra = c.markov_rank if (c.markov_rank and c.confidence_with_markov) else 0
        self.proj = nn.Linear(c.hidden_size + extra, 1)

    def forward(self, h: torch.Tensor, e: torch.Tensor | None) -> torch.Tensor:
        """Logit of c (...,) fp32."""
        x = h if e is None else torch.cat([h, e.to(h.dtype)], -1)
        return self.proj(x).float().squeeze(-1)


class BlockDraftModel(nn.Module):
    def __init__(self, c: BlockDraftConfig, target=None):
        super().__init__()
        if c.markov_head_type not in MARKOV_TYPES:
            raise ValueError(f"markov_head_type must be one of {MARKOV_TYPES}, got {c.markov_head_type!r}")
        self.config = c
        H = c.hidden_size
        self.fc = nn.Linear(len(c.feature_ids) * c.target_hidden_size, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList(BlockLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.rope = Rope(c.head_dim, c.rope_theta, c.rope_scaling)
        if c.markov_rank:
            self.markov_head = MarkovHead(c)
        if c.confidence_head:
            self.confidence_head = ConfidenceHead(c)
        if c.selector_rank:
            self.candidate_selector = CandidateSelector(c.vocab_size, H, c.selector_rank, c.selector_top_k)
        if c.draft_vocab_size:  # a checkpoint's reduced vocabulary: its own head rows and their target ids
            self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        # The target's embedding and LM head are shared, not owned: kept out of the module tree on purpose.
        self._shared = {"target": target}

    def attach_target(self, target) -> None:
        self._shared = {"target": target}  # (and a reduced draft vocabulary's rows: `use_draft_vocab`)

    @property
    def dtype(self):
        return self.fc.weight.dtype

    @property
    def has_markov(self) -> bool:
        return self.config.markov_rank > 0

    @property
    def has_confidence(self) -> bool:
        return self.config.confidence_head

    def reset_extras(self) -> None:
        """DFlash 2's neutral start (after a generic random init): every conv the identity, the selector's pair
        score zero with random codebooks -- the network is then DFlash's and the extras learn from there."""
        with torch.no_grad():
            for mod in self.modules():
                if isinstance(mod, GroupedDynamicConv):
                    mod.base_kernel.zero_()
                    mod.base_kernel[:, 0] = 1.0
                    mod.kernel_projection.weight.zero_()
                elif isinstance(mod, CandidateSelector):
                    mod.hidden_projection.weight.zero_()
                    mod.predecessor_codebook.normal_(0, 0.02)
                    mod.successor_codebook.normal_(0, 0.02)

    @property
    def has_selector(self) -> bool:
        return self.config.selector_rank > 0

    def embed(self, tokens):
        x = self._shared["target"].embed(tokens).to(self.dtype)
        s = self.config.input_embedding_scale
        return x if s == 1.0 else x * s

    # -- a reduced draft vocabulary (inference only: FR-Spec's, drafters/token_map.py) ---------------------------
    def use_draft_vocab(self, ids: torch.Tensor, head: nn.Module) -> None:
        """Score only the target ids `ids` (sorted, (V_d,)) through `head` (their V_d rows of the target's head):
        slot logits, the Markov bias and the selector's candidates are then over those tokens, drafts are mapped
        back (`to_target_ids`) and a sampled q is zero elsewhere (`expand_logits`: the q verification divides
        by), so the output is unchanged; only tokens outside cannot be drafted. The drafting cost of the head, the
        bias and the tree's top-k falls with V_d / V."""
        self._shared.update(vocab=ids, head=head)
        if self.has_markov and self.markov_head.markov_w2.out_features == self.config.vocab_size:
            from ..token_map import drafting_rows

            self._shared["markov_w2"] = drafting_rows(self.markov_head.markov_w2, ids)

    @property
    def draft_vocab(self) -> torch.Tensor | None:
        """The target ids a reduced draft vocabulary scores (sorted), or None (the whole vocabulary)."""
        return self._shared.get("vocab")

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        v = self.draft_vocab
        return ids if v is None else v[ids]

    def expand_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits -> target-vocabulary logits (-inf outside a reduced draft vocabulary)."""
        v = self.draft_vocab
        if v is None:
            return logits
        from ..token_map import expand_logits

        return expand_logits(logits, v, self.config.vocab_size)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Normed slot hidden (..., H) -> fp32 logits through the target's head (before any Markov bias or
        selector; over the draft vocabulary where one is reduced), times `output_multiplier`, soft-capped when
        the checkpoint says so."""
        t = self._shared["target"]
        out = t.logits(h.to(t.dtype), self._shared.get("head"))
        c = self.config
        if c.output_multiplier != 1.0:
            out = out * c.output_multiplier
        if c.final_logit_softcapping:
            out = c.final_logit_softcapping * torch.tanh(out / c.final_logit_softcapping)
        return out

    def chain_logits(self, logits, h, prev, state=None):
        """A slot's logits given the token chosen before it (the chain's sequential part): plus the Markov bias
        (DSpark), or the selector's scores over its candidates, -inf elsewhere (DFlash 2), or as they are
        (DFlash). Returns (logits (..., V) fp32, the Markov rnn state)."""
        if self.has_markov:
            bias, state = self.markov_bias(prev, h, state)
            logits = logits + bias
        if self.has_selector:
            logits = self.candidate_selector.full(logits, h, prev, vocab=self.draft_vocab)
        return logits, state

    def markov_bias(self, prev, h, state=None):
        return self.markov_head(prev, h, state, self._shared.get("markov_w2"))

    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        e = self.markov_head.markov_w1(prev) if self.has_markov and self.config.confidence_with_markov else None
        return self.confidence_head(h, e)

    # -- the network -----------------------------------------------------------------------------------------
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features (B, T, F) at RoPE positions (B, T) -> per draft layer the context keys/values (B, h_kv, T, d)."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self.rope(positions, ctx.dtype)
        return [layer.self_attn.keys(ctx, cos, sin) for layer in self.layers]

    def block_hidden(self, tokens, positions, ctx_kv, ctx_mask=None) -> torch.Tensor:
        """tokens, positions (B, N): blocks of `block_size` consecutive rows -> final-normed hidden (B, N, H)."""
        x = self.embed(tokens)
        cos, sin = self.rope(positions, x.dtype)
        for layer, (kc, vc) in zip(self.layers, ctx_kv):
            x = layer(x, cos, sin, kc, vc, ctx_mask, self.config.block_size)
        return self.norm(x)

    # -- inference -------------------------------------------------------------------------------------------
    def new_kv(self, max_len: int, batch: int = 1, dtype=None) -> KVCache:
        c = self.config
        dev = self.fc.weight.device
        dt = dtype or default_kv_dtype(dev, self.dtype)
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, dt, dev, batch)

    def extend(self, kv, features: torch.Tensor, positions: torch.Tensor) -> None:
        """Write the context keys/values of features (B, m, F) at RoPE positions (B, m) through the pass `kv`
        (rows of the drafter's store; the caller commits)."""
        kv.set_positions(positions)
        for i, (k, v) in enumerate(self.context_kv(features, positions)):
            kv.write(i, k, v)  # the store converts (or quantizes) as it copies

    def draft_block(self, kv: KVCache, span, anchors: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One block [anchor, MASK ...] per row of `span` (a kv.RowSpan; anchors, positions (n,)) over each row's
        cached context
        -> slot hidden (n, block_size, H)."""
        c = self.config
        dev = self.fc.weight.device
        n, bs = anchors.shape[0], c.block_size
        toks = torch.full((n, bs), c.mask_token_id, dtype=torch.long, device=dev)
        toks[:, 0] = anchors
        pos = positions[:, None] + torch.arange(bs, device=dev)
        rows = range(span.lo, span.lo + span.n)
        lengths = [kv.lengths[r] for r in rows]
        S = max(lengths)
        ctx = [kv.read(i, span.lo, n, S) for i in range(kv.k.shape[0])]  # (a quantized store: dequantised)
        see = None
        if min(lengths) != S:  # ragged rows: each sees its own context only
            see = (torch.arange(S, device=dev)[None] < torch.tensor(lengths, device=dev)[:, None])
            see = see[:, None].expand(n, bs, S)
        return self.block_hidden(toks, pos, ctx, see)

    # -- training --------------------------------------------------------------------------------------------
    def train_blocks(self, features, tokens, valid, anchors) -> torch.Tensor:
        """features (B, T, F), tokens (B, T), valid (B, T) bool, anchors (B, A) positions -> slot hidden
        (B, A, block_size, H). Block j = [x_anchor_j, MASK ...] at positions anchor_j.. sees its sequence's context
        at positions < anchor_j and its own block."""
        c = self.config
        B, T = tokens.shape
        A, bs = anchors.shape[1], c.block_size
        dev = tokens.device
        ctx_kv = self.context_kv(features, torch.arange(T, device=dev)[None].expand(B, T))
        slot = torch.arange(bs, device=dev)
        btok = torch.full((B, A, bs), c.mask_token_id, dtype=torch.long, device=dev)
        btok[..., 0] = tokens.gather(1, anchors)
        bpos = anchors[..., None] + slot
        see = (torch.arange(T, device=dev)[None, None] < anchors[..., None]) & valid[:, None]  # (B, A, T)
        see = see[:, :, None].expand(B, A, bs, T).reshape(B, A * bs, T)
        h = self.block_hidden(btok.view(B, A * bs), bpos.view(B, A * bs), ctx_kv, see)
        return h.view(B, A, bs, -1)
