"""KV state: a preallocated key/value cache per sequence, written by slot, with rollback in the contract.

Slots `[0, length)` hold the committed sequence (slot i holds position i). A target forward pass appends its T
new entries at slots `[length, length + T)` — they are *pending* — and the caller then decides what to keep:

* `commit()` keeps all pending entries (prefill, plain decoding, an accepted chain);
* `commit(path)` keeps the pending entries at the given indices, in that order, gathered into contiguous slots
  starting at `length` (an accepted root-to-leaf path of a draft tree);
* `truncate(n)` keeps slots [0, n) and drops everything after (n may reach into the pending block).

Nothing is ever zeroed: rejected slots are simply overwritten by the next pass (as in gpt-fast).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import SpecloomError


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        batch: int = 1,
    ):
        shape = (num_layers, batch, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, B, H_kv, S_max, d)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.layers = [(self.k[i], self.v[i]) for i in range(num_layers)]  # per-layer views (B, H_kv, S_max, d)
        self.slot_pos = torch.zeros(batch, max_len, dtype=torch.long, device=device)  # RoPE position of each slot
        self.max_len = max_len
        self.length = 0  # committed slots
        self.pending = 0  # slots written by the last forward pass, not yet committed

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def reserve(self, n: int) -> int:
        """Start a pass that writes n entries; returns the first slot. Drops any uncommitted entries."""
        if self.length + n > self.max_len:
            raise SpecloomError(
                f"sequence too long: {self.length} cached + {n} new tokens exceeds the KV capacity of "
                f"{self.max_len} tokens"
            )
        self.pending = n
        return self.length

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v `(B, H_kv, T, d)` at slots [start, start+T); return views of slots [0, start+T)."""
        T = k.shape[2]
        kl, vl = self.layers[layer]
        kl.narrow(2, start, T).copy_(k)
        vl.narrow(2, start, T).copy_(v)
        return kl.narrow(2, 0, start + T), vl.narrow(2, 0, start + T)

    def commit(self, path: Sequence[int] | torch.Tensor | None = None) -> None:
        """Keep all pending entries (path None) or those at `path` (indices into the pending block)."""
        if path is None:
            self.length += self.pending
        else:
            idx = torch.as_tensor(path, dtype=torch.long, device=self.k.device)
            n = int(idx.numel())
            if n and (int(idx.min()) < 0 or int(idx.max()) >= self.pending):
                raise ValueError(f"commit path {idx.tolist()} outside the {self.pending} pending entries")
            if n and not torch.equal(idx, torch.arange(n, device=idx.device)):
                src = self.length + idx
                dst = slice(self.length, self.length + n)
                self.k[:, :, :, dst] = self.k[:, :, :, src]  # advanced indexing copies first: overlap is safe
                self.v[:, :, :, dst] = self.v[:, :, :, src]
                self.slot_pos[:, dst] = self.slot_pos[:, src]
            self.length += n
        self.pending = 0

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length + self.pending:
            raise ValueError(f"cannot truncate to {length}: cache holds {self.length} (+{self.pending} pending)")
        self.length = length  # a length inside the pending block keeps its first entries
        self.pending = 0

    def grown(self, max_len: int) -> "KVCache":
        """A larger cache holding the same committed entries (a drafter whose context outgrew its cache)."""
        L, B, H, _, d = self.k.shape
        new = KVCache(L, H, d, max_len, self.k.dtype, self.k.device, B)
        n = self.length
        new.k[:, :, :, :n] = self.k[:, :, :, :n]
        new.v[:, :, :, :n] = self.v[:, :, :, :n]
        new.slot_pos[:, :n] = self.slot_pos[:, :n]
        new.length = n
        return new

    def reset(self) -> None:
        self.length = 0
        self.pending = 0
