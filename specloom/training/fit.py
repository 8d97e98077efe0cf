"""The one training loop every trainer runs (`specloom train <kind>`, `train target`, its fine-tuning):

    batches = epoch_batches(groups_of_epoch, collate, start=step)       # epochs of batch groups, resumable
    for step, batch, loss, metrics in fit(opt, params, batches, loss_of, total=..., lr=..., warmup=..., ...):
        ...                                                             # history, evaluation, checkpoints

Per batch: the learning rate of the schedule (`_lr_at`: linear warm-up, cosine decay), the loss under bf16
autocast, the optimizer step (clipped, gradients synchronised under torchrun). The caller stops early by leaving
the loop (a time limit); `epoch_batches` stops yielding when `stop()` says so, before collating the next batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .common import _lr_at, optimizer_step


def epoch_batches(groups_of_epoch: Callable[[int], list], collate: Callable, per_epoch: int, start: int = 0,
                  stop: Callable[[], bool] | None = None) -> Iterator:
    """Batches epoch after epoch (`groups_of_epoch(epoch)`: that epoch's order), from step `start` on (a resumed
    run skips the batches of its epoch it has done); collated lazily; ends when `stop()` is true before a batch."""
    epoch = start // max(per_epoch, 1)
    skip = start - epoch * per_epoch
    while True:
        groups = groups_of_epoch(epoch)[max(skip, 0):]
        if not groups and skip <= 0:
            return  # no data at all
        for group in groups:
            if stop is not None and stop():
                return
            yield collate(group)
        skip = 0
        epoch += 1


def fit(opt, params: list, batches: Iterator, loss_of: Callable, *, total: int, lr: float, warmup: int,
        device: torch.device, bf16: bool, clip: float, step: int = 0, sync=None,
        spent: Callable[[], float] | None = None) -> Iterator:
    """Optimizer steps from `step` to `total` over `batches`; yields (step, batch, loss, metrics) after each.
    `spent()`: the share of a time budget used so far -- the schedule then decays by time where that is further
    along than the steps (a run cut by a time limit ends at the floor learning rate)."""
    while step < total:
        batch = next(batches, None)
        if batch is None:
            return
        frac = min(spent(), 1.0) if spent is not None else 0.0
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, total, lr, warmup, frac)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, metrics = loss_of(batch)
        optimizer_step(opt, params, loss, clip, sync=sync)
        step += 1
        yield step, batch, loss, metrics
