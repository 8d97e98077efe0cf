"""`specloom doctor`: will this drafter pay on this target and this machine? A check of about a minute, before
serving.

(a) **Is it the drafter's target?** The structural fingerprint its checkpoint records (fingerprint.py: shapes,
    vocabulary, embedding and head hashes), each difference named, and the behavioural distance to the target
    it was made with (behaviour.py: KL and top-1 agreement on the packaged probe) -- which also sees fine-tunes and
    re-quantizations that keep the embedding and head.
(b) **How much does it accept here?** The drafter drafts at its own depth (speculation fixed, greedy) on a few
    short packaged prompts (`doctor_prompts.jsonl`, not the eval set; `--prompts` for others): tau and acceptance
    per position, against the tau its manifest records (`measured.mean_accepted_length`); the drafting time per
    step is measured on the way, and (`measure_plain`) plain decoding of the same prompts for a measured speed-up.
(c) **Does it pay on this machine?** This host's verify-cost curve c(1, T) (the one the load-aware policy uses,
    cached per host) and the measured drafting cost give the expected speed-up of every depth at the acceptance
    of (b) -- the policy's own model (`DepthPolicy.expected_speedup`: E[tokens | alpha](k) / (c(1, nodes(k)) +
    k * draft_cost)) -- and the best setting.
(d) **Verdict**: "mismatch" when (a) names a structural difference, or when the behavioural distance crosses its
    limits and the probe's tau fell below the manifest's (by more than a quarter of the accepted tokens per step;
    with no manifest tau, the distance alone decides). A target that moved while acceptance held -- the 4-bit
    re-exports of SmolLM2 in BENCHMARKS.md move it a lot and the bundled drafters accept as much as before -- is
    said in the reason but judged on speed. Otherwise "pays" when the best depth beats plain decoding by the
    policy's margin (2 %), else "does_not_pay"; with the reason in one sentence.

`run_doctor(engine)` returns a `DoctorReport`; `serve` runs it on two short prompts at start-up (`quick=True`;
`--no-doctor` skips it) and logs the findings and the verdict, and the live acceptance monitor starts from its
tau.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

from .errors import SpecloomError

PROMPTS = os.path.join(os.path.dirname(__file__), "doctor_prompts.jsonl")
VERDICTS = ("pays", "does_not_pay", "mismatch")
# tau below 1 + LOW_TAU * (manifest tau - 1): the acceptance probe says the drafter lost (more than a quarter of)
# its accepted tokens per step here
LOW_TAU = 0.75


@dataclass
class DoctorReport:
    verdict: str
    reason: str
    predicted_speedup: float
    best_config: dict | None
    tau: float
    tau_expected: float | None
    behavioural_distance: dict | None
    differences: list[str]
    drafter: str = ""
    checkpoint: str | None = None
    acceptance_per_position: list[float] = field(default_factory=list)
    predicted_by_depth: dict = field(default_factory=dict)
    draft_cost: float = 0.0  # drafting time per depth of one step, in 1-token target passes
    verify_cost: dict = field(default_factory=dict)  # c(1, T) in 1-token passes, T = tokens of a pass
    measured_speedup: float | None = None  # at the drafter's own depth, on the probe prompts
    probe_tokens: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)

    def lines(self) -> list[str]:
        """The report for a person, one finding per line."""
        b = self.behavioural_distance
        out = [f"drafter: {self.drafter}" + (f" ({self.checkpoint})" if self.checkpoint else "")]
        out.append("structural fingerprint: " + ("; ".join(self.differences) + " differ" if self.differences
                                                 else "matches" if self.checkpoint else "nothing recorded"))
        out.append("behaviour on the probe: " + (
            f"KL {b['kl_mean']:.4f} nats, top-1 agreement {b['top1_agreement']:.1%}"
            + (" (beyond the limits)" if b.get("exceeds") else "") if b else "no recording in the checkpoint"))
        exp = f" (manifest: {self.tau_expected:.2f})" if self.tau_expected else ""
        acc = ", ".join(f"{a:.2f}" for a in self.acceptance_per_position)
        out.append(f"acceptance probe: tau {self.tau:.2f}{exp}, acceptance per position [{acc}], "
                   f"{self.probe_tokens} tokens")
        pred = ", ".join(f"k={k}: {v:.2f}x" for k, v in self.predicted_by_depth.items())
        out.append(f"this host: drafting {self.draft_cost:.2f} of a target pass per depth; predicted speed-up "
                   f"{pred or 'none'}" + (f"; measured at full depth {self.measured_speedup:.2f}x"
                                          if self.measured_speedup else ""))
        out.append(f"verdict: {self.verdict} -- {self.reason}")
        return out


def read_doctor_prompts(path: str | None) -> list[str]:
    from .prompts import read_prompts

    return [p["text"] for p in read_prompts(path or PROMPTS)]


def checkpoint_findings(engine) -> tuple[str | None, list[str], dict | None, float | None]:
    """(a): the drafter's checkpoint, the structural differences, the behavioural distance and the manifest tau."""
    from .behaviour import memoised_distance
    from .fingerprint import compare, fingerprint
    from .drafters.checkpoint import drafter_prior_tau

    d = engine.drafter
    ck = d.checkpoint or {}
    meta = ck.get("meta") or {}
    diffs = compare(meta.get("target_fingerprint"), fingerprint(engine.model, engine.tokenizer))
    behaviour = None
    if meta.get("target_probe") and os.environ.get("SPECLOOM_BEHAVIOUR_CHECK", "1") != "0":
        try:
            behaviour = memoised_distance(engine.model, engine.tokenizer, meta["target_probe"])
        except ValueError as e:  # a recording that does not fit this target at all
            diffs.append(f"behavioural probe ({e})")
    tau = drafter_prior_tau(d, engine.speculative_config, engine.model.config)
    return ck.get("path"), diffs, behaviour, tau


def acceptance_probe(engine, prompts: list[str], max_tokens: int, measure_plain: bool) -> dict:
    """(b): the drafter at its own depth on `prompts` (the chat template where the model has one; greedy); plain
    decoding interleaved."""
    from .engine import Engine
    from .results import acceptance_rates, add_per_position

    spec = Engine(engine.model, engine.tokenizer, None, engine.max_model_len, kv_dtype=engine.kv_dtype,
                  speculation="fixed")
    # the drafter already loaded (and checked), not a second copy
    spec.speculative_config, spec.drafter = engine.speculative_config, engine.drafter
    plain = Engine(engine.model, engine.tokenizer, kv_dtype=engine.kv_dtype, speculation="off")
    chat = engine.tokenizer.has_chat_template  # (a base model without one gets the raw prompts)
    ids = [engine.encode(p, chat=chat) for p in prompts]
    spec.generate(prompt_token_ids=ids[0], max_tokens=4)  # warm-up: first-call allocations, new shapes
    if measure_plain:
        plain.generate(prompt_token_ids=ids[0], max_tokens=4)
    tokens = passes = drafted = 0
    spec_s = plain_s = draft_s = 0.0
    acc, prop = [], []
    for p in ids:
        r = spec.generate(prompt_token_ids=p, max_tokens=max_tokens)
        tokens += len(r.token_ids) - 1  # the prefill's token is no decode step's
        passes += r.num_target_passes - 1  # tau as everywhere: the prefill pass and its token excluded
        spec_s += r.total_seconds - r.prefill_seconds
        draft_s += r.draft_seconds
        drafted += (r.speculation or {}).get("drafted_steps", 0)
        add_per_position(acc, r.accepted_per_position)
        add_per_position(prop, r.proposed_per_position)
        if measure_plain:
            q = plain.generate(prompt_token_ids=p, max_tokens=len(r.token_ids), ignore_eos=True)
            plain_s += (q.total_seconds - q.prefill_seconds) * (len(r.token_ids) - 1) / max(len(q.token_ids) - 1, 1)
    return {"tokens": tokens, "tau": tokens / max(passes, 1), "draft_seconds": draft_s, "drafted_steps": drafted,
            "acceptance": [round(a, 3) for a in acceptance_rates(acc, prop)],
            "measured_speedup": plain_s / spec_s if measure_plain and spec_s > 0 else None}


def predict(engine, tau: float, draft_seconds: float, drafted_steps: int, cost=None) -> tuple[dict, float, int, dict,
                                                                                             float]:
    """(c): expected speed-up per depth on this host's verify-cost curve at acceptance `tau`. Returns (by depth,
    best speed-up, best depth, the curve's points in 1-token passes, drafting cost per depth)."""
    from .depth import DepthPolicy, tau_to_alpha
    from .cost import batch_cost_cached

    d = engine.drafter
    cost = cost or batch_cost_cached(engine.model, 1)
    policy = DepthPolicy.for_drafter("load_aware", d, cost, prior_tau=tau, calibrate=False)
    k_max = d.num_speculative_tokens  # after the policy: it may have re-chosen the tree for this host
    draft_cost = draft_seconds / drafted_steps / k_max / cost.base if drafted_steps else 0.0
    policy.draft_cost = draft_cost
    alpha = tau_to_alpha(tau, k_max)
    by_depth = {k: round(policy.expected_speedup(alpha, k), 3) for k in range(1, k_max + 1)}
    best_k = max(by_depth, key=lambda k: (by_depth[k], -k)) if by_depth else 0
    best = by_depth.get(best_k, 1.0)
    curve = {t: round(cost(1, t), 3) for t in sorted({1, *(policy.nodes(k) for k in by_depth)})}
    return by_depth, best, best_k, curve, draft_cost


def judge(diffs: list[str], behaviour: dict | None, best: float, best_k: int, margin: float, tau: float,
          tau_expected: float | None, draft_cost: float) -> tuple[str, str]:
    """(d): the verdict and its reason."""
    if diffs:
        return "mismatch", (f"the drafter was made for another target ({'; '.join(diffs)} differ): it stays exact "
                            "but drafts for a model that is not this one")
    dropped = tau_expected is not None and tau < 1 + LOW_TAU * (tau_expected - 1)
    moved = behaviour is not None and behaviour.get("exceeds")
    if moved and (dropped or tau_expected is None):
        return "mismatch", (f"the target behaves differently from the one the drafter was made with (KL "
                            f"{behaviour['kl_mean']:.3f} nats, top-1 agreement {behaviour['top1_agreement']:.0%} "
                            "on the probe: a fine-tune or another quantization)"
                            + (f" and tau {tau:.2f} is below the manifest's {tau_expected:.2f}" if dropped else "")
                            + "; adapt the drafter to it")
    low = f"; tau {tau:.2f} is below the manifest's {tau_expected:.2f}" if dropped else ""
    if moved:  # the target moved but the drafter still accepts as its manifest says (BENCHMARKS: re-exports)
        low += (f"; the target moved from the drafter's (KL {behaviour['kl_mean']:.3f} nats, top-1 agreement "
                f"{behaviour['top1_agreement']:.0%}) but acceptance held")
    if best > margin:
        return "pays", (f"at tau {tau:.2f} and drafting {draft_cost:.2f} of a pass per depth, depth {best_k} is "
                        f"expected to run {best:.2f}x plain decoding on this host{low}")
    return "does_not_pay", (f"at tau {tau:.2f} and drafting {draft_cost:.2f} of a pass per depth, no depth beats "
                            f"plain decoding by {margin - 1:.0%} on this host (best {best:.2f}x){low}")


def refused(method: str, checkpoint: str | None, error: Exception) -> DoctorReport:
    """The report for a drafter refused from its config alone (errors.DrafterMismatch: another architecture, width
    or vocabulary), before any weights loaded: nothing to probe, the verdict is "mismatch"."""
    return DoctorReport(
        verdict="mismatch", reason=f"refused before loading weights: {error}", predicted_speedup=1.0,
        best_config=None, tau=0.0, tau_expected=None, behavioural_distance=None, differences=[str(error)],
        drafter=method, checkpoint=checkpoint)


def run_doctor(engine, prompts: list[str] | None = None, max_tokens: int = 48, measure_plain: bool = True,
               quick: bool = False, cost=None) -> DoctorReport:
    """The whole check for `engine` (a target with its drafter loaded). `quick`: two prompts of 32 tokens and no
    plain run (the server's start-up check: a few seconds). `cost`: a verify-cost curve (`BatchCost`) instead of
    this host's cached one."""
    if engine.drafter is None:
        raise SpecloomError("doctor needs a drafter: give --speculative-config")
    t0 = time.perf_counter()
    prompts = prompts or read_doctor_prompts(None)
    if quick:
        prompts, max_tokens, measure_plain = prompts[:2], min(max_tokens, 32), False
    if quick and cost is None:  # the server's start-up: its cached curve as read, or a one-row probe (no minute of
        from .cost_refresh import startup_curve  # measuring before the server is ready)

        cost = startup_curve(engine.model, 1)[0]
    path, diffs, behaviour, tau_expected = checkpoint_findings(engine)
    probe = acceptance_probe(engine, prompts, max_tokens, measure_plain)
    by_depth, best, best_k, curve, draft_cost = predict(engine, probe["tau"], probe["draft_seconds"],
                                                       probe["drafted_steps"], cost)
    from .depth import DepthPolicy

    margin = DepthPolicy("off", 0).margin
    verdict, reason = judge(diffs, behaviour, best, best_k, margin, probe["tau"], tau_expected, draft_cost)
    best_config = None
    if verdict == "pays":
        sc = engine.speculative_config
        best_config = {"method": sc.method, **({"suffix_decoding": True} if sc.suffix_decoding else {}),
                       "num_speculative_tokens": best_k}
    return DoctorReport(
        verdict=verdict, reason=reason, predicted_speedup=round(best, 3), best_config=best_config,
        tau=round(probe["tau"], 3), tau_expected=round(tau_expected, 3) if tau_expected else None,
        behavioural_distance=behaviour, differences=diffs, drafter=engine.drafter.method, checkpoint=path,
        acceptance_per_position=probe["acceptance"], predicted_by_depth=by_depth, draft_cost=round(draft_cost, 3),
        verify_cost=curve, probe_tokens=probe["tokens"],
        measured_speedup=round(probe["measured_speedup"], 3) if probe["measured_speedup"] else None,
        seconds=round(time.perf_counter() - t0, 1))
