"""GGUF weights held as shipped: linears and embeddings that compute from the GGML blocks themselves.

A GGUF target's weights are blocks (SmolLM2: Q4_1, a Q8_0 embedding/head; Gemma-3 and Qwen2.5-Coder Q4_K_M:
Q4_K, Q6_K, Q5_0, Q8_0). Dequantising them to bf16 triples the bytes a decode step reads and rounds every weight
(Q4_1's w = d*q + m with fp16 d and m has more bits than bf16 keeps). `GGMLLinear` keeps the blocks and runs the
batch-invariant kernel kernels/ggml_linear.c: each weight dequantised to fp32 exactly as the `gguf` package
computes it, fp32 accumulation in a fixed order, so a row alone and the same row inside a verification pass give
the same bits (speculative output = plain output) and the products are those of the published weights.

Types with a kernel: `KERNEL_TYPES` (the AVX-512 path runs Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q6_K from registers;
Q5_1 and Q5_K, and every type on an AVX2-only host, go through a scalar dequantisation into a buffer: correct,
slower). Any other GGML type is dequantised at load (the loader says which, once).

`GGMLEmbedding` gathers rows from the same blocks (a tied head and embedding share one copy).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from torch import nn

from .native import load_kernel

# GGML type ids (ggml.h) the kernel knows, by name
KERNEL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
_BLOCK = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 12: (256, 144), 13: (256, 176),
          14: (256, 210)}

_state: dict = {}
_rows_state: dict = {}


def _self_check(fn) -> str | None:
    """Random Q4_1 and Q8_0 weights: the kernel against F.linear on its own dequantisation (fp64), and a row
    alone against the same row in a 7-row pass, bit for bit."""
    g = np.random.default_rng(0)
    for t, (blk, size) in ((3, _BLOCK[3]), (8, _BLOCK[8])):
        n, k = 37, 2 * blk
        raw = g.integers(0, 256, (n, k // blk, size), dtype=np.uint8)
        scales = (g.random((n, k // blk, 2)) * 0.1).astype(np.float16).view(np.uint8)
        raw[:, :, :4] = scales.reshape(n, k // blk, 4)
        if t == 8:
            raw[:, :, 2:4] = g.integers(0, 256, (n, k // blk, 2), dtype=np.uint8)  # codes, not a second scale
        w = torch.from_numpy(raw.reshape(n, -1).copy())
        x = torch.randn(7, k, generator=torch.Generator().manual_seed(0))
        weight = GGMLWeight(w, t, k, repack=False, fn=fn)

        def run(rows):
            y = torch.empty(rows.shape[0], n)
            weight.matmul_into(rows, y, 0)
            return y

        y = run(x)
        ref = (x.double() @ dequantize(w, t, k).double().T).float()
        if not torch.allclose(y, ref, atol=1e-4, rtol=1e-4):
            return f"self-check: max error {(y - ref).abs().max().item():.2e}"
        if not all(torch.equal(run(x[i:i + 1])[0], y[i]) for i in range(7)):
            return "self-check: a row alone differs from the same row in a batch"
    return None


def _load():
    P, L, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return load_kernel(_state, "ggml_linear.c", "ggml_linear", [P, I, P, I, L, P, I, L, L, L, L, I, I], _self_check)


def _rows_check(fn) -> str | None:
    """One Q8_0 row: codes times the fp16 scale."""
    raw = np.zeros((1, 34), dtype=np.uint8)
    raw[0, :2] = np.array([0.5], dtype=np.float16).view(np.uint8)
    raw[0, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    w, ids, out = torch.from_numpy(raw), torch.zeros(1, dtype=torch.int64), torch.empty(1, 32)
    fn(w.data_ptr(), 8, 34, ids.data_ptr(), 1, out.data_ptr(), 32)
    return None if torch.equal(out[0], torch.arange(-16, 16).float() * 0.5) else "self-check: ggml_rows is wrong"


def _rows_fn():
    P, L, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    return load_kernel(_rows_state, "ggml_linear.c", "ggml_rows", [P, I, L, P, L, P, L], _rows_check)


def available() -> bool:
    return _load() is not None


def unavailable_reason() -> str | None:
    _load()
    return _state.get("why")


def has_kernel(type_name: str) -> bool:
    return type_name in KERNEL_TYPES


FORCE_AVX2 = False  # tests: run the AVX2 path on an AVX-512 host (the same bits, by construction)
REPACK = True  # tests: False keeps the blocks as shipped on an AVX512-BF16 host too


def dequantize(blocks: torch.Tensor, type_id: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 weights (len(rows) or all, K) from the blocks: the kernel's own dequantisation (= the gguf
    package's, bit for bit)."""
    fn = _rows_fn()
    if fn is None:
        raise RuntimeError(f"the GGML kernel is unavailable: {unavailable_reason()}")
    ids = (torch.arange(blocks.shape[0]) if rows is None else rows).reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), k, dtype=torch.float32)
    if fn(blocks.data_ptr(), type_id, blocks.shape[1], ids.data_ptr(), ids.numel(), out.data_ptr(), k) != 0:
        raise ValueError(f"GGML type {type_id}: rows of {blocks.shape[1]} bytes do not hold {k} weights")
    return out


# -- the repacked form (AVX512-BF16 hosts): codes side by side per 16 rows, bf16 dot products --------------------

_v: dict = {}


def _vfns():
    """The repacked path's C functions, or None where this CPU lacks AVX512-BF16 (or the kernel is unavailable)."""
    if not _v:
        if _load() is None:
            _v["fns"] = None
        else:
            from .native import _open, compiler

            lib = _open(compiler(), "ggml_linear.c")
            P, L, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
            sig = {"ggml_vsupported": [], "ggml_vsizes": [I, L, L, P, P], "ggml_vrepack": [I, P, L, L, L, L, L, P, P],
                   "ggml_vrows": [I, P, P, L, P, L, P], "ggml_vlinear": [P, I, P, P, L, L, L, P, I, L, I]}
            fns = {}
            for name, args in sig.items():
                f = getattr(lib, name)
                f.restype, f.argtypes = I, args
                fns[name] = f
            _v["fns"] = fns if fns["ggml_vsupported"]() else None
    return _v["fns"]


def repacked_path() -> bool:
    """Whether bf16 GGML weights run the repacked bf16-dot-product path here (AVX512-BF16)."""
    return REPACK and _vfns() is not None


class _Arena:
    """Weight memory on 2 MB pages where the kernel allows it (madvise MADV_HUGEPAGE): a decode step streams the
    whole model once, and on 4 KB pages every page boundary stalls the prefetchers and walks the page table.
    Tensors are carved out of 64 MB chunks (each chunk lives while a tensor in it does)."""

    CHUNK = 64 << 20

    def __init__(self):
        self.buf, self.used = None, 0

    def take(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = max(64, -(-nbytes // 64) * 64)
        if nbytes > self.CHUNK // 4:
            return self._chunk(nbytes)[:nbytes].view(dtype)
        if self.buf is None or self.used + nbytes > self.buf.numel():
            self.buf, self.used = self._chunk(self.CHUNK), 0
        out = self.buf[self.used:self.used + nbytes]
        self.used += nbytes
        return out.view(dtype)

    @staticmethod
    def _chunk(nbytes: int) -> torch.Tensor:
        import mmap
        import warnings

        size = -(-nbytes // (2 << 20)) * (2 << 20)
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                m.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel without transparent huge pages: 4 KB pages, slower but right
                pass
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch.frombuffer on a writable mmap: fine)
            return torch.frombuffer(m, dtype=torch.uint8)


_arena = _Arena()


class GGMLWeight:
    """One weight of one GGML type, either as shipped (`blocks`: rows x bytes) or repacked for bf16 dot products
    (`codes`, `scales`; see kernels/ggml_linear.c). `rows`/`k`: its shape."""

    def __init__(self, blocks: torch.Tensor | list[torch.Tensor], type_id: int, k: int, repack: bool, fn=None):
        self._fn = fn  # the blocks' kernel (None: the loaded one; the self-check passes the one it checks)
        segs = list(blocks) if isinstance(blocks, (list, tuple)) else [blocks]
        self.type_id, self.rows, self.k = type_id, sum(b.shape[0] for b in segs), k
        self.blocks = self.codes = self.scales = None
        if repack:
            f = _vfns()
            cb, sf = ctypes.c_int64(), ctypes.c_int64()
            if f["ggml_vsizes"](type_id, self.rows, k, ctypes.byref(cb), ctypes.byref(sf)) != 0:
                raise ValueError(f"GGML type {type_id}: {k} weights per row cannot be repacked")
            self.codes = _arena.take(cb.value, torch.uint8)  # fresh pages: zero
            self.scales = _arena.take(sf.value, torch.uint8)
            row0 = 0
            for b in segs:  # the parts of a fused projection straight from the file's pages: no copy
                b = b.contiguous()
                rc = f["ggml_vrepack"](type_id, b.data_ptr(), b.shape[1], b.shape[0], k, row0, self.rows,
                                       self.codes.data_ptr(), self.scales.data_ptr())
                if rc != 0:
                    raise ValueError(f"GGML type {type_id}: rows of {b.shape[1]} bytes do not hold {k} weights")
                row0 += b.shape[0]
            self._vlinear, self._codes, self._scales = f["ggml_vlinear"], self.codes.data_ptr(), self.scales.data_ptr()
        else:
            self.blocks = (segs[0] if len(segs) == 1 else torch.cat(segs)).contiguous()

    @property
    def nbytes(self) -> int:
        if self.blocks is not None:
            return self.blocks.numel()
        return self.codes.numel() + self.scales.numel()

    def storage_ptr(self) -> int:
        return (self.blocks if self.blocks is not None else self.codes).data_ptr()

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, t) for n, t in (("blocks", self.blocks), ("codes", self.codes), ("scales", self.scales))
                if t is not None]

    def dense(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 weights (rows `ids`, or all): d * code + m, bit for bit the gguf package's dequantisation."""
        if self.blocks is not None:
            return dequantize(self.blocks, self.type_id, self.k, ids)
        ids = (torch.arange(self.rows) if ids is None else ids).reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.numel(), self.k, dtype=torch.float32)
        _vfns()["ggml_vrows"](self.type_id, self.codes.data_ptr(), self.scales.data_ptr(), self.k, ids.data_ptr(),
                              ids.numel(), out.data_ptr())
        return out

    def matmul_into(self, x: torch.Tensor, y: torch.Tensor, col: int) -> None:
        """y[:, col:col + rows] = x @ W^T (x (M, K) contiguous, bf16 for the repacked form; y (M, N) contiguous)."""
        self.matmul_ptr(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel() // self.k, y, col)

    def matmul_ptr(self, xp: int, x_bf16: int, m: int, y: torch.Tensor, col: int) -> None:
        ybf, ldy = int(y.dtype == torch.bfloat16), y.shape[-1]
        yp = y.data_ptr() + col * y.element_size()
        if self.blocks is None:
            rc = self._vlinear(xp, self.type_id, self._codes, self._scales, m, self.rows, self.k, yp, ybf, ldy,
                               torch.get_num_threads())
        else:
            rc = (self._fn or _load())(xp, x_bf16, self.blocks.data_ptr(), self.type_id, self.blocks.shape[1], yp, ybf, ldy, m,
                         self.rows, self.k, torch.get_num_threads(), int(FORCE_AVX2))
        if rc == -2:
            raise MemoryError("ggml linear kernel: could not allocate its buffers")
        if rc != 0:
            raise ValueError(f"ggml linear kernel: GGML type {self.type_id} does not fit K={self.k} (code {rc})")


class GGMLLinear(nn.Module):
    """An `nn.Linear` stand-in over GGML weights: `parts` are (blocks uint8 (rows, bytes per row), GGML type id)
    stacked along the output dimension (a fused q/k/v may mix types: Gemma's v is Q8_0 where q and k are Q5_0), or
    `GGMLWeight`s. bf16 on an AVX512-BF16 host: repacked once for bf16 dot products; otherwise the blocks as
    shipped. `weight` dequantises on demand (for readers such as a fingerprint or a trainer; the forward never
    does)."""

    kernel = "ggml"
    # the LM head sets it (loading/weights.py): its outputs are logits, read in fp32, so they come straight from the
    # kernel's fp32 accumulators instead of being rounded to bf16 first (ties at bf16's 0.125 step near |20|)
    fp32_out = False

    def __init__(self, parts: list, in_features: int, dtype: torch.dtype, bias: torch.Tensor | None = None):
        super().__init__()
        if _load() is None:
            raise RuntimeError(f"the GGML kernel is unavailable: {unavailable_reason()}")
        repack = dtype == torch.bfloat16 and repacked_path()
        runs: list = []  # consecutive parts of one type make one weight (a fused q/k/v of one type: one call)
        for p in parts:
            if isinstance(p, GGMLWeight):
                runs.append(p)
            elif runs and isinstance(runs[-1], list) and runs[-1][1] == p[1]:
                runs[-1][0].append(p[0])
            else:
                runs.append([[p[0]], p[1]])
        self.ws = [r if isinstance(r, GGMLWeight) else GGMLWeight(r[0], r[1], in_features, repack) for r in runs]
        for i, w in enumerate(self.ws):  # buffers: counted by memory plans (a tied head shares the embedding's)
            for name, t in w.tensors():
                self.register_buffer(f"w{i}_{name}", t, persistent=False)
        self.types = [w.type_id for w in self.ws]
        self.repacked = all(w.blocks is None for w in self.ws)
        self.register_buffer("bias", bias, persistent=False)
        self.in_features = in_features
        self.out_features = sum(w.rows for w in self.ws)
        self.dtype = dtype

    @property
    def weight(self) -> torch.Tensor:
        return torch.cat([w.dense() for w in self.ws]).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in self.ws)

    def storage_ptr(self) -> int:
        return self.ws[0].storage_ptr()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.requires_grad and torch.is_grad_enabled():  # a drafter trained through the target's head or layers
            return _Through.apply(x, self)
        return self._run(x)

    def dense_for_grad(self) -> torch.Tensor:
        """The dequantised weight a backward pass multiplies by (made once, kept: a trainer runs many)."""
        w = getattr(self, "_grad_weight", None)
        if w is None:
            w = self._grad_weight = self.weight
        return w

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        want = torch.bfloat16 if self.repacked else (x.dtype if x.dtype in (torch.bfloat16, torch.float32)
                                                     else torch.float32)
        x2 = x if x.dtype == want and x.is_contiguous() else x.to(want).contiguous()
        out = torch.bfloat16 if x.dtype == torch.bfloat16 and not self.fp32_out else torch.float32
        y = torch.empty(*x.shape[:-1], self.out_features, dtype=out)
        xp, xb, m, col = x2.data_ptr(), int(want == torch.bfloat16), x2.numel() // self.in_features, 0
        for w in self.ws:
            w.matmul_ptr(xp, xb, m, y, col)
            col += w.rows
        if self.bias is not None:
            y = y + self.bias
        return y if out == x.dtype or self.fp32_out else y.to(x.dtype)

    def extra_repr(self) -> str:
        names = {v: k for k, v in KERNEL_TYPES.items()}
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"{'+'.join(names[t] for t in self.types)}{', repacked' if self.repacked else ''}")


def quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """GGML Q8_0 blocks (rows, K / 32 * 34 bytes) of a dense weight (rows, K), K a multiple of 32: per 32 weights
    one fp16 scale d = max |w| / 127 and the codes round(w / d) (llama.cpp's `quantize_row_q8_0`, ties to even
    here). A weight of n bytes in bf16 takes 17/32 of them."""
    n, k = weight.shape
    if k % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 weights, got {k}")
    b = weight.detach().float().reshape(n, k // 32, 32)
    d = (b.abs().amax(-1) / 127).half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(d, dtype=torch.float32))
    q = torch.round(b * inv[..., None]).clamp(-127, 127).to(torch.int8)
    out = torch.empty(n, k // 32, 34, dtype=torch.uint8)
    out[..., :2] = d.view(torch.uint8).reshape(n, k // 32, 2)
    out[..., 2:] = q.view(torch.uint8)
    return out.reshape(n, k // 32 * 34)


class GGMLEmbedding(nn.Module):
    """An `nn.Embedding` stand-in over GGML blocks (one type); rows dequantised as they are looked up."""

    def __init__(self, blocks: torch.Tensor, type_id: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.w = GGMLWeight(blocks, type_id, dim, dtype == torch.bfloat16 and repacked_path())
        for name, t in self.w.tensors():
            self.register_buffer(f"w_{name}", t, persistent=False)
        self.type_id, self.embedding_dim, self.num_embeddings, self.dtype = type_id, dim, blocks.shape[0], dtype

    @property
    def weight(self) -> torch.Tensor:
        return self.w.dense().to(self.dtype)

    def storage_ptr(self) -> int:
        return self.w.storage_ptr()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.dense(ids.cpu()).to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def head(self) -> GGMLLinear:
        """The tied LM head over the same weights (no copy)."""
        return GGMLLinear([self.w], self.embedding_dim, self.dtype)


def dense_state(module: nn.Module) -> dict:
    """`module.state_dict()` with the weights it holds as GGML blocks included, dequantised (a held module keeps
    its blocks in non-persistent buffers, so a state dict lacks them): what a trainer copies from the target."""
    out = dict(module.state_dict())
    for name, m in module.named_modules():
        if isinstance(m, (GGMLLinear, GGMLEmbedding)):
            prefix = f"{name}." if name else ""
            out[prefix + "weight"] = m.weight
            if getattr(m, "bias", None) is not None:
                out[prefix + "bias"] = m.bias
    return out


def held_modules(model: nn.Module) -> list[nn.Module]:
    """The model's modules that compute from GGML blocks."""
    return [m for m in model.modules() if isinstance(m, (GGMLLinear, GGMLEmbedding))]


class _Through(torch.autograd.Function):
    """The frozen GGML linear inside autograd: the forward is the kernel's, the input's gradient is
    grad_out @ W with W dequantised (the weights themselves get none: they are the target's, frozen)."""

    @staticmethod
    def forward(ctx, x, mod):
        ctx.mod, ctx.dtype = mod, x.dtype
        return mod._run(x)

    @staticmethod
    def backward(ctx, g):
        w = ctx.mod.dense_for_grad()
        return (g.to(w.dtype) @ w).to(ctx.dtype), None


def dense_linear(m: GGMLLinear) -> nn.Linear:
    """An `nn.Linear` with `m`'s weights dequantised into its compute dtype (what `--linear-kernel` names other
    than ggml run)."""
    with torch.device("meta"):
        lin = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None)
    lin.weight = nn.Parameter(m.weight, requires_grad=False)
    if m.bias is not None:
        lin.bias = nn.Parameter(m.bias.to(m.dtype), requires_grad=False)
    return lin


def dequantize_held(model: nn.Module) -> int:
    """Replace every module held as shipped by its dense counterpart (weights dequantised into the compute
    dtype; a tied head shares the embedding's weight again). Returns how many were replaced."""
    count, embed = 0, getattr(model, "embed_tokens", None)
    tied = isinstance(embed, GGMLEmbedding) and isinstance(getattr(model, "lm_head", None), GGMLLinear) and \
        model.lm_head.storage_ptr() == embed.storage_ptr()
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, GGMLLinear) and not (tied and child is model.lm_head):
                setattr(parent, name, dense_linear(child))
                count += 1
            elif isinstance(child, GGMLEmbedding):
                e = nn.Embedding(child.num_embeddings, child.embedding_dim, device="meta")
                e.weight = nn.Parameter(child.weight, requires_grad=False)
                setattr(parent, name, e)
                count += 1
    if tied:
        head = nn.Linear(model.embed_tokens.embedding_dim, model.embed_tokens.num_embeddings, bias=False,
                         device="meta")
        head.weight = model.embed_tokens.weight
        model.lm_head = head
        count += 1
    return count
