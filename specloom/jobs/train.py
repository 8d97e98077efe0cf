"""`specloom train KIND`: one training loop; each drafter kind brings its trainer (drafters/<kind>/trainer.py).

Trainers register with `@trainer("kind")` and provide `model` (the same module class inference uses),
`loss(batch) -> (loss, metrics)` and `save(path, meta)`. The loop: frozen bf16 target (embedding and head only are
read), AdamW with warm-up + cosine decay, bf16 autocast on CPU, a seeded batch order, resumable checkpoints
(`train_state.pt` every `--save-every` steps: model, optimizer, step), a progress bar, a held-out evaluation of
per-step top-1 agreement with the target, and a loss-curve PNG. Under `torchrun --nproc-per-node N` the same loop
runs in N processes, each on its share of every batch (training/distributed.py); rank 0 prints and writes.

Labels are the target's own: soft distributions from its head applied to the stored final hidden state
(EAGLE-3, EAGLE-1, Medusa, draft model), and its final features (EAGLE-1's regression target).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import sys
import time

import torch

from ..atomic import remove_stale, replacing, write_json
from ..errors import SpecloomError
from ..training import distributed
from ..training.common import _plot_losses, to_device, train_device
from ..training.fit import epoch_batches, fit


# a resumed run must match these (a different recipe in the same --out would mix two runs; --steps and --epochs
# may grow: that extends the run)
RESUME_KEYS = ("kind", "lr", "tokens_per_batch", "ttt_steps", "draft_vocab", "loss_fraction",
               "seed", "warm_start_layer", "draft_vocab_coverage", "max_data_tokens", "medusa_heads", "block_size",
               "draft_layers")


def _cache_bytes(args) -> int:
    """Memory for recomputed hidden states: --cache-hidden-gb (per process), or half of what is available now,
    shared by the training processes on this machine (torchrun's LOCAL_WORLD_SIZE); by default a run that makes
    one pass over its data keeps only the held-out sequences' states (`_train`)."""
    gb = getattr(args, "cache_hidden_gb", None)
    if gb is not None:
        if gb < 0:
            raise SpecloomError(f"--cache-hidden-gb must be >= 0, got {gb}")
        return int(gb * 2 ** 30)
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if distributed.env_world_size() > 1 else 1)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2 // local
    except (ValueError, OSError, AttributeError):
        return 0


def load_trainers() -> dict:
    """Every trainer `specloom train` knows, name -> class: each drafter kind's trainer modules (named by its
    record) are imported and register themselves in it."""
    from ..drafters import KINDS

    for kind in KINDS.values():
        for module in kind.trainers:
            importlib.import_module(module)
    return {name: cls for kind in KINDS.values() for name, cls in kind.trained.items()}



def _init_from(tr, path: str) -> None:
    """Start from an existing checkpoint of the trainer's kind (`--init-from`): every tensor it shares."""
    from ..drafters.checkpoint import init_from_checkpoint

    init_from_checkpoint(tr.model, path, tr.kind, tr.target, tr.tokenizer)


@torch.no_grad()
def evaluate(tr, data, index, args, max_batches: int = 8) -> dict:
    sums, n = {}, 0
    dev = tr.target.device
    for b, batch in enumerate(data.batches(index, args.tokens_per_batch, seed=0)):
        if b >= max_batches:
            break
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=args.bf16):
            loss, metrics = tr.loss(to_device(batch, dev))
        for k, v in {"loss": float(loss), **metrics}.items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
    return {k: v / max(n, 1) for k, v in sums.items()}


def run_training(args) -> dict:
    trainers = load_trainers()
    if args.kind not in trainers:
        raise SpecloomError(f"unknown drafter kind {args.kind!r} (choose from {', '.join(sorted(trainers))})")
    if getattr(trainers[args.kind], "standalone", False):  # `train target`: its own loop, nothing frozen
        if distributed.env_world_size() > 1:
            raise SpecloomError(f"specloom train {args.kind} runs in one process (its own loop: a new target, or "
                                "--init-from fine-tuning); multi-process training (torchrun) covers the drafter kinds")
        return trainers[args.kind].run(args)
    with distributed.session(train_device(args)) as dev:
        # the other processes of a torchrun run load, check and train alike: their notes and progress bars would
        # repeat rank 0's (an error still reaches the command line, which prints it after this block)
        with contextlib.nullcontext() if distributed.is_main() else contextlib.redirect_stderr(io.StringIO()):
            return _train(args, dev, trainers[args.kind])


def _train(args, dev: torch.device, trainer_cls) -> dict:
    from ..loading import load_target
    from ..drafters.checkpoint import specloom_meta
    from ..training.dataset import DistillData

    main = distributed.is_main()
    torch.manual_seed(args.seed)
    from ..host import mkldnn_bf16

    # the frozen target in bf16, except on a CPU without bf16 matmul kernels (AVX2 only), where a bf16 pass
    # over n tokens costs about n fp32 passes (BENCHMARKS, issue 12): there fp32 (hidden states are kept in bf16)
    tdtype = "fp32" if dev.type == "cpu" and not mkldnn_bf16() else "bf16"
    target, tokenizer = load_target(args.target, tdtype, pack=False, device=dev)
    L = target.config.num_layers
    ids = tuple(sorted({*trainer_cls.data_ids(L), L}))
    data = DistillData(args.data, ids, max_tokens=args.max_data_tokens)
    if not data.meta.get("capture") and dev.type == "cpu":
        # hidden states are recomputed per batch: by a second copy of the target in the host's packed inference
        # layout (1.6x faster here than the unpacked copy the trainers read weights from; +1 model in memory)
        data.attach(load_target(args.target, tdtype, progress=False, device=dev)[0], _cache_bytes(args))
    else:
        data.attach(target, _cache_bytes(args))
    fp = data.meta.get("fingerprint", {})
    from ..fingerprint import compare, fingerprint

    diff = compare(fp, fingerprint(target, tokenizer))
    if diff:
        raise SpecloomError(f"{' '.join(args.data)} was generated with another target ({'; '.join(diff)} differ)")
    from ..behaviour import check_behaviour

    check_behaviour(data.meta.get("target_probe"), target, " ".join(args.data), tokenizer, subject="this data")
    train_idx, eval_idx = data.split(args.eval_fraction)
    print(f"specloom train {args.kind}: {data.num_tokens} tokens in {len(data.seqs)} sequences "
          f"({len(eval_idx)} held out)" + (f"; {distributed.world()} processes, each on its share of every batch"
                                            if distributed.world() > 1 else ""), file=sys.stderr, flush=True)
    for key, value in trainer_cls.arg_defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    tr = trainer_cls(target, tokenizer, data, args)
    tr.model.to(dev)  # built on the CPU (the draft model trainer's: already on the target's device)
    if args.init_from:  # a kind's trainer may start from a checkpoint its own way (`init_from`)
        getattr(tr, "init_from", lambda path: _init_from(tr, path))(args.init_from)
    params = tr.parameters()
    print(f"specloom train {args.kind}: {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters",
          file=sys.stderr, flush=True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if main:
        os.makedirs(args.out, exist_ok=True)
        remove_stale(args.out)  # a killed run's half-written checkpoint, if any
    state_path = os.path.join(args.out, "train_state.pt")
    train_groups = data.groups(train_idx, args.tokens_per_batch, 0)  # every epoch: the same batches, reordered
    distributed.check_split(train_groups, [len(t) for t, _, _ in data.seqs], args.tokens_per_batch)
    batches_per_epoch = len(train_groups)
    total = args.steps or batches_per_epoch * args.epochs
    if getattr(args, "cache_hidden_gb", None) is None and (total <= batches_per_epoch
                                                           or getattr(args, "max_minutes", None)):
        # one pass over the data, or a run its --max-minutes budget ends (its --steps a mere ceiling: such runs
        # stopped well inside their first pass here): no training sequence comes back, so the default cache keeps
        # only the held-out ones the periodic evaluations re-read (it had filled half the memory with states never
        # read again: trainings side by side on one machine were OOM-killed, twice)
        data.cache_only = set(eval_idx)
    step, history, evals, seen = 0, [], [], 0
    before = 0.0  # seconds a resumed run had already spent of its --max-minutes budget
    settings = {k: getattr(args, k, None) for k in RESUME_KEYS}
    rank, world = distributed.rank(), distributed.world()
    if rank:  # row / anchor sampling: each process its own stream (rank 0's is the one-process run's)
        tr.gen.manual_seed(args.seed + 1_000_003 * rank)
    if os.path.isfile(state_path):  # every process reads the same checkpoint (rank 0 writes only after step 1)
        st = torch.load(state_path, map_location="cpu", weights_only=False)
        old = st.get("settings")
        if old is not None and old != settings:
            diff = ", ".join(f"{k}: {old.get(k)} there, {settings[k]} now" for k in settings if old.get(k) != settings[k])
            raise SpecloomError(f"{args.out} holds a training run with other settings ({diff}); use a new --out "
                                "or the same settings to resume")
        tr.model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, history = st["step"], st["history"]
        evals, seen = st.get("evals", []), st.get("seen", 0)
        before = float(st.get("spent_s", 0.0))  # rerunning the same command continues its time budget
        gens = st.get("gens") or [st["gen"]]
        if len(gens) == world:
            tr.gen.set_state(gens[rank])
        elif rank == 0:
            tr.gen.set_state(st["gen"])
        else:  # resumed with another number of processes: a fresh stream per process, still seeded
            tr.gen.manual_seed(args.seed + 1_000_003 * rank + step)
        print(f"specloom train: resuming at step {step}/{total}", file=sys.stderr, flush=True)
    distributed.broadcast_module(tr.model)  # equal replicas (they are from the seed; this makes sure)
    if hasattr(tr, "used"):  # a resumed / initialised EAGLE-3 keeps its own draft vocabulary
        tr.used = torch.arange(tr.model.d2t.numel()) + tr.model.d2t
    from tqdm import tqdm

    bar = tqdm(total=total, initial=step, desc=f"train {args.kind}", file=sys.stderr, mininterval=2.0,
               disable=not main)
    t0 = time.perf_counter()
    limit = getattr(args, "max_minutes", None)
    # --max-minutes: every process stops at the same step (rank 0's clock decides)
    # --max-minutes is the run's budget across resumes (a killed run rerun with the same command goes on where it
    # stopped, its time-annealed learning rate too)
    used = lambda: before + time.perf_counter() - t0  # noqa: E731
    timed_out = lambda: bool(limit) and distributed.any_rank(main and used() > 60 * limit)  # noqa: E731
    stopped = []  # --max-minutes: the batches end before the next one

    def stop() -> bool:
        if timed_out():
            stopped.append(step)
            return True
        return False

    batches = epoch_batches(lambda epoch: data.groups(train_idx, args.tokens_per_batch, seed=args.seed + epoch),
                            lambda group: to_device(data.collate(distributed.shard(group), 1024), dev),
                            batches_per_epoch, step, stop)
    # sync_grads: the global batch's gradient on every process
    spent = None
    if getattr(args, "anneal_by_time", False):
        if not limit:
            raise SpecloomError("--anneal-by-time decays the learning rate over --max-minutes: give --max-minutes")
        if world > 1:  # each process would read its own clock, and the replicas' learning rates would part
            raise SpecloomError("--anneal-by-time runs in one process (not under torchrun)")
        spent = lambda: used() / (60 * limit)  # noqa: E731
    for step, batch, loss, metrics in fit(opt, params, batches, tr.loss, total=total, lr=args.lr, warmup=args.warmup,
                                          device=dev, bf16=args.bf16, clip=0.5, step=step,
                                          sync=distributed.sync_grads, spent=spent):
        # the processes' partial losses and metrics add up to the global batch's
        loss_v, n_seen, *values = distributed.sum_values(
            [float(loss), int(batch["loss_mask"].sum()), *metrics.values()])
        seen += int(n_seen)
        metrics = dict(zip(metrics, values))
        history.append({"step": step, "loss": loss_v, "answer_tokens_seen": seen, "lr": opt.param_groups[0]["lr"],
                        **metrics})
        if args.eval_every and step % args.eval_every == 0 and step < total:
            if main:  # rank 0 evaluates the whole held-out set; the others go on to the next batch and wait
                tr.model.eval()
                with distributed.solo():
                    ev = evaluate(tr, data, eval_idx, args, max_batches=4)
                tr.model.train()
                evals.append({"step": step, "answer_tokens_seen": seen, **ev})
                print(f"\nspecloom train {args.kind}: step {step}, {seen / 1e6:.2f}M answer tokens seen, "
                      "held-out " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()), file=sys.stderr, flush=True)
        bar.update(1)
        bar.set_postfix(loss=f"{loss_v:.3f}", **{k: f"{v:.2f}" for k, v in metrics.items()})
        if step % args.save_every == 0 or step == total:
            gens = distributed.gather_objects(tr.gen.get_state())
            if main:
                with replacing(state_path) as tmp:
                    torch.save({"model": tr.model.state_dict(), "opt": opt.state_dict(), "step": step,
                                "history": history, "gen": tr.gen.get_state(), "evals": evals, "seen": seen,
                                "settings": settings, "spent_s": used(),
                                **({"gens": gens} if world > 1 else {})}, tmp)
    if stopped:
        print(f"\nspecloom train {args.kind}: --max-minutes reached at step {step}/{total}", file=sys.stderr)
    bar.close()
    wall = time.perf_counter() - t0
    result = None
    if main:  # the final evaluation and every file: rank 0 alone
        with distributed.solo():
            result = _finish(tr, data, eval_idx, args, target, tokenizer, history, evals, step, seen, wall,
                             specloom_meta)
    result = distributed.broadcast_object(result)  # and the others wait for it
    return result


def _finish(tr, data, eval_idx, args, target, tokenizer, history, evals, step, seen, wall, specloom_meta) -> dict:
    tr.model.eval()
    ev = evaluate(tr, data, eval_idx, args)
    evals.append({"step": step, "answer_tokens_seen": seen, **ev})
    print(f"specloom train {args.kind}: held-out " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()),
          file=sys.stderr, flush=True)
    meta = specloom_meta(args.kind, target, tokenizer, tr.feature_ids, manifest={
        "command": " ".join(["specloom", "train"] + sys.argv[2:]) if sys.argv[1:2] == ["train"] else args.command,
        "data": args.data, "data_tokens": data.num_tokens,
        "data_meta": [{k: m.get(k) for k in ("target", "num_prompts", "max_new_tokens", "prompt_files")}
                      for m in data.metas],
        "steps": step, "seed": args.seed, "lr": args.lr, "ttt_steps": getattr(args, "ttt_steps", None),
        "train_seconds_this_run": round(wall, 1), "held_out": ev, "answer_tokens_seen": seen,
        "learning_curve": evals, **({"processes": distributed.world()} if distributed.world() > 1 else {}),
    })
    meta.update(tr.extra_meta(data, eval_idx))
    if getattr(args, "init_from", None):
        from ..drafters.checkpoint import carried_settings

        carried = carried_settings(args.init_from, args.kind)
        if carried:
            meta.update(carried)
            print(f"specloom train {args.kind}: decoding settings carried from {args.init_from} "
                  f"({', '.join(k for k in carried if k != 'settings_from')})", file=sys.stderr, flush=True)
    tr.save(args.out, meta)
    _plot_losses(history, os.path.join(args.out, "loss.png"), args.kind)
    write_json(os.path.join(args.out, "history.json"), history)
    write_json(os.path.join(args.out, "evals.json"), evals, indent=1)
    return {"held_out": ev, "steps": step}
