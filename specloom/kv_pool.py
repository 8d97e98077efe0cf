"""KV pool: the target's KV cache for several concurrent sequences, one row each, with ragged verification passes.

    pool = KVPool(model, rows=16, row_len=2304)
    r = pool.allocate()                                    # the next free row (active rows are 0..n-1)
    out = model(tokens (1, T), positions, pool.batch([r], [T]), attn_mask=causal)   # prefill row r
    pool.commit(r)                                         # or pool.commit(r, path)
    out = model(tokens (n, T), positions, pool.batch(range(n), sizes), attn_mask=masks (n, T, T))
    moved = pool.release(r)                                # frees r; the last active row moves into it
    pool.move(src, dst); pool.pop()                        # the same in two parts (the scheduler's own order)

Each row keeps its own committed length. A batch pass writes row b's T new entries at slots
`[length_b, length_b + T)` (pending) — T is the padded width; row b's first `sizes[b]` entries are real, the rest
padding that is never visible to a real query and is overwritten later. Query t of row b sees row b's committed
slots and the new entries its mask allows. Active rows are compacted to `[0, n)` so a pass over all of them reads
a view of the pool, never a gathered copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import SpecloomError
from .models.layers import AttentionContext


class KVPool:
    def __init__(self, model, rows: int, row_len: int, dtype: torch.dtype | None = None):
        c = model.config
        dev = model.device
        if dtype is None:
            dtype = torch.float32 if dev.type == "cpu" else model.dtype
        shape = (c.num_layers, rows, c.num_kv_heads, row_len, c.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=dev)  # zeros: masked slots must never hold NaN
        self.v = torch.zeros(shape, dtype=dtype, device=dev)
        self.slot_pos = torch.zeros(rows, row_len, dtype=torch.long, device=dev)
        self.rows, self.row_len = rows, row_len
        self.lengths = [0] * rows
        self.active = 0  # rows [0, active) are in use
        self._pass: _BatchPass | None = None

    @staticmethod
    def bytes_per_token(model, dtype: torch.dtype | None = None) -> int:
        c = model.config
        if dtype is None:
            dtype = torch.float32 if model.device.type == "cpu" else model.dtype
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    @property
    def free_rows(self) -> int:
        return self.rows - self.active

    def allocate(self) -> int:
        if self.active >= self.rows:
            raise SpecloomError("the KV pool is full")
        r = self.active
        self.active += 1
        self.lengths[r] = 0
        return r

    def move(self, src: int, dst: int) -> None:
        """Copy row `src`'s committed entries into row `dst` (both active; `src` keeps its copy until popped)."""
        if src == dst:
            return
        if not (0 <= src < self.active and 0 <= dst < self.active):
            raise ValueError(f"rows {src} -> {dst}: not active ({self.active} active)")
        n = self.lengths[src]
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.slot_pos[dst, :n] = self.slot_pos[src, :n]
        self.lengths[dst] = n

    def pop(self) -> None:
        """Free the last active row."""
        if self.active == 0:
            raise ValueError("no active row")
        self.active -= 1
        self.lengths[self.active] = 0

    def release(self, row: int) -> int | None:
        """Free `row`; the last active row moves into it. Returns the index of the row that moved (now `row`)."""
        last = self.active - 1
        if not 0 <= row <= last:
            raise ValueError(f"row {row} is not active")
        self.move(last, row)
        self.pop()
        return last if row != last else None

    def batch(self, rows: Sequence[int], sizes: Sequence[int]) -> "_BatchPass":
        """A pass over the contiguous rows `rows` (each writing `sizes[b]` real entries, padded to max(sizes))."""
        rows = list(rows)
        if not rows or rows != list(range(rows[0], rows[0] + len(rows))):
            raise ValueError(f"a batch pass needs contiguous pool rows, got {rows}")
        if rows[-1] >= self.active:
            raise ValueError(f"rows {rows} are not all active ({self.active} active)")
        T = max(sizes)
        for r in rows:
            if self.lengths[r] + T > self.row_len:
                raise SpecloomError(
                    f"sequence too long: {self.lengths[r]} cached + {T} new tokens exceeds the row capacity of "
                    f"{self.row_len} tokens"
                )
        self._pass = _BatchPass(self, rows, list(sizes), T)
        return self._pass

    def commit(self, row: int, path: Sequence[int] | None = None) -> None:
        """Keep the pending entries of `row` written by the last pass: all real ones, or those at `path`."""
        p = self._pass
        if p is None or row not in p.rows:
            raise ValueError(f"row {row} has no pending entries")
        b = row - p.rows[0]
        start = self.lengths[row]
        if path is None:
            n = p.sizes[b]
        else:
            idx = torch.as_tensor(list(path), dtype=torch.long, device=self.k.device)
            n = int(idx.numel())
            if n and (int(idx.min()) < 0 or int(idx.max()) >= p.sizes[b]):
                raise ValueError(f"commit path {idx.tolist()} outside the {p.sizes[b]} pending entries")
            if n and not torch.equal(idx, torch.arange(n, device=idx.device)):
                src = start + idx
                self.k[:, row, :, start:start + n] = self.k[:, row, :, src]
                self.v[:, row, :, start:start + n] = self.v[:, row, :, src]
                self.slot_pos[row, start:start + n] = self.slot_pos[row, src]
        self.lengths[row] = start + n


class _BatchPass:
    """One forward pass over some pool rows: the `kv` a DecoderLM writes through (see models/transformer.py)."""

    def __init__(self, pool: KVPool, rows: list[int], sizes: list[int], T: int):
        self.pool, self.rows, self.sizes, self.T = pool, rows, sizes, T
        dev = pool.k.device
        self.starts = torch.tensor([pool.lengths[r] for r in rows], device=dev)  # (n,)
        self.S = int(self.starts.max()) + T  # key slots any row of this pass reads
        self.b_idx = torch.tensor(rows, device=dev)[:, None].expand(len(rows), T)  # (n, T)
        self.s_idx = self.starts[:, None] + torch.arange(T, device=dev)  # (n, T)

    def attention_context(self, model, positions: torch.Tensor, attn_mask: torch.Tensor | None) -> AttentionContext:
        pool, n, T, S = self.pool, len(self.rows), self.T, self.S
        if positions.shape != (n, T):
            raise ValueError(f"positions {tuple(positions.shape)} for a pass of {n} rows x {T} tokens")
        dev = positions.device
        pool.slot_pos[self.b_idx, self.s_idx] = positions
        new = torch.ones(T, T, dtype=torch.bool, device=dev).tril() if attn_mask is None else attn_mask.to(dev)
        new = new.expand(n, T, T) if new.dim() == 2 else new
        keys = torch.arange(S, device=dev)
        full = (keys[None, None, :] < self.starts[:, None, None]).expand(n, T, S).clone()  # committed slots
        full.scatter_(2, self.s_idx[:, None, :].expand(n, T, T), new)  # the pass's own entries, per its mask
        masks = {"full": full.unsqueeze(1)}
        if "sliding" in model.layer_kinds:
            r0 = self.rows[0]
            kpos = pool.slot_pos[r0:r0 + n, :S]
            near = (positions.unsqueeze(-1) - kpos.unsqueeze(1)) < model.config.sliding_window
            masks["sliding"] = masks["full"] & near.unsqueeze(1)
        cos_sin = {kind: model.ropes[kind if kind in model.ropes else "full"](positions, model.dtype)
                   for kind in model.layer_kinds}
        return AttentionContext(self, 0, cos_sin, masks, {}, False)

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (n, H_kv, T, d) -> stored at each row's pending slots; returns the rows' keys/values (n, H, S, d)."""
        kl, vl = self.pool.k[layer], self.pool.v[layer]  # (R, H, S_max, d)
        kl[self.b_idx, :, self.s_idx] = k.transpose(1, 2).to(kl.dtype)
        vl[self.b_idx, :, self.s_idx] = v.transpose(1, 2).to(vl.dtype)
        r0, n = self.rows[0], len(self.rows)
        return kl[r0:r0 + n, :, :self.S], vl[r0:r0 + n, :, :self.S]
