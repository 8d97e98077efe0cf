"""The one KV store: preallocated rows of key/value slots, one row per sequence, written by slot.

    kv = KVCache(layers, kv_heads, head_dim, max_len, dtype, device, batch=rows, active=0)   # a pool of rows
    r = kv.allocate()                                  # the next free row (active rows are always 0..n-1)
    p = kv.begin([r], [T])                             # a pass over rows writing T entries each (pending)
    model(tokens, positions, p, ...)                   # the model writes through p (models/context.py)
    kv.commit(row=r) | kv.commit(path, row=r)          # keep all pending entries of a row, or those at `path`
    kv.truncate(n, row=r)                              # keep slots [0, n) of a row
    kv.move(src, dst); kv.pop()                        # the last active row moves into a hole; free the last row

Row r's slots `[0, lengths[r])` hold its committed sequence (slot i holds position i of that sequence, its RoPE
position in `slot_pos`). A pass over rows r0..r0+n-1 writes row b's T new entries at `[lengths_b, lengths_b + T)`;
they are *pending* until committed: all of them, or an accepted root-to-leaf path gathered into contiguous slots.
In a ragged pass (`sizes`) row b's first sizes[b] entries are real, the rest padding that is never committed.
Nothing is ever zeroed: rejected slots are overwritten by the next pass (as in gpt-fast).

A plain cache is the same object with every row active (`active=None`); `commit()`/`truncate(n)` without a row
apply to every row of the last pass. Drafters keep their own keys/values in *companion* stores of the target's
store (`companion(key, make)`): same rows, moved and freed together, so row r of every store is one sequence.

The store's type (kv_quant.py, `--kv-cache-dtype`) is a plain dtype (fp32, bf16, fp16: keys/values stored as they
are) or a quantized one (fp8_e4m3, fp8_e5m2, int8: codes plus one fp32 scale per token and head, `k_scale` /
`v_scale` (L, R, H, S), quantized as a pass writes them and dequantised to fp32 where attention reads them:
`write` returns the rows' keys/values as values, `read` gives them to a drafter that reads a store directly).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .errors import SpecloomError
from .kv_quant import SCALE_DTYPE, KVType, kv_type

TREE_SLACK = 256  # KV slots beyond a sequence for the nodes of one draft tree (every store keeps them)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: "torch.dtype | KVType | str") -> int:
    """Bytes of keys and values for one token of one row at KV type `dtype` (a quantized type's scales included)."""
    return 2 * num_layers * num_kv_heads * kv_type(dtype).bytes_per_vector(head_dim)


def default_kv_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV dtype when none is asked for: fp32 on CPU (attention over a few queries runs ~3x faster in fp32
    than in bf16 there, and keys/values keep full precision), the model's dtype elsewhere."""
    return torch.float32 if torch.device(device).type == "cpu" else dtype


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: "torch.dtype | KVType | str" = torch.float32,
        device: torch.device | str = "cpu",
        batch: int = 1,
        active: int | None = None,
    ):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.kv_type = t = kv_type(dtype)
        self.k = torch.zeros(shape, dtype=t.storage, device=device)  # zeros: masked slots must never hold NaN
        self.v = torch.zeros(shape, dtype=t.storage, device=device)
        self.k_scale = self.v_scale = None  # quantized types: one scale per (layer, row, head, slot)
        if t.quantized:
            self.k_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
            self.v_scale = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device)
        self.slot_pos = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # RoPE position of each slot
        self.rows, self.max_len = batch, max_len
        self.lengths = [0] * batch  # committed slots per row
        self.active = batch if active is None else active  # rows [0, active) are in use
        self._pass: KVPass | None = None
        self._companions: dict = {}

    # -- facts -----------------------------------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        """The stored number type (a quantized type: its codes', e.g. torch.int8 / torch.float8_e4m3fn)."""
        return self.kv_type.dtype

    @property
    def read_dtype(self) -> torch.dtype:
        """The dtype attention reads keys/values in: the stored one, fp32 for a quantized type."""
        return torch.float32 if self.kv_type.quantized else self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def nbytes(self) -> int:
        n = self.k.numel() * self.k.element_size() * 2
        if self.k_scale is not None:
            n += self.k_scale.numel() * self.k_scale.element_size() * 2
        return n

    @property
    def free_rows(self) -> int:
        return self.rows - self.active

    @property
    def length(self) -> int:
        """Committed slots of a single-row store (or of every row, when they agree)."""
        if self.rows == 1 or len(set(self.lengths[:max(self.active, 1)])) == 1:
            return self.lengths[0]
        raise ValueError(f"rows hold different lengths {self.lengths[:self.active]}: ask for one row")

    @property
    def pending(self) -> int:
        return 0 if self._pass is None else self._pass.T

    # -- rows ------------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        if self.active >= self.rows:
            raise SpecloomError("the KV pool is full")
        r = self.active
        for s in self._stores():
            s.active = r + 1
            s.lengths[r] = 0
        return r

    @torch.inference_mode()  # companion stores are made inside inference mode (by drafters)
    def move(self, src: int, dst: int) -> None:
        """Copy row `src`'s committed entries into row `dst` (both active; `src` keeps its copy until popped)."""
        if src == dst:
            return
        if not (0 <= src < self.active and 0 <= dst < self.active):
            raise ValueError(f"rows {src} -> {dst}: not active ({self.active} active)")
        for s in self._stores():
            n = s.lengths[src]
            s.k[:, dst, :, :n] = s.k[:, src, :, :n]
            s.v[:, dst, :, :n] = s.v[:, src, :, :n]
            s.slot_pos[dst, :n] = s.slot_pos[src, :n]
            if s.k_scale is not None:
                s.k_scale[:, dst, :, :n] = s.k_scale[:, src, :, :n]
                s.v_scale[:, dst, :, :n] = s.v_scale[:, src, :, :n]
            s.lengths[dst] = n

    def pop(self) -> None:
        """Free the last active row."""
        if self.active == 0:
            raise ValueError("no active row")
        for s in self._stores():
            s.active -= 1
            s.lengths[s.active] = 0

    def release(self, row: int) -> int | None:
        """Free `row`; the last active row moves into it. Returns the index of the row that moved (now `row`)."""
        last = self.active - 1
        if not 0 <= row <= last:
            raise ValueError(f"row {row} is not active")
        self.move(last, row)
        self.pop()
        return last if row != last else None

    def reset(self) -> None:
        for s in self._stores():
            s.lengths = [0] * s.rows
            s._pass = None

    def companion(self, key, make: Callable[[int, int], "KVCache"]) -> "KVCache":
        """The companion store registered under `key`, made on first use by `make(rows, max_len)`: a drafter's
        own keys/values, one row per row of this store, moved and freed with it."""
        store = self._companions.get(key)
        if store is None:
            store = make(self.rows, self.max_len)
            if store.rows != self.rows:
                raise ValueError(f"a companion store needs {self.rows} rows, got {store.rows}")
            store.active = self.active
            store.lengths = [0] * store.rows
            self._companions[key] = store
        return store

    def _stores(self):
        yield self
        for s in self._companions.values():
            yield from s._stores()

    # -- passes ----------------------------------------------------------------------------------------------
    def begin(self, rows: Sequence[int] | None = None, sizes: Sequence[int] | int | None = None) -> "KVPass":
        """Start a pass over the contiguous rows `rows` (None: every active row), row b writing sizes[b] real
        entries, padded to max(sizes). Drops any uncommitted entries of an earlier pass."""
        rows = list(range(self.active)) if rows is None else list(rows)
        if not rows or rows != list(range(rows[0], rows[0] + len(rows))):
            raise ValueError(f"a pass needs contiguous rows, got {rows}")
        if rows[0] < 0 or rows[-1] >= self.active:
            raise ValueError(f"rows {rows} are not all active ({self.active} active)")
        sizes = [sizes] * len(rows) if isinstance(sizes, int) else list(sizes)
        if len(sizes) != len(rows):
            raise ValueError(f"{len(sizes)} sizes for {len(rows)} rows")
        T = max(sizes)
        for r in rows:
            if self.lengths[r] + T > self.max_len:
                raise SpecloomError(
                    f"sequence too long: {self.lengths[r]} cached + {T} new tokens exceeds the KV capacity of "
                    f"{self.max_len} tokens")
        self._pass = KVPass(self, rows, sizes, T)
        return self._pass

    def open(self, T: int) -> "KVPass":
        """The pass a model call over this store writes through: every active row, T entries each."""
        return self.begin(None, T)

    def reserve(self, n: int) -> int:
        """Start a pass of n entries over every row; returns the first slot (rows of equal length)."""
        return self.begin(None, n).start

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v `(B, H_kv, T, d)` into the current pass; return the rows' keys/values up to its end."""
        if self._pass is None or self._pass.start != start:
            raise ValueError(f"no pass starting at slot {start}")
        return self._pass.write(layer, k, v)

    def read(self, layer: int, r0: int, n: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [r0, r0 + n)'s keys/values of slots [0, S) at `layer`, (n, H, S, d) in `read_dtype` (a plain
        type: views of the store; a quantized one: dequantised copies)."""
        k, v = self.k[layer, r0:r0 + n, :, :S], self.v[layer, r0:r0 + n, :, :S]
        if self.k_scale is None:
            return k, v
        t = self.kv_type
        return (t.dequantize(k, self.k_scale[layer, r0:r0 + n, :, :S]),
                t.dequantize(v, self.v_scale[layer, r0:r0 + n, :, :S]))

    def commit(self, path: Sequence[int] | torch.Tensor | None = None, *, row: int | None = None) -> None:
        """Keep the pending entries of `row` (None: every row of the pass): all real ones, or those at `path`
        (indices into the row's pending block, in order)."""
        p = self._pass
        if p is None:
            if path is None or len(path) == 0:
                return
            raise ValueError("no pending entries to commit")
        rows = p.rows if row is None else [row]
        for r in rows:
            if r not in p.rows:
                raise ValueError(f"row {r} has no pending entries")
            b = r - p.rows[0]
            start = self.lengths[r]
            if r in p.done:
                raise ValueError(f"row {r} was committed already")
            if path is None:
                n = p.sizes[b]
            else:
                idx = torch.as_tensor(list(path) if not torch.is_tensor(path) else path, dtype=torch.long,
                                      device=self.k.device)
                n = int(idx.numel())
                if n and (int(idx.min()) < 0 or int(idx.max()) >= p.sizes[b]):
                    raise ValueError(f"commit path {idx.tolist()} outside the {p.sizes[b]} pending entries")
                if n and not torch.equal(idx, torch.arange(n, device=idx.device)):
                    src = start + idx  # advanced indexing copies first: overlap is safe
                    self.k[:, r, :, start:start + n] = self.k[:, r, :, src]
                    self.v[:, r, :, start:start + n] = self.v[:, r, :, src]
                    self.slot_pos[r, start:start + n] = self.slot_pos[r, src]
                    if self.k_scale is not None:
                        self.k_scale[:, r, :, start:start + n] = self.k_scale[:, r, :, src]
                        self.v_scale[:, r, :, start:start + n] = self.v_scale[:, r, :, src]
            self.lengths[r] = start + n
            p.done.add(r)
        if len(p.done) == len(p.rows):
            self._pass = None

    def truncate(self, length: int, *, row: int | None = None) -> None:
        """Keep slots [0, length) of `row` (None: every active row); a length inside a pending block keeps its
        first entries."""
        rows = range(self.active) if row is None else [row]
        p = self._pass
        for r in rows:
            pend = p.T if p is not None and r in p.rows and r not in p.done else 0
            if not 0 <= length <= self.lengths[r] + pend:
                raise ValueError(f"cannot truncate row {r} to {length}: it holds {self.lengths[r]} (+{pend} pending)")
            self.lengths[r] = length
            if p is not None and r in p.rows:
                p.done.add(r)
        if p is not None and (row is None or len(p.done) == len(p.rows)):
            self._pass = None


class KVPass:
    """One forward pass over some rows of a store: what a model writes its new keys/values through."""

    def __init__(self, kv: KVCache, rows: list[int], sizes: list[int], T: int):
        self.kv, self.rows, self.sizes, self.T = kv, rows, sizes, T
        self.starts = [kv.lengths[r] for r in rows]
        self.uniform = len(set(self.starts)) == 1  # every row starts at the same slot: plain slices, no gather
        self.start = self.starts[0] if self.uniform else None
        self.S = max(self.starts) + T  # key slots any row of this pass reads
        self._idx = None
        self._flat = None
        self.done: set[int] = set()  # rows committed since

    def open(self, T: int) -> "KVPass":
        if T != self.T:
            raise ValueError(f"a pass of {self.T} entries per row was given {T} tokens")
        return self

    @property
    def n(self) -> int:
        return len(self.rows)

    def index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, slot index), each (n, T): where the pass's entries go."""
        if self._idx is None:
            dev = self.kv.device
            starts = torch.tensor(self.starts, device=dev)
            b = torch.tensor(self.rows, device=dev)[:, None].expand(self.n, self.T)
            self._idx = (b, starts[:, None] + torch.arange(self.T, device=dev))
        return self._idx

    def set_positions(self, positions: torch.Tensor) -> None:
        r0, n = self.rows[0], self.n
        if self.uniform:
            self.kv.slot_pos[r0:r0 + n, self.start:self.start + self.T] = positions
        else:
            b, s = self.index()
            self.kv.slot_pos[b, s] = positions

    def slot_positions(self) -> torch.Tensor:
        r0 = self.rows[0]
        return self.kv.slot_pos[r0:r0 + self.n, :self.S]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (n, H_kv, T, d) -> stored at each row's pending slots; returns the rows' keys/values (n, H, S, d)."""
        if self.kv.k_scale is not None:
            return self._write_quantized(layer, k, v)
        kl, vl = self.kv.k[layer], self.kv.v[layer]  # (R, H, S_max, d)
        r0, n = self.rows[0], self.n
        if self.uniform:
            kl[r0:r0 + n].narrow(2, self.start, self.T).copy_(k)
            vl[r0:r0 + n].narrow(2, self.start, self.T).copy_(v)
            if self.start == 0 and (k.requires_grad or v.requires_grad):
                # a training pass over whole sequences: the keys/values are exactly these (a view of the store
                # would be saved for backward and invalidated by the next layer's write into the same store)
                return k.to(kl.dtype), v.to(vl.dtype)
        else:  # one index_copy_ per tensor into the flattened store (an advanced-index put was ~10x slower)
            idx = self.flat_index(kl.shape)
            d = kl.shape[-1]
            kl.view(-1, d).index_copy_(0, idx, k.reshape(-1, d).to(kl.dtype))
            vl.view(-1, d).index_copy_(0, idx, v.reshape(-1, d).to(vl.dtype))
        return kl[r0:r0 + n, :, :self.S], vl[r0:r0 + n, :, :self.S]

    def _write_quantized(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`write` for a quantized store: codes and per-(token, head) scales in, dequantised keys/values out."""
        kv = self.kv
        r0, n = self.rows[0], self.n
        for x, codes, scales in ((k, kv.k[layer], kv.k_scale[layer]), (v, kv.v[layer], kv.v_scale[layer])):
            c, s = kv.kv_type.quantize(x)  # (n, H, T, d), (n, H, T)
            if self.uniform:
                codes[r0:r0 + n].narrow(2, self.start, self.T).copy_(c)
                scales[r0:r0 + n].narrow(2, self.start, self.T).copy_(s)
            else:
                idx = self.flat_index(codes.shape)  # indexes (R * H * S_max) rows: the scales' layout too
                d = codes.shape[-1]
                codes.view(-1, d).index_copy_(0, idx, c.reshape(-1, d))
                scales.view(-1).index_copy_(0, idx, s.reshape(-1))
        return kv.read(layer, r0, n, self.S)

    def flat_index(self, shape) -> torch.Tensor:
        """(n * H * T,) indices into a layer's store viewed as (R * H * S_max, d), in k's (n, H, T) order."""
        if self._flat is None:
            _, H, S_max, _ = shape
            b, s = self.index()  # (n, T)
            h = torch.arange(H, device=b.device)[None, :, None]
            self._flat = ((b[:, None, :] * H + h) * S_max + s[:, None, :]).reshape(-1)
        return self._flat
