"""A server ready at once on its verify-cost figures (cost_refresh.py): a cached curve is used as read and checked
in idle time; without one it starts on a one-row probe and measures the full grid in idle time, then caches it; a
curve that live passes contradict is measured again; idle work runs only while nothing is queued or running.

Pass timings are made up where a test judges them (`cost._timed_pass` patched: a pass over n rows x T tokens
costs a known function of n and T), so that nothing here depends on this host's noise."""

import json
import threading
import time

import pytest

from specloom import cost as cost_mod
from specloom.cost import BatchCost
from specloom.cost_refresh import CurveRefresh, startup_curve


def _fake_passes(monkeypatch, per_token: float):
    """Every timed pass costs 1 ms + per_token ms per token in it (rows x tokens); returns the list of widths
    timed."""
    seen = []

    def timed(model, x, pos, kv):
        seen.append(tuple(x.shape))
        return 1e-3 * (1 + per_token * x.shape[0] * x.shape[1])

    monkeypatch.setattr(cost_mod, "_timed_pass", timed)
    return seen


def _run(refresh: CurveRefresh, limit: int = 10_000) -> None:
    """Step until the idle work is done (the refresh watches)."""
    for _ in range(limit):
        if refresh.state == "watching":
            return
        refresh.step()
    pytest.fail("the idle work never finished")


def test_cold_start_probes_one_row_then_measures_the_grid_in_idle_time(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    lines = []
    t0 = time.perf_counter()
    live, refresh = startup_curve(model, 4, log=lines.append)
    assert time.perf_counter() - t0 < 5
    assert "starting on a one-row probe" in lines[0] and "measured in idle time" in lines[0]
    assert live.rows == [1, 2, 4] and live.tokens == list(cost_mod.TOKENS)  # every grid point priced at once
    assert refresh.state == "measuring"
    folder = tmp_path / "specloom" / "verify_cost"
    assert not list(folder.glob("batch2-*-r4-*.json"))  # nothing cached from a probe
    seen = _fake_passes(monkeypatch, per_token=0.5)
    _run(refresh)
    assert {s for s in seen} == {(n, t) for n in (1, 2, 4) for t in cost_mod.TOKENS}
    (path,) = folder.glob("batch2-*-r4-*.json")
    cached = json.loads(path.read_text())
    assert cached["4x17"] == pytest.approx(1e-3 * (1 + 0.5 * 68))
    # adopted in place: the policy's curve (the same object) prices with the measurement now
    assert live(4, 17) == pytest.approx((1 + 0.5 * 68) / 1.5)
    assert "measured in idle time" in lines[-1] and str(path) in lines[-1]
    assert refresh.measurements == 1
    # the next start reads it, with no pass before it is ready
    seen.clear()
    lines.clear()
    again, refresh2 = startup_curve(model, 4, log=lines.append)
    assert not seen and again.seconds == pytest.approx(live.seconds)
    assert lines == [f"verify cost curve read from {path}; checked in idle time"]
    _run(refresh2)  # the check agrees (same made-up host): only the check's passes, no new grid
    assert set(seen) <= {(1, 1), *((1, t) for t in cost_mod.SHAPE_CHECK_TOKENS)}
    assert "the cached shape holds" in lines[-1] and refresh2.measurements == 0


def test_cached_curve_that_this_host_contradicts_is_measured_again_in_idle_time(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    seen = _fake_passes(monkeypatch, per_token=0.05)
    live, refresh = startup_curve(model, 2)
    _run(refresh)
    (path,) = (tmp_path / "specloom" / "verify_cost").glob("batch2-*-r2-*.json")
    # the host changed: a token now costs 10x as much (a 9-token pass no longer nearly free)
    seen = _fake_passes(monkeypatch, per_token=0.5)
    lines = []
    cached, refresh = startup_curve(model, 2, log=lines.append)
    assert cached(1, 9) == pytest.approx(1.45 / 1.05)  # used as read until idle time says otherwise
    _run(refresh)
    assert any("disagrees with this host now" in m for m in lines), lines
    assert refresh.measurements == 1 and cached(1, 9) == pytest.approx(5.5 / 1.5)
    assert json.loads(path.read_text())["1x9"] == pytest.approx(5.5e-3)


def test_live_passes_that_contradict_the_curve_bring_a_new_measurement(tiny, tmp_path, monkeypatch):
    """Served passes calibrate the live curve; once a well-observed point's cost relative to a decode step
    moved by more than cost.SHAPE_TOLERANCE from the cached shape, the idle work measures again (at most once
    per REMEASURE_AFTER_S) and rewrites the cache."""
    from specloom import cost_refresh

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cost_refresh, "WATCH_EVERY_S", 0.0)
    model = tiny("llama").model
    _fake_passes(monkeypatch, per_token=0.05)
    live, refresh = startup_curve(model, 2)
    _run(refresh)
    refresh._last_measure -= cost_refresh.REMEASURE_AFTER_S
    assert refresh.contradiction() == ""
    for _ in range(100):  # passes as the curve predicts: no contradiction, however many
        live.observe(1, 1, live.base)
        live.observe(1, 9, live.base * live(1, 9))
    assert refresh.contradiction() == "" and refresh.step() == cost_refresh.WATCH_EVERY_S
    for _ in range(100):  # 9-token passes now cost 3x what the cache says; decode steps as before
        live.observe(1, 1, live.seconds[(1, 1)])
        live.observe(1, 9, 3 * refresh.reference.seconds[(1, 9)])
    why = refresh.contradiction()
    assert why.startswith("1 x 9 tokens"), why
    lines = []
    refresh.log = lines.append
    refresh.step()  # (made-up passes take no time: the whole grid may fit one slice)
    assert "live passes contradict the cached one" in lines[0]
    _run(refresh)
    assert refresh.measurements == 2 and refresh.contradiction() == ""  # calibration starts afresh
    for _ in range(100):
        live.observe(1, 1, live.seconds[(1, 1)])
        live.observe(1, 9, 3 * refresh.reference.seconds[(1, 9)])
    assert refresh.contradiction() and refresh.step() == cost_refresh.WATCH_EVERY_S  # not again within the period
    assert refresh.state == "watching"


class _Recorder:
    """Idle work that records whether the scheduler had a sequence running or prefilling when it was called
    (those only the scheduler's own thread changes; a request queued by another thread during a slice is the
    designed case: it waits for that slice)."""

    def __init__(self, scheduler_ref, slices: int):
        self.ref, self.left, self.busy_calls, self.calls = scheduler_ref, slices, 0, 0

    def __call__(self):
        s = self.ref[0]
        self.calls += 1
        if s.running or s.prefilling is not None:
            self.busy_calls += 1
        time.sleep(0.002)
        self.left -= 1
        return 0.0 if self.left > 0 else None


def test_scheduler_runs_idle_work_only_while_idle_and_serves_meanwhile(tiny):
    """A request submitted while idle work is pending is served, the output equal to a scheduler without idle
    work; the work is never called with a request queued or running, and ends when it says so."""
    from specloom import Engine
    from specloom.sampling import SamplingParams
    from specloom.scheduler import BatchScheduler, Sequence

    t = tiny("llama")
    engine = Engine(t.model, t.tokenizer, max_model_len=256)
    ids = t.tokenizer.encode("hello there")

    def serve(idle_work=None):
        ref = [None]
        work = idle_work(ref) if idle_work else None
        sched = BatchScheduler(engine, 2, "off", start=False, idle_work=work)
        ref[0] = sched
        runner = threading.Thread(target=sched.run, daemon=True)
        runner.start()
        time.sleep(0.05)  # idle work under way
        outs = []
        for _ in range(3):
            seq = Sequence(list(ids), 12, SamplingParams(temperature=0.0))
            sched.submit([seq])
            outs.append(seq.wait(60).token_ids)
            time.sleep(0.02)
        sched.close()
        runner.join(10)
        return outs, work

    plain, _ = serve()
    with_work, work = serve(lambda ref: _Recorder(ref, slices=400))
    assert with_work == plain
    assert work.calls > 10 and work.busy_calls == 0
    done, work = serve(lambda ref: _Recorder(ref, slices=3))
    assert work.calls == 3 and done == plain  # None ends it: never called again


def test_cost_curve_answers_from_its_points_after_every_change():
    """c(n, t) is remembered between changes of the points (the depth policy asks the same few every step);
    calibration, adoption and rescaling each give the new value at once."""
    from specloom.cost import BatchCost

    c = BatchCost({(1, 1): 1.0, (1, 4): 2.0, (2, 1): 1.5, (2, 4): 3.0})
    assert c(1, 2) == pytest.approx(4 / 3)
    c.observe(1, 4, 4.0)  # a 4-token pass measured slower: the curve rises there
    assert c(1, 4) > 2.0 and c(1, 2) > 4 / 3
    c.adopt(BatchCost({(1, 1): 1.0, (1, 4): 1.0}))
    assert c(1, 2) == pytest.approx(1.0)
    c.rescale(2.0)
    assert c(1, 4) == pytest.approx(1.0) and c.base == pytest.approx(2.0)
