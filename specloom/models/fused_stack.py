"""The decoder layers of a bf16 GGUF target in one C call per forward pass (kernels/decoder_stack.c; issue 37,
"a lean step").

A decode step of SmolLM2-135M runs ~300 small ops; from Python each costs microseconds of dispatch, ~35 % of the
step once the weights are read as shipped. `run` hands the whole layer loop to C, which calls the same C kernels
the layers call (GGML linears, RMSNorm, RoPE, silu * up, the batch-invariant attention) in the same order: the
same bits as the layer-by-layer path (tested), so decode steps, verification passes and prefill chunks may take
either path and speculative output stays plain output.

It runs where a block declares `fused_stack = True` (models/llama.py: pre-norm attention + gated silu MLP, no q/k
norm, full attention) and the pass allows: bf16 activations outside autograd, every linear held as GGML blocks
(models/ggml_linear.py), the invariant attention, an unquantized KV store written at one start slot for all rows.
Anywhere else `run` returns None and the layers run one by one. `SPECLOOM_FUSED_STACK=0` turns it off.
"""

from __future__ import annotations

import ctypes
import os

import torch
import torch.nn.modules.module as mod

from . import ggml_linear, invariant_attention, layer_ops
from .ggml_linear import GGMLLinear
from .native import load_kernel

P, L, I, F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
RUNS = 4


class _Ops(ctypes.Structure):
    _fields_ = [(n, P) for n in ("vlinear", "blinear", "norm", "rope", "silu_mul", "attend", "add", "narrow", "widen")]


class _Lin(ctypes.Structure):
    _fields_ = [("n", I), ("type", I * RUNS), ("w", P * RUNS), ("scales", P * RUNS), ("rows", L * RUNS),
                ("row_bytes", L * RUNS), ("bias", P), ("out", L)]


class _Layer(ctypes.Structure):
    _fields_ = [("norm1", P), ("norm2", P), ("qkv", _Lin), ("o", _Lin), ("gu", _Lin), ("down", _Lin)]


class _Pass(ctypes.Structure):
    _fields_ = [("B", L), ("T", L), ("Hd", L), ("H", L), ("Hkv", L), ("D", L), ("I", L), ("eps", F), ("scale", F),
                ("k", P), ("v", P), ("kv_bf16", I), ("lstride", L), ("rstride", L), ("smax", L), ("start", L),
                ("S", L), ("cos", P), ("sin", P), ("mask", P), ("msb", L), ("mst", L), ("chunk", I),
                ("threads", I), ("force_avx2", I), ("prof", P), ("ain", P), ("ain_k", L)]


_state: dict = {}  # the kernel (load_kernel's: "fn" or "why")
_ops_state: dict = {}  # the op table (apart: load_kernel reads any entry in its dict as "already loaded")
PROFILE: list | None = None  # a list of 3 floats: seconds spent in the stack's linears, attention, whole calls
_prof = (ctypes.c_double * 3)()


def _kernel():
    if os.environ.get("SPECLOOM_FUSED_STACK", "1") == "0":
        return None
    return load_kernel(_state, "decoder_stack.c", "llama_stack", [P, P, I, I, P, P], lambda fn: None)


def _addr(fn) -> int | None:
    return None if fn is None else ctypes.cast(fn, P).value


def _ops() -> _Ops | None:
    if "ops" not in _ops_state:
        v = ggml_linear._vfns()
        norm, rope, silu = layer_ops._fns()
        ew = layer_ops.elementwise() or {}
        fns = dict(vlinear=_addr(v["ggml_vlinear"]) if v else None, blinear=_addr(ggml_linear._load()),
                   norm=_addr(norm), rope=_addr(rope), silu_mul=_addr(silu), attend=_addr(invariant_attention._load()),
                   add=_addr(ew.get("add_bf16")), narrow=_addr(ew.get("f32_to_bf16")), widen=_addr(ew.get("bf16_to_f32")))
        _ops_state["ops"] = None if any(a is None for k, a in fns.items() if k != "vlinear") else _Ops(**fns)
    return _ops_state["ops"]


def _lin(m, dtype: torch.dtype, keep: list) -> _Lin | None:
    if type(m) is not GGMLLinear or len(m.ws) > RUNS or m.dtype != dtype:
        return None
    if m.bias is not None and m.bias.dtype != dtype:
        return None
    d = _Lin(n=len(m.ws), out=m.out_features)
    for i, w in enumerate(m.ws):
        d.type[i], d.rows[i] = w.type_id, w.rows
        if w.blocks is None:
            if _ops().vlinear is None:
                return None
            d.w[i], d.scales[i] = w.codes.data_ptr(), w.scales.data_ptr()
        else:
            d.w[i], d.row_bytes[i] = w.blocks.data_ptr(), w.blocks.shape[1]
    if m.bias is not None:
        b = m.bias.contiguous()
        keep.append(b)
        d.bias = b.data_ptr()
    return d


_epoch = [0]  # bumped whenever any module registers a submodule, parameter or buffer (a swapped linear, say)


def _bump(*_args):
    _epoch[0] += 1


for _register in (mod.register_module_module_registration_hook, mod.register_module_parameter_registration_hook,
                  mod.register_module_buffer_registration_hook):
    _register(_bump)


def _norm_key(norm_ws: list) -> tuple:
    """The norm weights' storage and in-place versions (a reloaded norm builds the fp32 copies again)."""
    return tuple((w.data_ptr(), layer_ops.version(w)) for w in norm_ws)


class _Stack:
    """The C description of a run of decoder layers (`layers`, a `_Layer` array) and the shapes they share; `ok`
    False where some layer cannot run fused."""

    def __init__(self, model):
        self.epoch, self.keep, self.ok, self.norm_ws, self.norm_key = _epoch[0], [], False, [], ()
        c = model.config
        if not getattr(model.block_cls, "fused_stack", False) or model.layer_kinds != {"full"}:
            return
        parts = []
        for layer in model.layers:
            at, mlp = layer.self_attn, layer.mlp
            if at.q_norm is not None or at.kind != "full" or getattr(mlp, "act", None) is not torch.nn.functional.silu:
                return
            parts.append((layer.input_layernorm, layer.post_attention_layernorm, at.qkv_proj, at.o_proj,
                          getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None), at.scale,
                          mlp.intermediate))
        self._build(parts, model.dtype, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size)

    def _build(self, parts: list, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, hidden: int) -> None:
        """parts: per layer (norm1, norm2, qkv, o, gate_up, down, attention scale, intermediate size)."""
        if not invariant_attention.supports(head_dim) or head_dim > 16384:
            return
        self.norm_ws = [n.weight for part in parts for n in part[:2]]
        self.norm_key = _norm_key(self.norm_ws)
        layers = (_Layer * len(parts))()
        eps, scale, inter = set(), set(), set()
        for i, (n1, n2, qkv, o, gu, down, sc, it) in enumerate(parts):
            lins = [_lin(m, dtype, self.keep) for m in (qkv, o, gu, down)]
            if any(d is None for d in lins):
                return
            layers[i].qkv, layers[i].o, layers[i].gu, layers[i].down = lins
            for j, norm in enumerate((n1, n2)):
                w = norm._w32()
                self.keep.append(w)
                setattr(layers[i], f"norm{j + 1}", w.data_ptr())
                eps.add(norm.eps)
            scale.add(sc)
            inter.add(it)
        if len(eps) != 1 or len(scale) != 1 or len(inter) != 1:
            return
        self.layers, self.eps, self.scale, self.inter = layers, eps.pop(), scale.pop(), inter.pop()
        self.heads, self.kv_heads, self.head_dim, self.hidden = heads, kv_heads, head_dim, hidden
        self.ok = True


class DrafterLayer(_Stack):
    """One drafter decoder layer shaped like a Llama layer whose attention reads its own input (an EAGLE layer:
    `run(..., ain=...)`): the norm before attention is the caller's, `norm2` the one before the MLP; linears
    held as GGML weights (a drafter's `DraftQ8Linear`s, cpu_packing.py). It keeps those modules alive itself, so,
    unlike a target's stack, it does not go stale when some other module anywhere registers a weight (`_epoch`);
    its owner builds it again when it replaces them (`EagleDraftModel.stack_projections`)."""

    def __init__(self, norm2, qkv, o, gate_up, down, scale: float, inter: int, dtype: torch.dtype, heads: int,
                 kv_heads: int, head_dim: int, hidden: int):
        self.epoch, self.keep, self.ok, self.norm_ws, self.norm_key = _epoch[0], [qkv, o, gate_up, down], False, [], ()
        self._build([(norm2, norm2, qkv, o, gate_up, down, scale, inter)], dtype, heads, kv_heads, head_dim, hidden)


class _Eagle(ctypes.Structure):
    _fields_ = [("fc", _Lin), ("head", _Lin), ("norm_e", P), ("norm_u", P), ("norm_o", P), ("vrows", P),
                ("emb_type", I), ("emb_codes", P), ("emb_scales", P), ("emb_dense", P), ("F", L)]


_eagle_state: dict = {}


def _eagle_kernel():
    if os.environ.get("SPECLOOM_FUSED_STACK", "1") == "0":
        return None
    return load_kernel(_eagle_state, "decoder_stack.c", "eagle3_pass", [P] * 9, lambda fn: None)


class EagleStep:
    """An EAGLE-3 drafting pass in one C call (kernels/decoder_stack.c `eagle3_pass`): the input projection of the
    target's features, the embedding rows, the two norms and their concatenation, the layer (`DrafterLayer`), the
    output norm, the head and its argmax. A drafting step run from Python was ~400 calls around ~0.3 ms of C
    (`propose` 0.52-0.67 ms on a 2-core EPYC, ~0.2 of a SmolLM2 decode step). `ok` False where a part is not
    held as the kernels need it: every linear a GGML one (`DraftQ8Linear`), the target's embedding repacked
    GGML rows (AVX512-BF16) or a bf16 table, one epsilon for all norms."""

    def __init__(self, layer: DrafterLayer | None, fc, head, norm_e, norm_u, norm_o, embed, features: int):
        from .cpu_packing import DraftQ8Linear
        from .ggml_linear import GGMLEmbedding

        self.ok, self.layer, self.keep = False, layer, []
        vf = ggml_linear._vfns()
        rows = type(embed) is GGMLEmbedding and embed.w.blocks is None and vf is not None \
            and embed.dtype == torch.bfloat16  # repacked GGML rows (a GGUF target on AVX512-BF16) ...
        dense = type(embed) is torch.nn.Embedding and embed.weight.dtype == torch.bfloat16 \
            and embed.weight.device.type == "cpu" and embed.weight.is_contiguous()  # ... or a bf16 table
        if layer is None or not layer.ok or not all(isinstance(m, DraftQ8Linear) for m in (fc, head)) \
                or not (rows or dense) or {n.eps for n in (norm_e, norm_u, norm_o)} != {layer.eps}:
            return
        fl, hl = _lin(fc.q8, torch.bfloat16, self.keep), _lin(head.q8, torch.bfloat16, self.keep)
        if fl is None or hl is None or fc.bias is not None or head.bias is not None:
            return
        self.keep += [fc, head, embed]
        self.norms = [norm_e, norm_u, norm_o]
        self.norm_key = _norm_key([n.weight for n in self.norms])
        w = [n._w32() for n in self.norms]
        self.keep += w
        self.desc = _Eagle(fc=fl, head=hl, norm_e=w[0].data_ptr(), norm_u=w[1].data_ptr(), norm_o=w[2].data_ptr(),
                           F=features)
        if rows:
            self.desc.vrows, self.desc.emb_type = _addr(vf["ggml_vrows"]), embed.w.type_id
            self.desc.emb_codes, self.desc.emb_scales = embed.w.codes.data_ptr(), embed.w.scales.data_ptr()
        else:
            self.desc.emb_dense = embed.weight.data_ptr()
        self.emb_key = (embed.weight.data_ptr(), layer_ops.version(embed.weight)) if dense else None
        self.embed = embed
        self.hidden, self.vocab = layer.hidden, head.out_features
        self.ok = True


def run_eagle3(step: EagleStep | None, feats: torch.Tensor, ids: torch.Tensor, kvp, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One row's EAGLE-3 pass over M new positions, causal over the row's last M slots of the KV pass `kvp`:
    feats (M, F) bf16 target features, ids (M,) int64 the tokens that follow them -> (the layer's outputs (M, H)
    bf16, the last row's logits (V,) bf16, its argmax (a 0-d int64 tensor)); None where the pass does not allow
    it (then the model runs layer by layer)."""
    layer = None if step is None else step.layer
    if step is None or not step.ok or _eagle_kernel() is None or _ops() is None or feats.dtype != torch.bfloat16 \
            or layer.norm_key != _norm_key(layer.norm_ws) or step.norm_key != _norm_key([n.weight for n in step.norms]) \
            or (step.emb_key is not None and step.emb_key != (step.embed.weight.data_ptr(),
                                                              layer_ops.version(step.embed.weight))):
        return None
    M = feats.shape[0]
    x = torch.empty(1, M, step.hidden, dtype=torch.bfloat16)
    if kvp.n != 1 or not _usable(x, kvp, cos, sin, layer.head_dim):
        return None
    p, _ = _pass(layer, 1, M, kvp, None, cos, sin)
    feats, ids = feats.contiguous(), ids.contiguous()
    logits = torch.empty(step.vocab, dtype=torch.bfloat16)
    best = torch.zeros((), dtype=torch.int64)
    rc = _eagle_kernel()(ctypes.byref(_ops_state["ops"]), layer.layers, ctypes.byref(step.desc), ctypes.byref(p),
                         feats.data_ptr(), ids.data_ptr(), x.data_ptr(), logits.data_ptr(), best.data_ptr())
    if rc == -2:
        raise MemoryError("eagle3 pass: could not allocate its buffers")
    if rc != 0:
        raise RuntimeError(f"eagle3 pass: a kernel failed (code {rc})")
    return x[0], logits, best


def _stack(model) -> _Stack | None:
    if _kernel() is None or _ops() is None:
        return None
    st = model.__dict__.get("_fused_stack")
    if st is None or st.epoch != _epoch[0] or st.norm_key != _norm_key(st.norm_ws):
        st = _Stack(model)
        model.__dict__["_fused_stack"] = st
    return st if st.ok else None


def run(model, x: torch.Tensor, ctx, stops: list[int]) -> tuple[torch.Tensor, dict] | None:
    """x (B, T, H) the embedding output -> (the last layer's output, {stop: the output of layer stop - 1}) for the
    capture ids `stops` (0 < stop < L); None where the pass or the model does not allow it."""
    if not ctx.invariant or "full" not in ctx.cos_sin or "sliding" in ctx.cos_sin:  # every layer full attention
        return None
    cos, sin = ctx.cos_sin["full"]
    st = _stack(model) if _usable(x, ctx.kv, cos, sin, model.config.head_dim) else None
    if st is None:
        return None
    return _call(st, x, ctx, cos, sin, stops, len(model.layers))


def run_layer(layer: DrafterLayer | None, u: torch.Tensor, ain: torch.Tensor, ctx, cos: torch.Tensor,
              sin: torch.Tensor) -> torch.Tensor | None:
    """A drafter layer's pass in one C call: u (B, T, H) the residual stream, ain (B, T, K) bf16 its attention's
    input; returns the layer's output (B, T, H), or None where the layer or the pass does not allow it."""
    if layer is None or not layer.ok or _kernel() is None or _ops() is None or ain.dtype != torch.bfloat16 \
            or not _usable(u, ctx.kv, cos, sin, layer.head_dim) or layer.norm_key != _norm_key(layer.norm_ws):
        return None
    a = ain.contiguous()
    out, _ = _call(layer, u, ctx, cos, sin, [], 1, (a.data_ptr(), a.shape[-1]))
    return out


def _usable(x: torch.Tensor, kvp, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> bool:
    """Whether a pass can run in C: bf16 activations outside autograd, an unquantized contiguous fp32/bf16 KV store
    written at one start slot for all rows, bf16 RoPE tables for exactly the pass's rows."""
    if not layer_ops.usable(x) or not getattr(kvp, "uniform", False):
        return False
    store = kvp.kv
    if store.k_scale is not None or store.k.dtype not in (torch.float32, torch.bfloat16) \
            or not store.k.is_contiguous() or not store.v.is_contiguous():
        return False
    B, T, _ = x.shape
    return (B, T) == (kvp.n, kvp.T) and cos.dtype == torch.bfloat16 and cos.is_contiguous() \
        and sin.is_contiguous() and cos.numel() == B * T * head_dim


def _pass(st: _Stack, B: int, T: int, kvp, mask, cos, sin) -> tuple[_Pass, torch.Tensor | None]:
    """The C description of a pass of B rows x T tokens through the KV pass `kvp` (and the mask it points into,
    to keep alive while it runs)."""
    store = kvp.kv
    _, R, Hkv, smax, D = store.k.shape
    es = store.k.element_size()
    p = _Pass(B=B, T=T, Hd=st.hidden, H=st.heads, Hkv=st.kv_heads, D=st.head_dim, I=st.inter, eps=st.eps,
              scale=st.scale, kv_bf16=int(store.k.dtype == torch.bfloat16), lstride=R * Hkv * smax * D,
              rstride=Hkv * smax * D, smax=smax, start=kvp.start, S=kvp.S, cos=cos.data_ptr(), sin=sin.data_ptr(),
              threads=torch.get_num_threads(), force_avx2=int(ggml_linear.FORCE_AVX2))
    r0 = kvp.rows[0]
    p.k = store.k.data_ptr() + r0 * p.rstride * es
    p.v = store.v.data_ptr() + r0 * p.rstride * es
    if mask is not None:
        mask = mask.expand(B, 1, T, kvp.S)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        p.mask, p.msb, p.mst = mask.data_ptr(), mask.stride(0), mask.stride(2)
    p.chunk = invariant_attention._chunk(B * st.heads * T, p.threads)
    return p, mask


def _call(st: _Stack, x: torch.Tensor, ctx, cos, sin, stops: list[int], n_layers: int, ain=None):
    B, T, _ = x.shape
    p, _mask = _pass(st, B, T, ctx.kv, ctx.masks.get("full"), cos, sin)
    if ain is not None:
        p.ain, p.ain_k = ain
    if PROFILE is not None:
        _prof[:3] = [0.0, 0.0, 0.0]
        p.prof = ctypes.cast(_prof, P)
    x = x.contiguous().clone()
    hidden, a, fn = {}, 0, _kernel()
    for b in [s for s in sorted(set(stops)) if 0 < s < n_layers] + [n_layers]:
        rc = fn(ctypes.byref(_ops_state["ops"]), st.layers, a, b, ctypes.byref(p), x.data_ptr())
        if rc == -2:
            raise MemoryError("decoder stack: could not allocate its buffers")
        if rc != 0:
            raise RuntimeError(f"decoder stack: a kernel failed (code {rc})")
        if b < n_layers:
            hidden[b] = x.clone()
        a = b
    if PROFILE is not None:
        PROFILE[:] = [u + v for u, v in zip(PROFILE, _prof)]
    return x, hidden
