"""The one KV store: preallocated rows of key/value slots, one row per sequence, written by slot.

    kv = KVCache(layers, kv_heads, head_dim, max_len, dtype, device, batch=rows, active=0)   # a pool of rows
    r = kv.allocate()                                  # the lowest free row
    p = kv.begin(rows, sizes)                          # a pass over any rows, row b writing sizes[b] entries
    model(p.spread(tokens), p.spread(positions), p, ...)   # the model runs over the pass's span (below)
    y = p.pick(output)                                 # the pass's rows back out of the span
    kv.commit(row=r) | kv.commit(path, row=r)          # keep all pending entries of a row, or those at `path`
    kv.truncate(n, row=r)                              # keep slots [0, n) of a row
    kv.free(r)                                         # the row is free again (no other row moves)

Rows are addressed by index: a sequence keeps its row from `allocate` to `free`, whatever else comes and goes.
Row r's slots `[0, lengths[r])` hold its committed sequence (slot i holds position i of that sequence, its RoPE
position in `slot_pos`). A pass writes row r's T new entries at `[lengths[r], lengths[r] + T)`; they are *pending*
until committed: all of them, or an accepted root-to-leaf path gathered into contiguous slots. A pass over rows
that are not neighbours runs over their *span* (`RowSpan`: the lowest to the highest of them): the rows between
take part as padding (zero real entries, never committed), so every layer reads the store's rows as a view, never
a copy. In a ragged pass (`sizes`) row b's first sizes[b] entries are real, the rest padding that is never
committed. Nothing is ever zeroed: rejected slots are overwritten by the next pass (as in gpt-fast).

A plain cache is the same object with every row active (`active=None`); `commit()`/`truncate(n)` without a row
apply to every row of the last pass. Drafters keep their own keys/values in *companion* stores of the target's
store (`companion(key, make)`): same rows, allocated and freed together, so row r of every store is one sequence.

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


def _leading(path: Sequence[int], size: int) -> bool:
    """Whether `path` (host ints) is 0, 1, ..., n - 1 within `size` pending entries: a commit that moves nothing."""
    return len(path) <= size and all(i == j for i, j in enumerate(path))


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
        n = batch if active is None else active
        self.used = [r < n for r in range(batch)]  # rows held by a sequence (None: all; an int: the first ones)
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
    def active(self) -> int:
        """How many rows are held by a sequence."""
        return sum(self.used)

    @property
    def free_rows(self) -> int:
        return self.rows - self.active

    def used_rows(self) -> list[int]:
        return [r for r in range(self.rows) if self.used[r]]

    @property
    def length(self) -> int:
        """Committed slots of a single-row store (or of every row, when they agree)."""
        lengths = [self.lengths[r] for r in self.used_rows()] or self.lengths[:1]
        if self.rows == 1 or len(set(lengths)) == 1:
            return lengths[0]
        raise ValueError(f"rows hold different lengths {lengths}: ask for one row")

    @property
    def pending(self) -> int:
        return 0 if self._pass is None else self._pass.T

    # -- rows ------------------------------------------------------------------------------------------------
    def allocate(self) -> int:
        """Hold the lowest free row (in this store and its companions); returns it."""
        free = [r for r in range(self.rows) if not self.used[r]]
        if not free:
            raise SpecloomError("the KV pool is full")
        r = free[0]
        for s in self._stores():
            s.used[r] = True
            s.lengths[r] = 0
        return r

    def free(self, row: int) -> None:
        """Free `row` (in this store and its companions); no other row moves."""
        if not 0 <= row < self.rows or not self.used[row]:
            raise ValueError(f"row {row} is not in use")
        for s in self._stores():
            s.used[row] = False
            s.lengths[row] = 0
            if s._pass is not None and row in s._pass.members:
                s._pass = None

    def reset(self) -> None:
        for s in self._stores():
            s.lengths = [0] * s.rows
            s._pass = None

    def companion(self, key, make: Callable[[int, int], "KVCache"]) -> "KVCache":
        """The companion store registered under `key`, made on first use by `make(rows, max_len)`: a drafter's
        own keys/values, one row per row of this store, allocated and freed with it."""
        store = self._companions.get(key)
        if store is None:
            store = make(self.rows, self.max_len)
            if store.rows != self.rows:
                raise ValueError(f"a companion store needs {self.rows} rows, got {store.rows}")
            store.used = list(self.used)
            store.lengths = [0] * store.rows
            self._companions[key] = store
        return store

    def _stores(self):
        yield self
        for s in self._companions.values():
            yield from s._stores()

    # -- passes ----------------------------------------------------------------------------------------------
    def begin(self, rows: Sequence[int] | None = None, sizes: Sequence[int] | int | None = None) -> "KVPass":
        """Start a pass over `rows` (any rows in use, in the order the caller's tensors hold them; None: every
        row in use), row b writing sizes[b] real entries, padded to max(sizes). The model runs over the pass's
        span (`KVPass.spread` / `pick`). Drops any uncommitted entries of an earlier pass."""
        rows = self.used_rows() if rows is None else list(rows)
        if not rows or len(set(rows)) != len(rows):
            raise ValueError(f"a pass needs distinct rows, got {rows}")
        if any(not 0 <= r < self.rows or not self.used[r] for r in rows):
            raise ValueError(f"rows {rows} are not all in use (in use: {self.used_rows()})")
        sizes = [sizes] * len(rows) if isinstance(sizes, int) else list(sizes)
        if len(sizes) != len(rows):
            raise ValueError(f"{len(sizes)} sizes for {len(rows)} rows")
        span = RowSpan(rows)
        T = max(sizes)
        for r in range(span.lo, span.lo + span.n):  # padding rows write (never commit) their T slots too
            if self.lengths[r] + T > self.max_len:
                raise SpecloomError(
                    f"sequence too long: {self.lengths[r]} cached + {T} new tokens exceeds the KV capacity of "
                    f"{self.max_len} tokens")
        self._pass = KVPass(self, span, span.spread_list(sizes), T)
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
        rows = p.members if row is None else [row]
        for r in rows:
            if r not in p.members:
                raise ValueError(f"row {r} has no pending entries")
            b = r - p.rows[0]
            start = self.lengths[r]
            if r in p.done:
                raise ValueError(f"row {r} was committed already")
            if path is None:
                n = p.sizes[b]
            elif not torch.is_tensor(path) and _leading(path, p.sizes[b]):
                n = len(path)  # entries 0..n-1 (a plain step's root, a chain's accepted prefix): already in place
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
        if len(p.done) == len(p.members):
            self._pass = None

    def truncate(self, length: int, *, row: int | None = None) -> None:
        """Keep slots [0, length) of `row` (None: every row in use); a length inside a pending block keeps its
        first entries."""
        rows = self.used_rows() if row is None else [row]
        p = self._pass
        for r in rows:
            pend = p.T if p is not None and r in p.members and r not in p.done else 0
            if not 0 <= length <= self.lengths[r] + pend:
                raise ValueError(f"cannot truncate row {r} to {length}: it holds {self.lengths[r]} (+{pend} pending)")
            self.lengths[r] = length
            if p is not None and r in p.members:
                p.done.add(r)
        if p is not None and (row is None or len(p.done) == len(p.members)):
            self._pass = None


class RowSpan:
    """Some rows of a store as the contiguous span from the lowest to the highest of them: a call's tensors hold
    its rows in its own order (row b: rows[b]); the span's hold rows lo..lo+n-1, the rows between padding."""

    def __init__(self, rows: Sequence[int]):
        self.rows = list(rows)
        self.lo = min(self.rows)
        self.n = max(self.rows) - self.lo + 1
        self.dense = self.rows == list(range(self.lo, self.lo + self.n))  # no padding, same order: no copies
        self._idx = None

    def index(self, device) -> torch.Tensor:
        """(len(rows),): where row b of the call sits in the span."""
        if self._idx is None or self._idx.device != torch.device(device):
            self._idx = torch.tensor([r - self.lo for r in self.rows], device=device)
        return self._idx

    def at(self, b: int) -> int:
        """The span position of the call's row b."""
        return self.rows[b] - self.lo

    def spread_list(self, values: list, fill=0) -> list:
        out = [fill] * self.n
        for r, v in zip(self.rows, values):
            out[r - self.lo] = v
        return out

    def spread(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """(len(rows), ...) -> (n, ...): padding rows hold `fill`."""
        if self.dense:
            return x
        out = x.new_full((self.n, *x.shape[1:]), fill)
        out[self.index(x.device)] = x
        return out

    def pick(self, y: torch.Tensor) -> torch.Tensor:
        """(n, ...) -> (len(rows), ...)."""
        return y if self.dense else y[self.index(y.device)]


class KVPass:
    """One forward pass over some rows of a store: what a model writes its new keys/values through. It covers
    the span of its rows (`members`), row lo..lo+n-1 in `rows`; `sizes` per span row (padding rows: 0)."""

    def __init__(self, kv: KVCache, span: RowSpan, sizes: list[int], T: int):
        self.kv, self.span, self.sizes, self.T = kv, span, sizes, T
        self.rows = list(range(span.lo, span.lo + span.n))
        self.members = span.rows
        self.starts = [kv.lengths[r] for r in self.rows]
        self.uniform = len(set(self.starts)) == 1  # every row starts at the same slot: plain slices, no gather
        self.start = self.starts[0] if self.uniform else None
        self.S = max(self.starts) + T  # key slots any row of this pass reads
        self._idx = None
        self._flat = None
        self.done: set[int] = set()  # rows committed since

    def spread(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        return self.span.spread(x, fill)

    def pick(self, y: torch.Tensor) -> torch.Tensor:
        return self.span.pick(y)

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
