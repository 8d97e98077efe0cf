"""Reading `specloom data` shards as padded training batches.

Shards hold token ids and loss masks; hidden states are either stored with them (the first data format) or
recomputed by the frozen target when a batch is collated (`attach(target)`: one bf16 forward over the batch,
capturing the ids the trainer reads). Stored states collate far faster; recomputing keeps a 5M-token dataset at
~25 MB instead of ~23 GB (BENCHMARKS.md, "Self-distillation data")."""

from __future__ import annotations

import json
import os
import random

import torch

from ..errors import SpecloomError


class DistillData:
    """All shards of a data directory, held in memory (bf16 hidden states)."""

    def __init__(self, paths: "str | list[str]", ids: tuple[int, ...], max_tokens: int | None = None,
                 max_tokens_per_dir: int | None = None):
        from .shards import read_shard, shard_files

        paths = [paths] if isinstance(paths, str) else list(paths)
        self.seqs: list[tuple[torch.Tensor, torch.Tensor, dict]] = []  # tokens, loss_mask, {id: hidden}
        self.metas = []
        total = 0
        for path in paths:
            meta_path = os.path.join(path, "meta.json")
            if not os.path.isfile(meta_path):
                raise SpecloomError(f"{path}: not a specloom data directory (no meta.json; make one with "
                                    "`specloom data`)")
            with open(meta_path) as f:
                meta = json.load(f)
            missing = [i for i in ids if i not in meta["capture"]]
            tokens_only = not meta["capture"]  # recomputed by the target at collate time
            if missing and not tokens_only:
                raise SpecloomError(f"{path}: hidden states {missing} were not stored (have {meta['capture']}); "
                                    "regenerate with --layers")
            if self.metas and meta.get("fingerprint") != self.metas[0].get("fingerprint"):
                raise SpecloomError(f"{path} was made with another target than {paths[0]}")
            self.metas.append(meta)
            files = shard_files(path)
            if not files:
                raise SpecloomError(f"{path}: no shards yet")
            here = 0
            for fn in files:
                want = ("tokens", "offsets", "loss_mask") + (() if tokens_only else tuple(f"hidden.{i}" for i in ids))
                d, _ = read_shard(fn, want)  # only the tensors asked for (shards may hold more layers)
                off = d["offsets"].tolist()
                for a, b in zip(off[:-1], off[1:]):
                    if not d["loss_mask"][a:b].any():
                        continue
                    self.seqs.append((d["tokens"][a:b].long(), d["loss_mask"][a:b].bool(),
                                      None if tokens_only else {i: d[f"hidden.{i}"][a:b] for i in ids}))
                    total += b - a
                    here += b - a
                if (max_tokens and total >= max_tokens) or (max_tokens_per_dir and here >= max_tokens_per_dir):
                    break
            if max_tokens and total >= max_tokens:
                break
        self.meta = self.metas[0]
        self.num_tokens = total
        self.num_answer_tokens = sum(int(m.sum()) for _, m, _ in self.seqs)
        self.ids = ids
        self.target = None
        self.cache_budget = 0  # bytes of recomputed hidden states kept for later epochs (`keep_recomputed`)
        self.cache_only: set[int] | None = None  # if set, only these sequences' states are kept
        self.cached_bytes = 0

    def attach(self, target, cache_bytes: int = 0) -> None:
        """The frozen target that recomputes hidden states for shards that do not store them. `cache_bytes`: keep
        up to this many bytes of recomputed states in memory, so later epochs (and repeated held-out evaluations)
        read them instead of running the target again."""
        self.target = target
        self.cache_budget = int(cache_bytes)

    @torch.inference_mode()
    def recompute(self, tokens: torch.Tensor) -> dict:
        """{id: (B, T, H) bf16} from one target pass over right-padded `tokens` (padding never reaches a valid
        position: attention is causal)."""
        t = self.target
        if t is None:
            raise SpecloomError("this data stores no hidden states: attach the target to recompute them")
        B, T = tokens.shape
        dev = t.device
        kv = t.new_kv(T, batch=B, dtype=t.dtype)
        pos = torch.arange(T, device=dev)[None].expand(B, T)
        out = t(tokens.to(dev), pos, kv, capture=self.ids, num_logits=1)
        return {c: out.hidden[c].to(torch.bfloat16) for c in self.ids}

    def split(self, eval_fraction: float) -> tuple[list[int], list[int]]:
        """(train, held out) indices. A sequence's side is decided by a hash of its tokens alone, not by its
        position nor by a run's --seed, so a directory that grows between runs, a resumed run on more data, or a
        continued run that reshuffles with another seed never moves a sequence it trained on into the held-out
        set: the split is fixed once per dataset."""
        seed = 0  # the split every run so far used (the old default --seed): kept, so held-out figures compare
        import hashlib

        def u(i):
            h = hashlib.blake2b(self.seqs[i][0].numpy().tobytes() + str(seed).encode(), digest_size=8).digest()
            return int.from_bytes(h, "little") / 2.0 ** 64

        held = [i for i in range(len(self.seqs)) if u(i) < eval_fraction]
        if not held:
            held = [min(range(len(self.seqs)), key=u)]
        hs = set(held)
        return [i for i in range(len(self.seqs)) if i not in hs], held

    def batches(self, index: list[int], tokens_per_batch: int, seed: int, max_len: int = 1024):
        """Padded batches of similar-length sequences, in a seeded random order. Yields dicts with tokens (B, T),
        valid (B, T), loss_mask (B, T) and hidden {id: (B, T, H)}."""
        for g in self.groups(index, tokens_per_batch, seed, max_len):
            yield self.collate(g, max_len)

    def groups(self, index: list[int], tokens_per_batch: int, seed: int, max_len: int = 1024) -> list[list[int]]:
        order = sorted(index, key=lambda i: len(self.seqs[i][0]))
        groups, cur = [], []
        for i in order:
            n = min(len(self.seqs[i][0]), max_len)
            if cur and (len(cur) + 1) * n > tokens_per_batch:
                groups.append(cur)
                cur = []
            cur.append(i)
        if cur:
            groups.append(cur)
        random.Random(seed).shuffle(groups)
        return groups

    def collate(self, group: list[int], max_len: int) -> dict:
        T = min(max(len(self.seqs[i][0]) for i in group), max_len)
        B = len(group)
        tokens = torch.zeros(B, T, dtype=torch.long)
        valid = torch.zeros(B, T, dtype=torch.bool)
        mask = torch.zeros(B, T, dtype=torch.bool)
        for r, i in enumerate(group):
            t, m, _ = self.seqs[i]
            n = min(len(t), T)
            tokens[r, :n] = t[:n]
            valid[r, :n] = True
            mask[r, :n] = m[:n]
        if not self.ids:
            return {"tokens": tokens, "valid": valid, "loss_mask": mask, "hidden": {}}
        missing = [r for r, i in enumerate(group) if self.seqs[i][2] is None]
        if missing:  # tokens-only rows: one target pass over them (and keep their states while the budget lasts)
            fresh = self.recompute(tokens[missing])
            for k, r in enumerate(missing):
                i = group[r]
                n = min(len(self.seqs[i][0]), T)
                size = n * sum(fresh[c].shape[-1] for c in self.ids) * 2
                if (n == len(self.seqs[i][0]) and self.cached_bytes + size <= self.cache_budget
                        and (self.cache_only is None or i in self.cache_only)):
                    t, m, _ = self.seqs[i]
                    self.seqs[i] = (t, m, {c: fresh[c][k, :n].to("cpu", copy=True) for c in self.ids})
                    self.cached_bytes += size
        else:
            fresh = None
        width = {c: (fresh[c] if fresh is not None else self.seqs[group[0]][2][c]).shape[-1] for c in self.ids}
        hidden = {c: torch.zeros(B, T, width[c], dtype=torch.bfloat16) for c in self.ids}
        pos = {r: k for k, r in enumerate(missing)}
        for r, i in enumerate(group):
            n = min(len(self.seqs[i][0]), T)
            for c in self.ids:
                hidden[c][r, :n] = fresh[c][pos[r], :n] if r in pos else self.seqs[i][2][c][:n]
        return {"tokens": tokens, "valid": valid, "loss_mask": mask, "hidden": hidden}
