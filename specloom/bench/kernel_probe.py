"""Which linear kernel runs the target's passes on this host: a short measured probe, cached per host.

For each distinct linear shape of the model (one module of each, weighted by how many the model has; a weight
of more than 8192 rows by its first 8192, time scaled) every
candidate kernel (models/cpu_packing.py: `onednn`, `native`, `fp32`, `int8`) multiplies 1 row (a plain decode
step) and `MULTI` rows (a verification pass over a small tree / chain), interleaved, median of a few repeats
within a time budget. The products are also compared bit for bit with `native` (`F.linear`) at both row counts.

The choice (`KernelChoice`): among the kernels that keep the model's numerics (for bf16: `onednn` where oneDNN
runs bf16, `invariant` where it builds, and `native`; for fp32: `native`, nothing to probe) the fastest for one
row runs plain decoding; the fastest for `MULTI` rows runs multi-row passes only if both gave bit-identical
products on the probe, otherwise the single-row kernel runs every pass (plain decoding is the floor speculation
falls back to, so it comes first). Except: a batch-invariant kernel (`invariant`) that is fastest for `MULTI`
rows runs every pass when its single-row time is within `INVARIANT_SLACK` of the fastest -- cheap verification
for a few percent of plain speed, and plain and speculative products then agree bit for bit.
`fp32` (for a bf16 model) and `int8` change the target's numerics: they are measured and reported, never chosen
by default; `--linear-kernel fp32|int8` opts in, and then runs plain and speculative passes alike.

The probe's figures are cached in ~/.cache/specloom/host/ per host key (host.py), dtype and shape set.
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
from ..host import host_key
from ..models import cpu_packing

MULTI = 9  # rows of the multi-row probe: an n-gram chain of 4-8, an EAGLE-2 tree of 8 nodes + root
INVARIANT_SLACK = 1.10  # a batch-invariant kernel may be this much slower for 1 row and still run every pass
MAX_OUT = 8192  # larger weights (a 262k-word head) are probed on their first rows, time scaled up


@dataclass
class KernelChoice:
    single: str  # kernel for single-row passes (plain decoding)
    multi: str  # kernel for multi-row passes (verification, prefill, batches)
    reason: str
    dtype: str = ""
    probe: dict | None = None  # {"rows": [1, 9], "ms": {kernel: {rows: ms}}, "identical_to_native": {...}}
    notes: list[str] = field(default_factory=list)  # candidates not chosen, and why

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
        rows = self.probe["rows"]
        cells = ", ".join(f"{k} {'/'.join(f'{ms[k][str(n)]:.1f}' for n in rows)}" for k in ms)
        return f"{head}; probe ms for {'/'.join(map(str, rows))} rows: {cells}"

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


def _signature(model: nn.Module, dtype: torch.dtype) -> str:
    shapes = sorted((k[0], k[1], k[2], n) for k, n in
                    (((m.out_features, m.in_features, m.bias is not None), n) for m, n in _groups(model)))
    return hashlib.sha1(json.dumps([str(dtype), shapes]).encode()).hexdigest()[:12]


def candidates(dtype: torch.dtype, device: torch.device | str) -> list[str]:
    """Every kernel that can run weights of `dtype` on `device`, exact ones first."""
    return [k for k in cpu_packing.KERNELS if cpu_packing.kernel_available(k, dtype, device)]


def exact_candidates(dtype: torch.dtype, device: torch.device | str) -> list[str]:
    return [k for k in candidates(dtype, device) if not cpu_packing.changes_numerics(k, dtype)]


@torch.inference_mode()
def probe_kernels(model: nn.Module, kernels: list[str], rows=(1, MULTI), repeats: int = 5,
                  budget_s: float = 4.0) -> dict:
    """Milliseconds per model pass spent in the linears (sum over shapes of count x median time) per kernel and
    row count, and whether each kernel's products equal `native`'s bit for bit. Kernels are timed interleaved
    (drift hits all alike); each shape gets an equal share of `budget_s` (at least 2 timed repeats)."""
    groups = _groups(model)
    g = torch.Generator().manual_seed(0)
    ms = {k: {n: 0.0 for n in rows} for k in kernels}
    identical = {k: True for k in kernels}
    share = budget_s / max(len(groups), 1)
    for full, count in groups:
        lin, scale = full, 1.0
        if full.out_features > MAX_OUT:  # bounded probe time and memory: time a slice, scale by its share
            lin = nn.Linear(full.in_features, MAX_OUT, bias=full.bias is not None, device="meta")
            lin.weight = nn.Parameter(full.weight.detach()[:MAX_OUT], requires_grad=False)
            if full.bias is not None:
                lin.bias = nn.Parameter(full.bias.detach()[:MAX_OUT], requires_grad=False)
            scale = full.out_features / MAX_OUT
        dev, dt = lin.weight.device, lin.weight.dtype
        xs = {n: torch.randn(n, lin.in_features, generator=g).to(device=dev, dtype=dt) for n in rows}
        ref = {n: lin(xs[n]) for n in rows}
        mods = {k: cpu_packing.build_kernel(k, lin) for k in kernels}
        times = {(k, n): [] for k in kernels for n in rows}
        for k, mod in mods.items():
            for n in rows:
                y = mod(xs[n])  # warm-up, and the bitwise check
                identical[k] = identical[k] and bool(torch.equal(y, ref[n]))
        t_end = time.perf_counter() + share
        for rep in range(repeats):
            for k, mod in mods.items():
                for n in rows:
                    t = time.perf_counter()
                    mod(xs[n])
                    times[(k, n)].append(time.perf_counter() - t)
            if rep >= 1 and time.perf_counter() > t_end:
                break
        for (k, n), ts in times.items():
            ms[k][n] += 1000 * count * scale * statistics.median(ts)
        del mods
    return {"rows": list(rows), "ms": {k: {str(n): v for n, v in d.items()} for k, d in ms.items()},
            "identical_to_native": identical, "shapes": len(groups)}


def choose_kernels(probe: dict, dtype: torch.dtype, device: torch.device | str = "cpu") -> KernelChoice:
    """The default choice from a probe (see the module doc); notes say why each other candidate lost."""
    single_n, multi_n = (str(n) for n in probe["rows"][:2])
    ms, same = probe["ms"], probe["identical_to_native"]
    exact = [k for k in exact_candidates(dtype, device) if k in ms]
    if not exact:
        exact = ["native"]
        ms = {**ms, "native": ms.get("native", {single_n: 0.0, multi_n: 0.0})}
    single = min(exact, key=lambda k: ms[k][single_n])
    multi = min(exact, key=lambda k: ms[k][multi_n])
    dt = str(dtype).replace("torch.", "")
    notes = []
    if (multi != single and multi in cpu_packing.BATCH_INVARIANT
            and ms[multi][single_n] <= INVARIANT_SLACK * ms[single][single_n]):
        # a batch-invariant kernel that wins the multi-row passes runs every pass, if plain decoding loses little
        notes.append(f"{single} is faster for 1 row ({ms[single][single_n]:.1f} vs {ms[multi][single_n]:.1f} ms) but "
                     f"{multi} runs every pass: {ms[multi][multi_n]:.1f} vs {ms[single][multi_n]:.1f} ms for "
                     f"{multi_n} rows, and batch-invariant")
        single = multi
        reason = f"{multi} fastest for {multi_n} rows, batch-invariant, run for every pass"
    elif multi != single:
        if same.get(single, False) and same.get(multi, False):
            reason = (f"{single} fastest for 1 row, {multi} for {multi_n} rows; bit-identical products on the "
                      f"probe")
        else:
            notes.append(f"{multi} is faster for {multi_n} rows ({ms[multi][multi_n]:.1f} vs "
                         f"{ms[single][multi_n]:.1f} ms) but its products differ from {single}'s: not mixed")
            multi = single
            reason = f"{single} fastest for 1 row, run for every pass"
    else:
        reason = f"{single} fastest for 1 and {multi_n} rows" if len(exact) > 1 else f"{single}: the only exact kernel"
        if single in cpu_packing.BATCH_INVARIANT:
            reason += ", batch-invariant"
    for k in ms:
        if k in exact:
            continue
        wins = [n for n in (single_n, multi_n) if ms[k][n] < ms[single if n == single_n else multi][n]]
        if wins:
            how = " and ".join(f"{n} row{'s' if n != '1' else ''} ({ms[k][n]:.1f} vs "
                               f"{ms[single if n == single_n else multi][n]:.1f} ms)" for n in wins)
            notes.append(f"{k} would be faster for {how} but changes a {dt} model's numerics: opt in with "
                         f"--linear-kernel {k} (then plain and speculative passes both run it)")
        else:
            notes.append(f"{k} does not win ({ms[k][single_n]:.1f} / {ms[k][multi_n]:.1f} ms) and changes "
                         f"a {dt} model's numerics")
    return KernelChoice(single, multi, reason, dt, probe, notes)


def _cache_path(model: nn.Module, dtype: torch.dtype) -> str:
    from ..tokenizer import cache_dir

    dt = str(dtype).replace("torch.", "")
    return os.path.join(cache_dir(), "host", f"kernels-{host_key()}-{dt}-{_signature(model, dtype)}.json")


def kernel_choice(model: nn.Module, kernel: str = "auto", device: torch.device | str | None = None,
                  refresh: bool = False, log=None) -> KernelChoice:
    """The kernel choice for `model` (its linears still plain `nn.Linear`s) on `device`. `kernel`: "auto" (the
    probe's choice, cached per host), a kernel name forced for every pass, or "S+M": kernel S for single-row
    passes and M (a name or "auto") for multi-row ones -- for a drafter only, whose numerics never reach the
    output (two kernels that round differently would part a target's speculative output from its plain one)."""
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
    if kernel != "auto":
        if kernel not in cpu_packing.KERNELS:
            raise SpecloomError(f"unknown linear kernel {kernel!r} (auto, {', '.join(cpu_packing.KERNELS)})")
        if not cpu_packing.kernel_available(kernel, dtype, dev):
            raise SpecloomError(f"linear kernel {kernel!r} cannot run {dt} weights on {dev} here (available: "
                                f"{', '.join(candidates(dtype, dev))})")
        why = "forced" + (f"; changes a {dt} model's numerics" if cpu_packing.changes_numerics(kernel, dtype) else "")
        return KernelChoice(kernel, kernel, why, dt)
    if dev.type != "cpu":
        return KernelChoice("native", "native", f"{dev.type}: no CPU kernels", dt)
    cands = candidates(dtype, dev)
    if len(cands) == 1 or dtype == torch.float32:
        # one exact kernel (fp32: native; int8 is opt-in only): nothing to choose, no probe
        return KernelChoice("native", "native", "the only exact kernel", dt)
    path = _cache_path(model, dtype)
    probe = None
    if not refresh and os.path.isfile(path):
        try:
            with open(path) as f:
                probe = json.load(f)
            if set(probe["ms"]) != set(cands):
                probe = None
        except (OSError, ValueError, KeyError):
            probe = None
    if probe is None:
        if log:
            log(f"probing linear kernels ({', '.join(cands)}) once for this host")
        probe = probe_kernels(model, cands)
        probe["host"] = host_key()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(probe, f, indent=1)
        os.replace(tmp, path)
    return choose_kernels(probe, dtype, dev)
