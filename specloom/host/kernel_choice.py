"""Which linear kernel runs the target's passes on this host: chosen by what whole passes cost, cached per host.

Every exact candidate (models/cpu_packing.py: `onednn` where oneDNN runs bf16, `invariant` where it builds,
`native`) is installed in turn in the model itself and timed as the engine uses it: a decode step (1 token) and
verification passes of `WIDTHS` tokens after a 128-token context, attention and norms included, interleaved round
by round (drift hits all alike), the fastest of the repeats kept. A one-row micro-probe of the linears alone once
chose a kernel that ran the README's default at 0.53x of what the host gave with another (issue 35): the cost of a
step is what is measured now.

The choice (`choose_kernels`): the kernel with the highest expected tokens/s -- for plain decoding 1 / t(1); with a
drafter (`Drafting`: tau tokens per verification of `width` tokens) the better of plain decoding and
tau / t(width), since the depth policy falls back to plain decoding where drafting does not pay. Batch-invariant
kernels come first: each is checked on this host (every linear shape of the model, a row alone against the same
row in a 9- and a 16-row pass, bit for bit) and one within `INVARIANT_SLACK` of the fastest kernel is chosen, so
that greedy speculative output is plain output bit for bit (with the invariant attention, models/
invariant_attention.py). When no invariant kernel comes that close the fastest runs and the choice says that
bf16 outputs can then part at near-ties (`KernelChoice.invariant` False).

A noisy host: when the repeats of a pass spread by more than `NOISY` (another process competing), more rounds
run within a budget; a measurement still noisy -- or taken while other processes used more than a fifth of the
CPUs (host/contention.py: every repeat slowed alike agrees with itself) -- is used but cached as such and measured
again next time. A cached
probe is checked against a live decode step: a step now clearly faster than cached means the cache was taken
under load, and the probe runs again. `fp32` (for a bf16 model) and `int8` change the target's numerics: never
chosen by default; `--linear-kernel fp32|int8` opts in for every pass.

The figures are cached in ~/.cache/specloom/host/ per host key (host/), dtype and model shape.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..errors import SpecloomError
from . import host_key
from .contention import Contention
from ..models import cpu_packing
from ..models.native import kernels_version

MULTI = 9  # the verification width of a typical drafter: an EAGLE-2 tree of 8 nodes + root, a chain of 8
WIDTHS = (1, 4, 9, 16)  # tokens per timed pass: a decode step and verification passes
INVARIANT_SLACK = 1.03  # a batch-invariant kernel may be this much slower than the fastest and still be chosen
NOISY = 0.15  # a pass whose median repeat is this much above its fastest: the host was busy
PROBE_BUDGET_S = 20.0  # the most a probe may spend repeating rounds on a noisy host
BUSY_LOOK_S = 0.55  # how long a load looks at the host before timing a provisional choice again (/proc/stat)
LIVE_CHECK = 0.80  # a live decode step faster than this share of the cached one: the cache was taken under load
PROBE_VERSION = 4  # cached probes of another version are measured again (2: the one-row micro-probe; 3: the
# invariance check that sampled three rows and skipped linears held as GGUF blocks; 4: verification passes timed
# with the logits of every row, as the engine runs them -- 3 computed the last row's only, 1 of 5 head rows)


@dataclass
class Drafting:
    """What the configured drafter is expected to do: `tau` tokens per verification pass of `width` tokens."""

    tau: float = 1.8
    width: int = MULTI


@dataclass
class KernelChoice:
    single: str  # kernel for single-row passes (plain decoding)
    multi: str  # kernel for multi-row passes (verification, prefill, batches)
    reason: str
    dtype: str = ""
    probe: dict | None = None  # {"widths": [1, 4, 9, 16], "ms": {kernel: {width: ms}}, "invariant": {...}, ...}
    notes: list[str] = field(default_factory=list)  # candidates not chosen, and why
    invariant: bool | None = None  # batch-invariant on this host (None: not checked, e.g. forced or fp32)

    @property
    def tag(self) -> str:
        """For cache names: `onednn`, or `native+fp32` for a row split."""
        return self.single if self.single == self.multi else f"{self.single}+{self.multi}"

    @property
    def changes_numerics(self) -> bool:
        dt = getattr(torch, self.dtype, None) if self.dtype else None
        return any(cpu_packing.changes_numerics(k, dt) for k in {self.single, self.multi})

    def describe(self) -> str:
        head = f"linear kernel {self.tag} ({self.reason})"
        if not self.probe:
            return head
        ms = self.probe["ms"]
        widths = [str(w) for w in self.probe.get("widths", [])]
        cells = ", ".join(f"{k} {'/'.join(f'{ms[k][w]:.1f}' for w in widths)}" for k in ms)
        return f"{head}; whole-pass ms for {'/'.join(widths)} tokens: {cells}"

    def to_dict(self) -> dict:
        return asdict(self) | {"tag": self.tag, "changes_numerics": self.changes_numerics}


def _groups(model: nn.Module) -> list[tuple[nn.Linear, int]]:
    """One `nn.Linear` per distinct (out, in, bias) shape, with how many the model has."""
    groups: dict[tuple, list] = {}
    for m in model.modules():
        if type(m) is nn.Linear:
            key = (m.out_features, m.in_features, m.bias is not None)
            groups.setdefault(key, [m, 0])[1] += 1
    return [(m, n) for m, n in groups.values()]


def _held(model: nn.Module) -> list[nn.Module]:
    """The linears that compute from GGUF blocks as shipped (`ggml`), one per distinct shape and type."""
    seen: dict[tuple, nn.Module] = {}
    for m in model.modules():
        if getattr(m, "kernel", None) == "ggml":
            seen.setdefault((m.out_features, m.in_features, tuple(m.types)), m)
    return list(seen.values())


def _signature(model: nn.Module, dtype: torch.dtype) -> str:
    shapes = sorted((k[0], k[1], k[2], n) for k, n in
                    (((m.out_features, m.in_features, m.bias is not None), n) for m, n in _groups(model)))
    held = sorted([m.out_features, m.in_features, list(m.types)] for m in _held(model))
    attn = bool(model.uses_invariant_attention()) if hasattr(model, "uses_invariant_attention") else False
    return hashlib.sha1(json.dumps([str(dtype), shapes, attn] + ([held] if held else []) +
                                   [kernels_version()]).encode()).hexdigest()[:12]


def candidates(dtype: torch.dtype, device: torch.device | str) -> list[str]:
    """Every kernel that can run weights of `dtype` on `device`, exact ones first."""
    return [k for k in cpu_packing.KERNELS if cpu_packing.kernel_available(k, dtype, device)]


def exact_candidates(dtype: torch.dtype, device: torch.device | str) -> list[str]:
    return [k for k in candidates(dtype, device) if not cpu_packing.changes_numerics(k, dtype)]


@torch.inference_mode()
def batch_invariant(model: nn.Module, kernel: str, rows=(2, 5, 9, 16), draws: int = 2) -> bool:
    """Whether `kernel` gives every row of a pass the bits it gives that row alone, on each linear shape of
    `model`: every row of passes over `rows` rows, for `draws` random activations (normal, then heavy-tailed, as
    activations after an MLP's gate are). Every row is compared, not a sample: a kernel whose blocking depends on
    the row count parts in the last bit of only a few outputs in ten thousand (oneDNN's bf16 matmul on an AMD EPYC
    without AMX: 1-3 of 16 x 576 SmolLM2 down_proj outputs, which rows 0, n/2 and n-1 alone did not catch)."""
    from ..models.ggml_linear import dense_linear

    g = torch.Generator().manual_seed(1)
    # a linear held as GGUF blocks runs as itself under ggml and on a dense copy of its weights under any other
    # kernel (as _Installed installs them)
    held = [(m, m if kernel == "ggml" else None) for m in _held(model)]
    n = max(rows)
    for lin, mod in held + [(lin, None) for lin, _ in _groups(model)]:
        if mod is None and getattr(lin, "kernel", None) == "ggml":
            lin = dense_linear(lin)
        mod = mod or cpu_packing.build_kernel(kernel, lin)
        dtype = getattr(lin, "dtype", None) or lin.weight.dtype
        for d in range(draws):
            x = torch.randn(n, lin.in_features, generator=g)
            if d:
                x = x * torch.randn(n, lin.in_features, generator=g).exp()
            x = x.to(dtype)
            alone = torch.cat([mod(x[i:i + 1]) for i in range(n)])
            if not all(torch.equal(mod(x[:r]), alone[:r]) for r in rows):
                return False
    return True


class _Installed:
    """The model's plain linears (and those held as GGUF blocks), and installing one kernel's modules in their
    place (or the originals back). A held linear runs as itself under `ggml` and on a dense copy of its weights
    (dequantised once, when a kernel first needs it) under any other kernel."""

    def __init__(self, model: nn.Module):
        self.slots = [(parent, name, child) for parent in model.modules()
                      for name, child in parent.named_children()
                      if type(child) is nn.Linear or getattr(child, "kernel", None) == "ggml"]
        self.built: dict[str, list] = {}
        self.dense: dict[int, nn.Linear] = {}

    def _module(self, kernel: str, i: int, lin: nn.Module) -> nn.Module:
        if getattr(lin, "kernel", None) == "ggml":
            if kernel == "ggml":
                return lin
            if i not in self.dense:
                from ..models.ggml_linear import dense_linear

                self.dense[i] = dense_linear(lin)
            lin = self.dense[i]
        return cpu_packing.build_kernel(kernel, lin)

    def install(self, kernel: str | None) -> None:
        if kernel is not None and kernel not in self.built:
            self.built[kernel] = [self._module(kernel, i, lin) for i, (_, _, lin) in enumerate(self.slots)]
        for i, (parent, name, lin) in enumerate(self.slots):
            setattr(parent, name, lin if kernel is None else self.built[kernel][i])


@torch.inference_mode()
def probe_kernels(model: nn.Module, kernels: list[str], widths=WIDTHS, context: int = 128, rounds: int = 5,
                  budget_s: float = PROBE_BUDGET_S, check: bool = True) -> dict:
    """Milliseconds of whole passes over `widths` tokens (one row, after `context` cached tokens) per kernel: the
    fastest of the rounds, kernels interleaved round by round. More rounds run (within `budget_s`) while any
    pass's median repeat lies more than NOISY above its fastest; `quiet` says whether it ended below that."""
    from . import sync

    slots = _Installed(model)
    dev = model.device
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    kv = model.new_kv(context + max(widths) + 1)
    ctx = torch.randint(0, V, (1, context), generator=g).to(dev)
    inputs = {w: (torch.randint(0, V, (1, w), generator=g).to(dev),
                  torch.arange(context, context + w, device=dev)[None]) for w in widths}
    times = {(k, w): [] for k in kernels for w in widths}
    t0 = time.perf_counter()
    try:
        slots.install(kernels[0])
        model(ctx, torch.arange(context, device=dev)[None], kv, num_logits=1)
        kv.commit()
        rnd = 0
        while True:
            for k in kernels:
                slots.install(k)
                for w in widths:
                    sync(dev)
                    s = time.perf_counter()
                    model(*inputs[w], kv)  # logits of every row, as verification computes them
                    sync(dev)
                    kv.truncate(context)
                    if rnd:  # round 0 warms up (and builds each kernel's modules)
                        times[(k, w)].append(time.perf_counter() - s)
            rnd += 1
            if rnd <= rounds:
                continue
            spread = max(statistics.median(ts) / min(ts) - 1 for ts in times.values())
            if spread <= NOISY or time.perf_counter() - t0 > budget_s:
                break
    finally:
        slots.install(None)
    return {"version": PROBE_VERSION, "widths": list(widths), "context": context,
            "ms": {k: {str(w): 1000 * min(times[(k, w)]) for w in widths} for k in kernels},
            "spread": round(spread, 3), "quiet": spread <= NOISY, "rounds": rnd - 1,
            "invariant": {k: batch_invariant(model, k) for k in kernels} if check else {}}


def _ms_at(ms: dict, width: int) -> float:
    """Milliseconds of a pass over `width` tokens, interpolated between the measured widths."""
    xs = sorted(int(w) for w in ms)
    if width <= xs[0]:
        return ms[str(xs[0])]
    for a, b in zip(xs, xs[1:]):
        if a <= width <= b:
            return ms[str(a)] + (ms[str(b)] - ms[str(a)]) * (width - a) / (b - a)
    return ms[str(xs[-1])] * width / xs[-1]


def expected_rate(ms: dict, drafting: Drafting | None) -> float:
    """Expected tokens per second with one kernel's pass times: plain decoding, or the better of plain decoding
    and `tau` tokens per verification pass (the depth policy decodes plain where drafting does not pay)."""
    plain = 1000.0 / ms["1"]
    if drafting is None:
        return plain
    return max(plain, 1000.0 * drafting.tau / _ms_at(ms, drafting.width))


def choose_kernels(probe: dict, dtype: torch.dtype, device: torch.device | str = "cpu",
                   drafting: Drafting | None = None) -> KernelChoice:
    """The default choice from a whole-pass probe (see the module doc); notes say why each other lost."""
    ms, inv = probe["ms"], probe.get("invariant", {})
    dt = str(dtype).replace("torch.", "")
    exact = [k for k in ["ggml", *exact_candidates(dtype, device)] if k in ms] or ["native"]
    if "native" not in ms:
        ms = {**ms, "native": {w: 0.0 for w in next(iter(ms.values()), {"1": 0.0})}}
    rate = {k: expected_rate(ms[k], drafting) for k in ms}
    what = "plain decoding" if drafting is None else f"a drafter of tau {drafting.tau:g} over {drafting.width} tokens"
    best = max(exact, key=rate.get)
    invariant = [k for k in exact if inv.get(k)]
    best_inv = max(invariant, key=rate.get) if invariant else None
    notes = []
    if best_inv is not None and rate[best_inv] * INVARIANT_SLACK >= rate[best]:
        chosen = best_inv
        reason = f"{chosen}: the most tokens/s for {what}, batch-invariant"
        if best_inv != best:
            reason = (f"{chosen}: batch-invariant, {rate[best] / rate[best_inv] - 1:.0%} behind {best} for {what}")
    else:
        chosen = best
        reason = f"{chosen}: the most tokens/s for {what}"
        if best_inv is None:
            notes.append("no kernel is batch-invariant on this host: bf16 speculative output can part from plain "
                         "decoding at a near-tie (use --dtype fp32 for identical outputs)")
        else:
            notes.append(f"{best_inv} is batch-invariant (bf16 speculative output = plain decoding bit for bit) but "
                         f"{1 - rate[best_inv] / rate[best]:.0%} slower here: --linear-kernel {best_inv} to prefer it")
    for k in ms:
        if k == chosen:
            continue
        t1, tw = ms[k]["1"], _ms_at(ms[k], MULTI)
        if k in exact:
            notes.append(f"{k}: {t1:.1f} ms per decode step, {tw:.1f} ms per {MULTI}-token pass"
                         f"{', batch-invariant' if inv.get(k) else ', not batch-invariant'}")
        elif rate[k] > rate[chosen]:
            notes.append(f"{k} would be faster ({t1:.1f} / {tw:.1f} ms) but changes a {dt} model's numerics: opt "
                         f"in with --linear-kernel {k} (then plain and speculative passes both run it)")
        else:
            notes.append(f"{k} does not win ({t1:.1f} / {tw:.1f} ms) and changes a {dt} model's numerics")
    if not probe.get("quiet", True):
        why = probe.get("others") or f"repeats spread {probe.get('spread', 0):.0%}"
        notes.append(f"measured on a busy host ({why}): measured again next time")
    return KernelChoice(chosen, chosen, reason, dt, probe, notes, bool(inv.get(chosen)))


def _cache_path(model: nn.Module, dtype: torch.dtype) -> str:
    from ..tokenizer import cache_dir

    dt = str(dtype).replace("torch.", "")
    return os.path.join(cache_dir(), "host", f"kernels-{host_key()}-{dt}-{_signature(model, dtype)}.json")


def kernel_choice(model: nn.Module, kernel: str = "auto", device: torch.device | str | None = None,
                  refresh: bool = False, log=None, drafting: Drafting | None = None) -> KernelChoice:
    """The kernel choice for `model` (its linears still plain `nn.Linear`s) on `device`. `kernel`: "auto" (the
    whole-pass probe's choice for plain decoding, or for `drafting` when a drafter will run; cached per host), a
    kernel name forced for every pass, or "S+M": kernel S for single-row passes and M (a name or "auto") for
    multi-row ones -- for a drafter only, whose numerics never reach the output (two kernels that round
    differently would part a target's speculative output from its plain one)."""
    p = next(model.parameters())
    dtype, dev = p.dtype, torch.device(device) if device is not None else p.device
    dt = str(dtype).replace("torch.", "")
    if "+" in kernel:
        single, _, multi = kernel.partition("+")
        if single == "auto" or "+" in multi:
            raise SpecloomError(f"linear kernels {kernel!r}: give SINGLE+MULTI, a kernel name for one-row passes "
                                "and a name or auto for passes over several rows")
        one = kernel_choice(model, single, dev)
        many = kernel_choice(model, multi, dev, refresh=refresh, log=log)
        if one.single == many.multi:
            return one
        return KernelChoice(single, many.multi, f"{single} for one-row passes, {many.multi} for several rows "
                            f"({many.reason})", dt, many.probe, many.notes)
    held = bool(_held(model))
    if kernel == "ggml":
        if not held:
            raise SpecloomError("linear kernel 'ggml' computes from the blocks a GGUF file ships; this model holds "
                                "none (not a GGUF target, --dtype fp32, or no GGML type with a kernel)")
        return KernelChoice("ggml", "ggml", "forced: GGUF weights as shipped", dt,
                            invariant=batch_invariant(model, "ggml"))
    if kernel != "auto":
        if kernel not in cpu_packing.KERNELS:
            raise SpecloomError(f"unknown linear kernel {kernel!r} (auto, ggml, {', '.join(cpu_packing.KERNELS)})")
        if not cpu_packing.kernel_available(kernel, dtype, dev):
            raise SpecloomError(f"linear kernel {kernel!r} cannot run {dt} weights on {dev} here (available: "
                                f"{', '.join(candidates(dtype, dev))})")
        why = "forced" + (f"; changes a {dt} model's numerics" if cpu_packing.changes_numerics(kernel, dtype) else "")
        inv = batch_invariant(model, kernel) if dev.type == "cpu" and _groups(model) else None
        return KernelChoice(kernel, kernel, why, dt, invariant=inv)
    if dev.type != "cpu":
        return KernelChoice("native", "native", f"{dev.type}: no CPU kernels", dt)
    cands = (["ggml"] if held else []) + candidates(dtype, dev)
    if len(cands) == 1 or dtype == torch.float32 or not hasattr(model, "new_kv"):
        # one exact kernel (fp32: native; int8 is opt-in only), or not a target model: nothing to choose
        inv = batch_invariant(model, "native") if dtype == torch.float32 and _groups(model) else None
        return KernelChoice("native", "native", "the only exact kernel", dt, invariant=inv)
    path = _cache_path(model, dtype)
    probe = None if refresh else _read_probe(path, cands, log)
    if probe is not None and not probe.get("quiet", False):
        # a provisional choice (timed beside other work) is timed again once the host is quiet; while other work
        # still runs, a new probe would be provisional too: it would cost every load ~25 s for nothing
        watch = Contention()
        time.sleep(BUSY_LOOK_S)
        others = watch.busy_host()
        if not others:
            probe = None
        elif log:
            log(f"the host is still busy ({others}): using the provisional kernel choice of {path}; it is timed "
                "again on a load while the host is quiet")
    if probe is not None and probe.get("quiet", False):
        chosen = choose_kernels(probe, dtype, dev, drafting).single
        now = probe_kernels(model, [chosen], widths=(1,), rounds=3, budget_s=0.0, check=False)["ms"][chosen]["1"]
        if now < LIVE_CHECK * probe["ms"][chosen]["1"]:
            if log:
                log(f"cached kernel probe {path} was taken on a busier host (a decode step: "
                    f"{probe['ms'][chosen]['1']:.1f} ms cached, {now:.1f} ms now); measuring again")
            probe = None
    if probe is None:
        if log:
            log(f"timing decode steps and verification passes with each linear kernel ({', '.join(cands)}) once "
                "for this host")
        watch = Contention()
        probe = probe_kernels(model, cands)
        others = watch.busy_host()  # repeats can agree while another process slows every one of them alike
        if others:
            probe.update(quiet=False, others=others)
        probe["host"] = host_key()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(probe, f, indent=1)
        os.replace(tmp, path)
        if log and not probe["quiet"]:
            why = probe.get("others") or f"repeats spread {probe['spread']:.0%}"
            log(f"the host was busy while timing ({why}): the kernel choice is provisional and is measured again "
                "on the next load")
    return choose_kernels(probe, dtype, dev, drafting)


def _read_probe(path: str, cands: list[str], log=None) -> dict | None:
    """A cached probe that is whole and current (taken on a quiet host or not: `quiet`); None otherwise (a corrupt
    file is named and measured again)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            probe = json.load(f)
        ok = (probe.get("version") == PROBE_VERSION and set(probe["ms"]) == set(cands)
              and all(float(v[w]) > 0 for v in probe["ms"].values() for w in ("1", str(MULTI))))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        if log:
            log(f"kernel probe cache {path} is unreadable: measuring again")
        return None
    return probe if ok else None
