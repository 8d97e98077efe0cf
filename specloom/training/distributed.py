"""Multi-process training: `torchrun --nproc-per-node N -m specloom train KIND ...`.

Started by torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in the environment, WORLD_SIZE > 1), every
process joins one torch.distributed group (gloo on the CPU; NCCL on CUDA, process i on cuda:LOCAL_RANK), loads the
frozen target and a replica of the trainable drafter, and trains on its own disjoint share of each global batch:
sequences rank, rank + N, rank + 2N, ... of the batch a one-process run takes (`shard`). So the global batch, the
number of steps and the learning-rate schedule are those of one process, whatever N.

One mechanism keeps the replicas equal: after `backward` the gradients are summed over the processes (one
all-reduce of one flat buffer, `sync_grads`), then every replica clips and steps identically. For the sum to be the
one-process gradient, a trainer's loss divides its sums over rows by the row count of the *global* batch
(`total_rows` + `shard_mean`; in one process `shard_mean` is plain `mean`, bit for bit). The per-process losses and
metrics are such partial means, so their sums over processes (`sum_values`) are the one-process figures.
(Not DistributedDataParallel: it synchronises through its wrapper's forward, and the trainers call their modules'
own methods -- ttt_forward, train_blocks, one head at a time -- and some parameters get no gradient in a step.)

Rank 0 alone evaluates (`solo`: the helpers act as in one process there), prints, and writes checkpoints,
manifests and plots; every process reads the same `train_state.pt` to resume.
"""

from __future__ import annotations

import datetime
import os
from contextlib import contextmanager

import torch

from ..errors import SpecloomError

_rank, _world, _dev = 0, 1, torch.device("cpu")  # this process, the group size, the device collectives run on
_solo = False


def env_world_size() -> int:
    """WORLD_SIZE from the environment (1 when unset): > 1 under `torchrun --nproc-per-node N`, N > 1."""
    raw = os.environ.get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise SpecloomError(f"WORLD_SIZE={raw!r} is not an integer") from None


def rank() -> int:
    return _rank


def world() -> int:
    return _world


def is_main() -> bool:
    """Whether this process prints and writes files (rank 0, or the only process)."""
    return _rank == 0


def active() -> bool:
    """Whether the helpers below talk to the other processes (several of them, and not inside `solo`)."""
    return _world > 1 and not _solo


@contextmanager
def session(dev: torch.device):
    """Join the process group torchrun describes (a no-op for one process) and yield the device this process trains
    on: `dev`, or cuda:LOCAL_RANK for a CUDA run. Leaves the group at the end, also on an error."""
    global _rank, _world, _dev
    world_size = env_world_size()
    if world_size <= 1:
        yield dev
        return
    import torch.distributed as dist

    missing = [k for k in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise SpecloomError(f"WORLD_SIZE={world_size} but {', '.join(missing)} unset: start multi-process training "
                            "with `torchrun --nproc-per-node N -m specloom train ...`")
    r, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    if dev.type == "cuda":
        if dev.index is not None:
            raise SpecloomError(f"--device {dev}: under torchrun each process trains on cuda:LOCAL_RANK; pass "
                                "--device cuda (or leave --device out)")
        count = torch.cuda.device_count()
        if local >= count:
            raise SpecloomError(f"LOCAL_RANK {local}: this machine has {count} CUDA device(s); start at most "
                                f"{count} processes per node")
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_available() or (backend == "gloo" and not dist.is_gloo_available()):
        raise SpecloomError(f"this PyTorch build has no torch.distributed {backend} backend")
    # rank 0 evaluates and writes the checkpoint while the others wait in their next collective: a long timeout
    dist.init_process_group(backend, rank=r, world_size=world_size, timeout=datetime.timedelta(minutes=60))
    _rank, _world, _dev = r, world_size, dev
    try:
        yield dev
    finally:
        _rank, _world, _dev = 0, 1, torch.device("cpu")
        dist.destroy_process_group()


@contextmanager
def solo():
    """Inside: the helpers act as in a one-process run (rank 0's evaluation and final writing)."""
    global _solo
    old, _solo = _solo, True
    try:
        yield
    finally:
        _solo = old


def shard(group: list) -> list:
    """This process's disjoint share of a global batch (a list of sequence indices sorted by length: the shares
    get similar lengths)."""
    return group if not active() else group[_rank::_world]


def check_split(groups: list[list[int]], lengths: list[int], tokens_per_batch: int) -> None:
    """A clear error when some global batch has fewer sequences than there are processes (each needs one)."""
    if not active() or not groups:
        return
    small = min(groups, key=len)
    if len(small) >= _world:
        return
    longest = min(max(lengths[i] for i in small), 1024)
    raise SpecloomError(
        f"--tokens-per-batch {tokens_per_batch} makes batches of as few as {len(small)} sequence(s) (of up to "
        f"{longest} tokens), which {_world} processes cannot split (each takes its own share of every batch): use "
        f"--tokens-per-batch {_world * longest} or more, or fewer processes")


def _reduce(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    import torch.distributed as dist

    t = t.to(_dev)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return t.cpu()


def total_rows(n: int) -> int:
    """The number of loss rows of the global batch, given this process's `n` (a collective: every process calls it
    for the same loss terms in the same order, also with n == 0)."""
    if not active():
        return int(n)
    return int(_reduce(torch.tensor([int(n)], dtype=torch.int64))[0])


def shard_mean(x: torch.Tensor, n_total: int) -> torch.Tensor:
    """This process's part of the mean of x's rows over the global batch (`n_total` rows from `total_rows`):
    x.mean() in one process; summed over the processes, the global mean."""
    if not active():
        return x.mean()
    return x.sum() / n_total


def sum_values(values: list[float]) -> list[float]:
    """Each value summed over the processes (one all-reduce), e.g. a step's partial losses and metrics."""
    if not active():
        return list(values)
    return _reduce(torch.tensor(values, dtype=torch.float64)).tolist()


def any_rank(flag: bool) -> bool:
    """True on every process when it is true on any (so that all stop at the same step)."""
    if not active():
        return bool(flag)
    return bool(_reduce(torch.tensor([int(bool(flag))], dtype=torch.int64), "max")[0])


def sync_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum the gradients over the processes, in place (one all-reduce of one flat buffer). A parameter no process
    gave a gradient keeps none (the optimizer leaves it alone, as in one process); one that only some did gets
    zeros from the others."""
    if not active() or not params:
        return
    flat = torch.cat([torch.zeros(p.numel(), device=_dev, dtype=torch.float32) if p.grad is None
                      else p.grad.detach().reshape(-1).to(_dev, torch.float32) for p in params]
                     + [torch.tensor([float(p.grad is not None) for p in params], device=_dev)])
    import torch.distributed as dist

    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    had = flat[-len(params):].tolist()
    off = 0
    for p, h in zip(params, had):
        n = p.numel()
        if h:
            g = flat[off:off + n].view_as(p).to(p.device, p.dtype if p.grad is None else p.grad.dtype)
            if p.grad is None:
                p.grad = g
            else:
                p.grad.copy_(g)
        off += n


def broadcast_module(module: torch.nn.Module) -> None:
    """Rank 0's parameters and buffers on every process (they start equal from the seed; this makes sure)."""
    if not active():
        return
    import torch.distributed as dist

    for t in list(module.parameters()) + list(module.buffers()):
        buf = t.data.to(_dev)
        dist.broadcast(buf, 0)
        if buf is not t.data:
            t.data.copy_(buf)


def gather_objects(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every process ([obj] in one)."""
    if not active():
        return [obj]
    import torch.distributed as dist

    out = [None] * _world
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj):
    """Rank 0's obj on every process."""
    if not active():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, 0)
    return box[0]


def barrier() -> None:
    if active():
        import torch.distributed as dist

        dist.barrier()
