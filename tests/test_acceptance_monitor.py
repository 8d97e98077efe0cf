"""The live acceptance monitor of `specloom serve` (serving/monitor.py, issue 16 item 4): rolling acceptance over the
last drafted steps, overall and per position, against a start-up figure; a sustained drop sets `degraded` and logs
one rate-limited warning, a normal run (or a workload somewhat harder than the manifest's) does not; the gauges in
/metrics; a drafter swapped mid-run for one whose every draft is rejected: the gauge drops, one warning, the
load-aware policy stops drafting (the steps and their modelled cost stay plain decoding's) and outputs stay exact
-- and without the monitor's correction of the policy's prior it would not; a soak of 208 identical greedy
requests through the batching server gives identical outputs and identical acceptance at the start and the end."""

import logging
import os
import random
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from specloom import Engine
from specloom.drafters.base import Drafter
from specloom.sampling import SamplingParams
from specloom.scheduler import BatchScheduler, Sequence
from specloom.cost import BatchCost
from specloom.depth import tau_to_alpha
from specloom.serving.metrics import Metrics
from specloom.serving.monitor import AcceptanceMonitor, attach_monitor
from specloom.speculative import SpeculativeConfig
from specloom.tree import DraftTree

PROMPT = [5, 6, 7, 8] * 6


def geometric(rng, alpha, k):
    """Accepted tokens of one k-deep chain whose drafts are each accepted with probability alpha."""
    a = 0
    while a < k and rng.random() < alpha:
        a += 1
    return a


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def warnings_in(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "specloom.serve"]


# -- arithmetic ------------------------------------------------------------------------------------------------
def test_rolling_window_and_per_position_arithmetic():
    m = AcceptanceMonitor(expected_tau=1.8, depth=3, window=4)
    assert m.alpha is None and m.per_position == [] and m.tau is None
    assert m.expected_alpha == pytest.approx(tau_to_alpha(1.8, 3)) and 1 + m.expected_alpha + m.expected_alpha ** 2 \
        + m.expected_alpha ** 3 == pytest.approx(1.8, abs=1e-6)
    # real trees: a chain accepted whole, a tree whose accepted path is 1 deep, a chain rejected at once, depth 1
    tree = DraftTree([9, 10, 11, 12, 13], [-1, 0, 0, 1, 2])  # two branches, 2 deep
    m.observe([DraftTree.chain(9, [1, 2, 3]), DraftTree.chain(9, [1, 2, 3]), DraftTree.chain(9, [4, 5]),
               DraftTree.chain(9, [])], [3, 1, 0, 0])
    m.observe([DraftTree.chain(9, [6])], [1])
    assert len(m.steps) == 4  # the one-node tree (no draft) is not a drafted step
    # accepted 3+1+0+1 = 5 of examined 3+2+1+1 = 7; position i: accepted / reached
    assert m.alpha == pytest.approx(5 / 7)
    assert m.per_position == pytest.approx([3 / 4, 1 / 3, 1 / 2])
    assert m.tau == pytest.approx(1 + 5 / 4)
    m.observe([tree], [2])  # the window drops the oldest (3, 3)
    assert list(m.steps) == [(3, 1), (2, 0), (1, 1), (2, 2)]
    assert m.alpha == pytest.approx(4 / 6)  # examined 2 + 1 + 1 + 2
    assert m.per_position == pytest.approx([3 / 4, 1 / 3, 0.0])  # only (3, 1) reached position 2 now
    assert (m.proposed_at, m.accepted_at) == ([4, 3, 1], [3, 1, 0])
    m.observe_counts([(2, 5)])  # an accepted count past the depth is clipped
    assert m.steps[-1] == (2, 2) and m.total_steps == 6
    # no start-up figure (n-gram, suffix): gauges only, never degraded
    n = AcceptanceMonitor(None, depth=3, min_steps=1, check_every=1, consecutive=1)
    n.observe_counts([(3, 0)] * 50)
    assert n.alpha == 0.0 and not n.degraded and n.expected_alpha is None


# -- the warning -----------------------------------------------------------------------------------------------
def test_warning_on_a_sustained_drop_is_rate_limited(caplog):
    clock = Clock()
    m = AcceptanceMonitor(expected_tau=1.8, depth=3, clock=clock)
    rng = random.Random(0)
    e = m.expected_alpha
    caplog.set_level(logging.INFO, logger="specloom.serve")
    m.observe_counts([(3, geometric(rng, e, 3)) for _ in range(2000)])  # as promised: nothing
    assert not m.degraded and m.alpha == pytest.approx(e, abs=0.05) and warnings_in(caplog) == []
    drop = [(3, geometric(rng, 0.1, 3)) for _ in range(1000)]
    for i, s in enumerate(drop):  # one drafted step at a time: how long does the drop take to show?
        m.observe_counts([s])
        if m.degraded:
            break
    # sustained, not instant: the window (512) must turn over to below half the figure, then 3 checks in a row
    assert m.degraded and 200 <= i <= 512, i
    w = warnings_in(caplog)
    assert len(w) == 1 and "0.50 x the start-up figure 0.472" in w[0] and "tau 1.80" in w[0] \
        and "drafter's manifest" in w[0], w
    assert f"{m.alpha:.3f} over the last 512 drafted steps" in w[0]
    clock.t += 200
    m.observe_counts([(3, 0)] * 2000)  # still degraded, 200 s later: no second warning yet
    assert m.degraded and len(warnings_in(caplog)) == 1
    clock.t += 101  # 301 s after the first: one reminder
    m.observe_counts([(3, 0)] * 2000)
    assert len(warnings_in(caplog)) == 2
    m.observe_counts([(3, geometric(rng, e, 3)) for _ in range(2000)])  # it recovers ...
    assert not m.degraded and any("recovered" in r.getMessage() for r in caplog.records)
    clock.t += 10
    m.observe_counts([(3, 0)] * 2000)  # ... and drops again within 300 s: degraded, but no new warning
    assert m.degraded and len(warnings_in(caplog)) == 2 and m.warnings == 2


def test_no_alarm_on_normal_runs(caplog):
    """Acceptance as promised, a workload at 60 % of the promise, short bursts of total rejection inside a
    normal run, and a tiny start-up figure with a noise-sized drop: never degraded, no warning."""
    caplog.set_level(logging.INFO, logger="specloom.serve")
    rng = random.Random(1)
    for tau, scale in ((1.8, 1.0), (1.8, 0.6), (3.3, 0.6), (1.17, 1.0)):
        m = AcceptanceMonitor(expected_tau=tau, depth=3)
        e = m.expected_alpha
        flags = []
        for _ in range(40):
            m.observe_counts([(rng.choice((1, 2, 3)), geometric(rng, e * scale, 3)) for _ in range(200)])
            flags.append(m.degraded)
        assert not any(flags), (tau, scale, m.alpha, e)
    m = AcceptanceMonitor(expected_tau=1.8, depth=3)
    for _ in range(30):  # 400 normal steps, then a burst of 120 rejected ones (a prompt the drafter cannot do)
        m.observe_counts([(3, geometric(rng, m.expected_alpha, 3)) for _ in range(400)] + [(3, 0)] * 120)
        assert not m.degraded, m.alpha
    assert warnings_in(caplog) == []
    # a small start-up figure (alpha ~0.05: a handful of accepted tokens per window) met exactly: windows that
    # fall below half of it by chance are common, the significance test keeps them from counting
    fired = {}
    for z in (0.0, 3.0):
        fired[z] = 0
        for seed in range(100):
            r = random.Random(seed)
            m = AcceptanceMonitor(expected_tau=1.05, depth=3, z=z)
            m.observe_counts([(3, geometric(r, m.expected_alpha, 3)) for _ in range(512)])
            fired[z] += m.warnings > 0  # degraded at some point
    assert fired[3.0] == 0 and fired[0.0] > 0, fired  # without the test: false alarms


# -- gauges ----------------------------------------------------------------------------------------------------
def test_gauges_in_metrics_text():
    class Sch:  # the parts of a scheduler Metrics.render reads
        num_running = num_waiting = 0
        drafter = object()

        class pool:
            lengths, active, rows, max_len = [0], 0, 1, 10

    sch = Sch()
    sch.monitor = AcceptanceMonitor(expected_tau=1.8, depth=3, min_steps=1, check_every=1, consecutive=1)
    met = Metrics("m")
    met.bind(sch)
    text = met.render()
    assert 'specloom:spec_decode_acceptance_rate{model_name="m"} NaN' in text  # nothing drafted yet
    assert 'specloom:spec_decode_degraded{model_name="m"} 0' in text
    sch.monitor.observe_counts([(3, 3), (3, 1), (2, 0), (1, 1)] + [(3, 0)] * 60)
    text = met.render()
    lines = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(lines['specloom:spec_decode_acceptance_rate{model_name="m"}']) == pytest.approx(5 / 67, abs=1e-6)
    assert float(lines['specloom:spec_decode_acceptance_rate_per_pos{model_name="m",position="0"}']) == \
        pytest.approx(3 / 64, abs=1e-6)
    assert 'specloom:spec_decode_acceptance_rate_per_pos{model_name="m",position="2"}' in lines
    assert float(lines['specloom:spec_decode_acceptance_rate_expected{model_name="m"}']) == \
        pytest.approx(sch.monitor.expected_alpha, abs=1e-6)
    assert lines['specloom:spec_decode_degraded{model_name="m"}'] == "1"
    assert "# TYPE specloom:spec_decode_degraded gauge" in text
    sch.drafter = None  # plain serving: no acceptance gauges
    assert "spec_decode_acceptance_rate" not in met.render()


# -- a drafter that fails mid-run ------------------------------------------------------------------------------
class Scripted(Drafter):
    """Knows the greedy continuation of PROMPT: proposes it (`right`) or a token that never occurs in it (every
    draft rejected). A manifest-like prior (tau 1.8 at depth 3); EAGLE-like to the policy: a companion KV (not
    cheap) whose idle steps are free (probed)."""

    prior_tau = 1.8

    def __init__(self, truth, right, k=3):
        self.truth, self.right, self.k = truth, right, k
        self.absent = next(x for x in range(4, 256) if x not in truth)

    @property
    def num_speculative_tokens(self):
        return self.k

    @property
    def idle_free(self):
        return True

    def memory(self):
        return {"weights": 0, "kv_per_1k_tokens": 1000}

    def propose_one(self, ctx):
        n = len(ctx.tokens)
        drafts = self.truth[n:n + ctx.k] if self.right else [self.absent] * ctx.k
        return DraftTree.chain(ctx.tokens[-1], drafts)


# verifying 4 tokens costs 1.3 steps: a drafter at its manifest's acceptance (alpha 0.47, 1.8 tokens) pays
CURVE = {1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4, 9: 1.8, 17: 2.6}
WAVE, N = 4, 16


def _scheduler(t, drafter, log_steps):
    cost = BatchCost({(n, k): 0.02 * v * (1 + 0.1 * (n - 1)) for n in (1, 2, 4) for k, v in CURVE.items()},
                     frozen=True)
    engine = Engine(t.model, t.tokenizer, max_model_len=256)
    engine.drafter = drafter
    sch = BatchScheduler(engine, rows=WAVE, mode="load_aware", cost=cost)
    # the server's monitor, with a quarter of the default window (and checks), so that a swap shows within a few
    # waves of four requests
    attach_monitor(sch, window=128, min_steps=64, check_every=32)
    step = sch.stepper.step

    def logged(rows, plan):
        rep = step(rows, plan)
        log_steps.append((rep.rows, rep.width, sum(1 for tr in rep.trees if len(tr) > 1)))
        return rep

    sch.stepper.step = logged
    return sch, cost


def _waves(sch, count):
    out = []
    for _ in range(count):
        seqs = [Sequence(list(PROMPT), N, SamplingParams(), ignore_eos=True) for _ in range(WAVE)]
        sch.submit(seqs)  # all four join in one iteration: one batch of four, 15 steps
        out += [s.wait(60).token_ids for s in seqs]
    return out


def _swap(sch, drafter):
    assert sch.num_running == 0
    sch.drafter = sch.stepper.drafter = sch.engine.drafter = drafter


def test_drafter_swapped_mid_run_for_a_failing_one(tiny, caplog):
    """Right drafts first (gauge 1.0), then every draft rejected: the gauge drops to 0, `degraded` turns 1 with
    one warning, and the load-aware policy stops drafting: in the last waves the steps are plain decoding's
    (one per token) and their modelled cost (the frozen verify-cost curve) within 2 % of plain decoding's;
    outputs exact throughout. Without the monitor's correction the policy stops too, by its own accounting
    (`DepthPolicy.optimism`: drafted steps that emit far fewer tokens than expected raise the margin a depth must
    beat); before that accounting it kept drafting each new request's trial steps at the manifest's acceptance
    (a third of all row-steps here)."""
    t = tiny("llama")
    ref = Engine(t.model, t.tokenizer).generate(prompt_token_ids=PROMPT, max_tokens=N, ignore_eos=True).token_ids
    truth = PROMPT + ref
    caplog.set_level(logging.INFO, logger="specloom.serve")
    steps: list = []
    sch, cost = _scheduler(t, Scripted(truth, right=True), steps)
    try:
        assert _waves(sch, 5) == [ref] * 20
        mon = sch.monitor
        assert mon.alpha == 1.0 and not mon.degraded and mon.expected_alpha == pytest.approx(tau_to_alpha(1.8, 3))
        good_steps = len(steps)
        _swap(sch, Scripted(truth, right=False))
        assert _waves(sch, 24) == [ref] * 96  # (the policy's own accounting drafts less: the window fills slower)
        assert mon.degraded and mon.alpha == 0.0 and mon.per_position == [0.0] * len(mon.per_position)
        w = warnings_in(caplog)
        assert len(w) == 1 and "speculative acceptance has dropped: 0.000" in w[0] \
            and "Load-aware speculation now judges new requests by the measured acceptance" in w[0], w
        assert sch.policy.prior_alpha == 0.0  # judged by what it does now, not by its manifest
        bad = steps[good_steps:]
        assert len(bad) == 24 * (N - 1)  # every step one token: the steps of plain decoding
        tail = bad[-8 * (N - 1):]  # the last 8 waves
        drafted = sum(d for _, _, d in tail) / sum(n for n, _, _ in tail)
        modelled = sum(cost(n, w) for n, w, _ in tail) / sum(cost(n, 1) for n, _, _ in tail)
        assert drafted < 0.1 and modelled < 1.02, (drafted, modelled)  # what is left: one probe per request
        text = Metrics("m")
        text.bind(sch)
        assert 'specloom:spec_decode_degraded{model_name="m"} 1' in text.render()
    finally:
        sch.close()
    # the same failing drafter, the monitor's correction off: the policy's own accounting stops the trial steps
    steps = []
    sch, cost = _scheduler(t, Scripted(truth, right=False), steps)
    sch._monitor = lambda rep: sch.monitor.observe(rep.trees, rep.accepted)
    try:
        assert _waves(sch, 8) == [ref] * 32
        tail = steps[-4 * (N - 1):]
        drafted = sum(d for _, _, d in tail) / sum(n for n, _, _ in tail)
        assert sch.policy.optimism() > 1.2 and drafted < 0.1, (sch.policy.optimism(), drafted)
        sch.policy.optimism = lambda: 1.0  # the same policy without its accounting drafts every trial
        assert _waves(sch, 4) == [ref] * 16
        tail = steps[-4 * (N - 1):]
        assert sum(d for _, _, d in tail) / sum(n for n, _, _ in tail) > 0.3
    finally:
        sch.close()


# -- soak ------------------------------------------------------------------------------------------------------
def _noisy_copy(t, path, sd=0.1):
    """The tiny target with noise on its matrices: a draft model that agrees with it about half the time."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(t.path, path)
    f = next(os.path.join(path, x) for x in os.listdir(path) if x.endswith(".safetensors"))
    g = torch.Generator().manual_seed(7)
    w = {k: v + sd * v.std() * torch.randn(v.shape, generator=g) if v.ndim > 1 else v
         for k, v in load_file(f).items()}
    save_file(w, f, metadata={"format": "pt"})
    return path


def test_soak_same_greedy_request_through_the_server(tiny, tmp_path, caplog):
    """208 copies of one greedy request through the batching server (4 client threads, requests joining and
    leaving continuously; a draft model with its own KV per row, depth 3 fixed): every output equals plain
    decoding's, every request's acceptance (per position) equals the first's -- the last 20 requests as the
    first 20: no drafter state leaks from one request into the next -- and the monitor, given the alone run's
    tau as its start-up figure, stays quiet with its rolling acceptance at the start's; /metrics shows it."""
    from specloom.bench.serve_load import LiveServer
    from specloom.serving.api import Server

    pytest.importorskip("uvicorn")
    t = tiny("llama")
    spec = SpeculativeConfig.parse({"method": "draft_model", "model": _noisy_copy(t, str(tmp_path / "noisy")),
                                    "num_speculative_tokens": 3})
    engine = Engine(t.model, t.tokenizer, spec, max_model_len=256)
    alone = engine.generate(prompt_token_ids=PROMPT, max_tokens=N)
    plain = Engine(t.model, t.tokenizer).generate(prompt_token_ids=PROMPT, max_tokens=N)
    assert alone.token_ids == plain.token_ids and 1.3 < alone.mean_accepted_length < 3.5  # not vacuous
    caplog.set_level(logging.INFO, logger="specloom.serve")
    server = Server(engine, "tiny", max_num_seqs=4, speculation="fixed", expected_tau=alone.mean_accepted_length)
    results, lock = [], threading.Lock()
    record = server.metrics.record

    def recorded(r, seconds, ttft):  # every finished request's own result, in the order they finish
        with lock:
            results.append(r)
        record(r, seconds, ttft)

    server.metrics.record = recorded
    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0}
    try:
        def one(_):
            return server.complete(dict(body), chat=False)["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(one, range(40)))
            first_window = server.scheduler.monitor.snapshot()
            texts += list(pool.map(one, range(168)))
        assert len(results) == 208 and len(set(texts)) == 1
        want = (plain.token_ids, alone.proposed_per_position, alone.accepted_per_position)
        got = [(r.token_ids, r.proposed_per_position, r.accepted_per_position) for r in results]
        assert got[:20] == [want] * 20 and got[-20:] == [want] * 20 and got == [want] * 208

        def rate(rs):
            return sum(r.num_accepted_tokens for r in rs) / sum(r.num_draft_tokens for r in rs)

        assert rate(results[:20]) == rate(results[-20:]) > 0.2
        end = server.scheduler.monitor.snapshot()
        assert not end["degraded"] and end["warnings"] == 0 and warnings_in(caplog) == []
        assert end["acceptance_rate"] == pytest.approx(first_window["acceptance_rate"], abs=0.03)
        assert end["window_steps"] == 512
        live = LiveServer(server)
        try:
            import urllib.request

            text = urllib.request.urlopen(f"http://127.0.0.1:{live.port}/metrics").read().decode()
        finally:
            live.uv.should_exit = True
            live.thread.join(timeout=10)
        assert 'specloom:spec_decode_degraded{model_name="tiny"} 0' in text
        assert 'specloom:spec_decode_acceptance_rate_per_pos{model_name="tiny",position="2"}' in text
        line = next(x for x in text.splitlines() if x.startswith("specloom:spec_decode_acceptance_rate{"))
        assert float(line.rsplit(" ", 1)[1]) == pytest.approx(end["acceptance_rate"], abs=1e-6)
    finally:
        server.close()
