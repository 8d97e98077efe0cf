"""The EAGLE drafter network (EAGLE-1 and EAGLE-3): one definition for training and inference.

Both read target features and the embedding of the *next* token (the shift by one of drafters.md §0.1: row t
pairs feature f_t with token x_{t+1}, sits at RoPE position t and predicts x_{t+2}).

EAGLE-1 (`eagle3=False`):  z = fc([embed(x_{t+1}), f_t]) (bias), f_t = the target's final post-norm state;
    h = z + Attn(z); h = h + MLP(post_ln(h)); logits = target.lm_head(h)   (no input norm, no final norm)
EAGLE-3 (`eagle3=True`):   u = fc(cat[h_low, h_mid, h_high]) (no bias) for target rows, u = previous h for
    drafted rows; a = [input_ln(embed(x)), hidden_norm(u)] (2H wide); h = u + Attn(a); h = h + MLP(post_ln(h));
    logits = lm_head(norm(h)) over the draft vocabulary (`d2t`: draft id i -> target id i + d2t[i]).

Inference (`forward`) runs over a drafter KV cache with an explicit mask; training (`ttt_forward`) unrolls the
training-time test: step j feeds the drafter's own output of step j-1 and sees the real context's keys plus the
diagonal keys of its own earlier steps, exactly what a node at depth j+1 of a draft tree sees.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ...config import RopeScaling
from ...kv import KVCache, default_kv_dtype
from ...models.cpu_packing import compute_dtype
from ...models import fused_stack
from ...models.context import attention_context
from ...models.layers import RMSNorm, Rope, apply_rope


def eagle3_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default feature ids (HF hidden_states index): low, middle, high."""
    return (2, num_layers // 2, num_layers - 3)


class DraftConfigDict:
    """JSON round trip for drafter config dataclasses (feature ids as a list, RoPE scaling as a dict; unknown keys
    ignored on reading)."""

    def to_dict(self) -> dict:
        d = asdict(self)
        d["feature_ids"] = list(self.feature_ids)
        d["rope_scaling"] = asdict(self.rope_scaling) if self.rope_scaling else None
        return d

    @classmethod
    def from_dict(cls, d: dict):
        d = dict(d)
        d["feature_ids"] = tuple(d["feature_ids"])
        if d.get("rope_scaling"):
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


@dataclass
class EagleConfig(DraftConfigDict):
    eagle3: bool
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # == vocab_size for EAGLE-1
    feature_ids: tuple[int, ...]  # HF hidden_states ids read from the target (EAGLE-1: (L,), EAGLE-3: 3 ids)
    target_hidden_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    fc_bias: bool = True  # EAGLE-1 reference: True; EAGLE-3: always False
    max_position: int = 8192
    # EAGLE-3 feature and recurrence norms (speculators' flags, drafters.md): one RMSNorm over the concatenated
    # features before fc (`norm_before_fc`, gpt-oss style), or one per feature (`fc_norm`, EAGLE-3.1); and the
    # drafted rows fed norm(h) instead of h (`norm_output`, EAGLE-3.1)
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    extra: dict = field(default_factory=dict)



def stacked_kernel(linears) -> nn.Module:
    """Inference only: one kernel for bias-free linears that read the same input, their weights stacked by rows
    (a copy; each output is the same dot product as in its own linear). Kept out of the module tree (state dicts
    and training see only the separate linears); used under inference mode only (`_stacked`)."""
    from ...models.cpu_packing import draft_kernel

    w = torch.cat([lin.weight.detach() for lin in linears])
    stacked = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
    stacked.weight = nn.Parameter(w, requires_grad=False)
    kernel = draft_kernel(stacked)
    if kernel is not stacked and (torch.is_tensor(getattr(kernel, "packed", None)) or hasattr(kernel, "q8")):
        kernel.weight = None  # a packed (or Q8_0) kernel reads only its own copy
    return kernel


def _stacked(module: nn.Module, name: str):
    """The stacked kernel `name` of `module` when one was made and this is an inference-mode pass, else None."""
    k = module.__dict__.get(name)
    return k if k is not None and torch.is_inference_mode_enabled() else None


class DraftMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def stack(self) -> None:
        """Inference: gate and up in one matmul."""
        self.__dict__["_gate_up"] = stacked_kernel([self.gate_proj, self.up_proj])

    def forward(self, x):
        k = _stacked(self, "_gate_up")
        if k is not None:
            g, u = k(x).chunk(2, -1)
            return self.down_proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftAttention(nn.Module):
    def __init__(self, in_dim: int, c: EagleConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(in_dim, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.scale = c.head_dim ** -0.5

    def stack(self) -> None:
        """Inference: q, k and v in one matmul."""
        self.__dict__["_qkv"] = stacked_kernel([self.q_proj, self.k_proj, self.v_proj])

    def qkv(self, a, cos, sin):
        B, T, _ = a.shape
        k3 = _stacked(self, "_qkv")
        if k3 is not None:
            qd, kd = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = k3(a).split([qd, kd, kd], -1)
        else:
            q, k, v = self.q_proj(a), self.k_proj(a), self.v_proj(a)
        q = apply_rope(q.view(B, T, self.n_heads, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(k.view(B, T, self.n_kv, self.head_dim), cos, sin).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        return q, k, v  # (B, H, T, d), (B, Hkv, T, d), (B, Hkv, T, d)

    def out(self, o):  # (B, H, T, d) -> (B, T, hidden)
        B, H, T, d = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * d))


class EagleLayer(nn.Module):
    """The single decoder layer (`layers.0` / EAGLE-3 `midlayer`)."""

    def __init__(self, c: EagleConfig):
        super().__init__()
        H = c.hidden_size
        self.eagle3 = c.eagle3
        if c.eagle3:
            self.input_layernorm = RMSNorm(H, c.rms_norm_eps)
            self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.self_attn = DraftAttention(2 * H if c.eagle3 else H, c)
        self.post_attention_layernorm = RMSNorm(H, c.rms_norm_eps)
        self.mlp = DraftMLP(H, c.intermediate_size)

    def attn_input(self, emb, u):
        if self.eagle3:
            return torch.cat([self.input_layernorm(emb), self.hidden_norm(u)], dim=-1)
        return u  # EAGLE-1: layer 0 has no input norm; u = fc([emb, f]) already mixes the token in

    def finish(self, u, attn_out):
        h = u + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleDraftModel(nn.Module):
    def __init__(self, c: EagleConfig, embed_tokens: nn.Embedding | None = None, target_head: nn.Module | None = None):
        super().__init__()
        self.config = c
        H = c.hidden_size
        if c.eagle3:
            self.fc = nn.Linear(len(c.feature_ids) * c.target_hidden_size, H, bias=False)
            self.norm = RMSNorm(H, c.rms_norm_eps)
            self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool))
            if c.norm_before_fc and c.fc_norm:
                raise ValueError("norm_before_fc and fc_norm are exclusive (one norm over the concatenated features, "
                                 "or one per feature)")
            if c.norm_before_fc:
                self.input_norm = RMSNorm(len(c.feature_ids) * c.target_hidden_size, c.rms_norm_eps)
            if c.fc_norm:
                self.fc_norm = nn.ModuleList(RMSNorm(c.target_hidden_size, c.rms_norm_eps) for _ in c.feature_ids)
        else:
            self.fc = nn.Linear(H + c.target_hidden_size, H, bias=c.fc_bias)
        self.layers = nn.ModuleList([EagleLayer(c)])
        self.rope = Rope(c.head_dim, c.rope_theta, c.rope_scaling)
        # Shared with the target, not owned (not in state_dict): kept out of the module tree on purpose.
        self._shared = {"embed": embed_tokens, "head": target_head}

    def attach_target(self, target) -> None:
        self._shared = {"embed": target.embed_tokens, "head": target.lm_head}

    def stack_projections(self) -> None:
        """Inference: q/k/v and gate/up of each layer as one matmul each (copies of the current weights, used
        under inference mode only; on this CPU's packed bf16 kernel the products are bit-identical to the
        separate ones). Call again after changing the weights. Like the packed copies of every linear, the
        copies are not parameters (a packed one holds only its packed weight: 2.9M values for SmolLM2's
        drafter) and `memory()` does not count them."""
        for layer in self.layers:
            layer.self_attn.stack()
            layer.mlp.stack()
        self.__dict__["_fused"] = self._fused_layer()

    def _fused_layer(self):
        """The layer as one C call (models/fused_stack.py: the target's decoder-stack kernel, the attention's
        input given), where its projections draft from GGML weights (`DraftQ8Linear`); else None."""
        from ...models.cpu_packing import DraftQ8Linear
        from ...models.fused_stack import DrafterLayer

        layer, c = self.layers[0], self.config
        at, mlp = layer.self_attn, layer.mlp
        ks = [at.__dict__.get("_qkv"), at.o_proj, mlp.__dict__.get("_gate_up"), mlp.down_proj]
        if not all(isinstance(k, DraftQ8Linear) for k in ks):
            return None
        fused = DrafterLayer(layer.post_attention_layernorm, *[k.q8 for k in ks], at.scale, c.intermediate_size,
                             self.dtype, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size)
        return fused if fused.ok else None
    def eagle_step(self):
        """EAGLE-3's whole drafting pass as one C call (models/fused_stack.py `EagleStep`), built on first use and
        again whenever the modules it reads change (a reduced head, new projections, another target's embedding);
        None where it cannot run (EAGLE-1, a norm on the features, a part not held as GGML weights)."""
        from ...models.fused_stack import EagleStep

        c, fused = self.config, self.__dict__.get("_fused")
        if not c.eagle3 or c.norm_before_fc or c.fc_norm or fused is None:
            return None
        layer, embed = self.layers[0], self._shared.get("embed")
        key = (id(fused), id(self.fc), id(self.lm_head), id(embed))
        cached = self.__dict__.get("_step")
        if cached is None or cached[0] != key:
            step = EagleStep(fused, self.fc, self.lm_head, layer.input_layernorm, layer.hidden_norm, self.norm, embed,
                             self.fc.in_features)
            cached = (key, step if step.ok else None)
            self.__dict__["_step"] = cached
        return cached[1]

    @property
    def dtype(self):
        return self.layers[0].mlp.down_proj.weight.dtype

    def embed(self, tokens):
        return self._shared["embed"](tokens).to(self.dtype)

    def input_hidden(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Target rows: features (B, T, F) from the target (concatenated ids) -> u (B, T, H)."""
        if self.config.eagle3:
            f = features.to(self.dtype)
            if self.config.norm_before_fc:
                f = self.input_norm(f)
            elif self.config.fc_norm:
                f = torch.cat([n(x) for n, x in zip(self.fc_norm, f.chunk(len(self.fc_norm), -1))], -1)
            return self.fc(f)
        return self.fc(torch.cat([self.embed(tokens), features.to(self.dtype)], dim=-1))

    def next_input(self, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Drafted rows: the drafter's own output stands in for the target feature (EAGLE-3 feeds it as u,
        EAGLE-1 through fc together with the token embedding)."""
        if self.config.eagle3:
            return self.norm(h) if self.config.norm_output else h
        return self.input_hidden(h, tokens)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Output hidden -> fp32 logits over the draft vocabulary (the full vocabulary for EAGLE-1)."""
        if self.config.eagle3:
            return self.lm_head(self.norm(h)).float()
        return self._shared["head"](h.to(compute_dtype(self._shared["head"]))).float()

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        if self.config.eagle3:
            return draft_ids + self.d2t[draft_ids]
        v = self._shared.get("vocab")
        return draft_ids if v is None else v[draft_ids]

    def expand_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits -> target-vocabulary logits (-inf outside the draft vocabulary)."""
        from ..token_map import expand_logits

        if not self.config.eagle3:
            v = self._shared.get("vocab")
            return logits if v is None else expand_logits(logits, v, self.config.vocab_size)
        if self.config.draft_vocab_size == self.config.vocab_size:
            return logits
        ids = torch.arange(self.config.draft_vocab_size, device=logits.device) + self.d2t
        return expand_logits(logits, ids, self.config.vocab_size)

    # -- a reduced draft vocabulary at inference (FR-Spec; drafters/token_map.py) ------------------------------
    def use_draft_vocab(self, ids: torch.Tensor, head: nn.Module) -> None:
        """EAGLE-1, which scores through the target's head: score only the target ids `ids` (sorted) through
        `head` (those rows of the target's head). Drafts map back to target ids and a sampled q is zero elsewhere,
        so the output is unchanged; only tokens outside cannot be drafted, and the head's share of a drafting
        pass (49,152 x 576 on SmolLM2: 3.5x the drafter's own weights) falls with len(ids) / V."""
        self._shared.update(vocab=ids, head=head)

    def keep_head_rows(self, rows: torch.Tensor) -> None:
        """EAGLE-3, whose own head covers its draft vocabulary (`d2t`): keep only the head rows `rows` (sorted
        positions in it), e.g. the most frequent tokens (`ranked_rows`), for a cheaper drafting pass."""
        from ..token_map import drafting_rows

        ids = (torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t)[rows.to(self.d2t.device)]
        self.lm_head = drafting_rows(self.lm_head, rows)
        self.d2t = ids - torch.arange(ids.numel(), device=ids.device)
        self.t2d = torch.zeros_like(self.t2d)
        self.t2d[ids] = True
        self.config.draft_vocab_size = int(ids.numel())

    # -- inference -------------------------------------------------------------------------------------------
    def forward(self, u: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, kv,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """One pass over T rows appended to the drafter KV (`kv` a store or a pass over some of its rows, see
        kv.py). u: (B, T, H) input hidden (`input_hidden` for target rows, a previous output for drafted rows);
        attn_mask as for the target (models/context.py), None = causal. Returns the output hidden h (B, T, H)
        (pre-norm)."""
        layer = self.layers[0]
        kvp = kv.open(tokens.shape[1])
        if getattr(kvp, "static", False):  # a pass replayed as a CUDA graph (drafters/eagle/graphed.py)
            cos, sin = self.rope.lookup(positions, u.dtype)
            ctx = kvp.context(positions, attn_mask, {})
        else:
            cos, sin = self.rope(positions, u.dtype)
            ctx = attention_context(kvp, positions, attn_mask, {})
        a = layer.attn_input(self.embed(tokens), u) if self.config.eagle3 else u
        fused = self.__dict__.get("_fused")
        if fused is not None and torch.is_inference_mode_enabled():  # the layer in one C call where it can run
            out = fused_stack.run_layer(fused, u, a, ctx, cos, sin)
            if out is not None:
                return out
        q, k, v = layer.self_attn.qkv(a, cos, sin)
        keys, values = kvp.write(0, k, v)  # the store converts to its dtype as it copies
        mask = ctx.masks.get("full")
        o = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask,
                                           is_causal=ctx.causal and mask is None, scale=layer.self_attn.scale,
                                           enable_gqa=layer.self_attn.n_kv != layer.self_attn.n_heads)
        return layer.finish(u, layer.self_attn.out(o.to(u.dtype)))

    def new_kv(self, max_len: int, batch: int = 1, dtype=None) -> KVCache:
        c = self.config
        dt = dtype or default_kv_dtype(self.fc.weight.device, self.dtype)
        return KVCache(1, c.num_kv_heads, c.head_dim, max_len, dt, self.fc.weight.device, batch)

    # -- training --------------------------------------------------------------------------------------------
    def ttt_forward(self, features: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, steps: int):
        """Training-time test over a padded batch. features (B, T, F): target features of positions t;
        tokens (B, T): x_t; valid (B, T) bool. Row t of step j reads token x_{t+1+j} and predicts x_{t+2+j}.
        Yields (j, h_j) with h_j (B, T, H): the output hidden of step j for every row t."""
        layer = self.layers[0]
        att = layer.self_attn
        B, T = tokens.shape
        dev = tokens.device
        pos = torch.arange(T, device=dev)[None].expand(B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()[None, None] & valid[:, None, None, :]
        rep = att.n_heads // att.n_kv
        u, keys0, vals0, diag = None, None, None, []
        for j in range(steps):
            shifted = F.pad(tokens[:, 1 + j:], (0, 1 + j))  # x_{t+1+j}, 0 past the end
            if j == 0:
                u = self.input_hidden(features, shifted)
            else:
                u = self.next_input(u, shifted)
            cos, sin = self.rope(pos + j, u.dtype)
            a = layer.attn_input(self.embed(shifted), u)
            q, k, v = att.qkv(a, cos, sin)
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            if j == 0:
                keys0, vals0 = k, v
            else:
                diag.append((k, v))
            s0 = (q @ keys0.transpose(-1, -2)) * att.scale  # (B, H, T, T)
            s0 = s0.masked_fill(~causal, float("-inf"))
            sd = [(q * dk).sum(-1, keepdim=True) * att.scale for dk, _ in diag]  # (B, H, T, 1) each
            w = torch.softmax(torch.cat([s0, *sd], -1).float(), -1).to(q.dtype)
            o = w[..., :T] @ vals0
            for i, (_, dv) in enumerate(diag):
                o = o + w[..., T + i:T + i + 1] * dv
            h = layer.finish(u, att.out(o))
            yield j, h
            u = h


def eagle_config_for(target_config, eagle3: bool, feature_ids, draft_vocab_size: int | None = None) -> EagleConfig:
    """A drafter shaped like one layer of the target (the published EAGLE recipe)."""
    c = target_config
    return EagleConfig(
        eagle3=eagle3, hidden_size=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, intermediate_size=c.intermediate_size, vocab_size=c.vocab_size,
        draft_vocab_size=draft_vocab_size or c.vocab_size, feature_ids=tuple(feature_ids),
        target_hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        rope_scaling=c.rope_scaling, fc_bias=not eagle3, max_position=c.max_position,
    )


def init_weights(model: EagleDraftModel, seed: int = 0, std: float = 0.02) -> None:
    """HF-style init: normal(0, std) matrices, zero biases, unit norms."""
    g = torch.Generator().manual_seed(seed)
    norms = {id(m.weight) for m in model.modules() if isinstance(m, RMSNorm)}
    for name, p in model.named_parameters():
        if id(p) in norms or name.endswith("norm.weight") or "layernorm" in name:
            nn.init.ones_(p)
        elif p.dim() == 2:
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g) * std)
        else:
            nn.init.zeros_(p)
