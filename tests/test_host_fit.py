"""Fitting speculation to the host (issue 13, items 8 and 9): the host's capability in reports, the linear kernel
chosen from a measured probe (numerics-preserving kernels only by default, a row split only between bit-identical
kernels), the draft depth chosen from the host's verify-cost curve and the request's acceptance for both host
kinds (cheap verification -> deep; verification costing ~n decode steps -> plain or depth 1), outputs unchanged
whatever is chosen, and `generate --compare-plain`."""

import json

import pytest
import torch
from torch import nn

from specloom import Engine, SpecloomError
from specloom.host import kernel_choice as kernel_probe
from specloom.host.kernel_choice import choose_kernels, kernel_choice
from specloom.host import host_info, host_key, host_line
from specloom.models import cpu_packing
from specloom.cost import BatchCost
from specloom.depth import DepthPolicy, geometric_tokens, tau_to_alpha
from specloom.drafters.checkpoint import drafter_prior_tau
from specloom.speculative import SpeculativeConfig

TOKENS = (1, 2, 3, 5, 9, 17)
# one-row verify-cost curves c(1, T) in decode steps: a oneDNN-bf16 host (9 tokens ~ 1.2 steps) and an AVX2-only
# host (measured there: v(5) = 3.3, v(16) = 8.1)
CHEAP = {1: 1.0, 2: 1.02, 3: 1.04, 5: 1.08, 9: 1.2, 17: 1.5}
AVX2 = {1: 1.0, 2: 1.6, 3: 2.1, 5: 3.3, 9: 5.3, 17: 8.6}
LINEAR_IN_N = {t: float(t) for t in TOKENS}


def curve(c: dict) -> BatchCost:
    # a 20 ms decode step; frozen: the tiny test models' real pass times do not recalibrate it
    return BatchCost({(1, t): 0.02 * v for t, v in c.items()}, frozen=True)


@pytest.fixture
def onednn(monkeypatch):
    """Force this host's kind: onednn(True) = oneDNN runs bf16, onednn(False) = an AVX2-only host."""
    def force(supported: bool):
        monkeypatch.setattr(cpu_packing, "onednn_bf16_supported", lambda: supported)
    return force


# -- the host in reports ----------------------------------------------------------------------------------------

def test_host_info_line_and_key(onednn):
    info = host_info()
    for k in ("cpu", "cpu_flags", "isa", "mkldnn_bf16", "threads", "torch", "kind"):
        assert k in info, k
    assert info["threads"] == torch.get_num_threads() and info["torch"] == torch.__version__
    assert info["kind"] == ("bf16" if info["mkldnn_bf16"] else "no-bf16")
    line = host_line(info)
    assert line.startswith("host: ") and info["cpu"] in line and "oneDNN bf16" in line and "threads" in line
    key = host_key()
    assert len(key) == 12 and key == host_key()
    onednn(not info["mkldnn_bf16"])  # the other kind of host: another key, so no cache is shared
    assert host_key() != key and host_info()["kind"] != info["kind"]


# -- the linear kernel ------------------------------------------------------------------------------------------

def _probe(ms: dict, invariant: dict, quiet: bool = True) -> dict:
    """A whole-pass probe: ms per kernel for 1 and 9 tokens (4 and 16 interpolated)."""
    return {"version": kernel_probe.PROBE_VERSION, "widths": [1, 4, 9, 16], "quiet": quiet, "spread": 0.05,
            "ms": {k: {"1": a, "4": (a + b) / 2, "9": b, "16": 2 * b} for k, (a, b) in ms.items()},
            "invariant": invariant}


def test_kernel_choice_on_a_bf16_host(onednn):
    onednn(True)
    p = _probe({"onednn": (16, 17), "native": (27, 27), "fp32": (27, 74), "int8": (9, 37)},
               {"onednn": True, "native": True, "fp32": False, "int8": False})
    c = choose_kernels(p, torch.bfloat16)
    assert (c.single, c.multi, c.tag) == ("onednn", "onednn", "onednn") and not c.changes_numerics and c.invariant
    # int8 is faster for one token but changes the target: reported, never chosen
    assert any(n.startswith("int8 would be faster") and "--linear-kernel int8" in n for n in c.notes)
    assert any(n.startswith("fp32 does not win") for n in c.notes)
    assert "onednn 16.0/16.5/17.0/34.0" in c.describe()


def test_kernel_choice_by_whole_steps_not_one_row(onednn):
    """Issue 35: the micro-probe picked `invariant` for being fastest at one row, where onednn's 9-token pass
    cost 20 ms against 49: with a drafter the whole-pass figures choose onednn; plain decoding the faster step."""
    onednn(True)
    p = _probe({"onednn": (22.7, 25.0), "invariant": (21.1, 48.8), "native": (30, 60)},
               {"onednn": True, "invariant": True, "native": False})
    assert choose_kernels(p, torch.bfloat16, drafting=kernel_probe.Drafting(tau=1.9)).single == "onednn"
    assert choose_kernels(p, torch.bfloat16).single == "invariant"  # plain decoding: the faster decode step
    # a drafter that does not pay at all (tau 1.0) leaves the choice to plain decoding
    assert choose_kernels(p, torch.bfloat16, drafting=kernel_probe.Drafting(tau=1.0)).single == "invariant"


def test_batch_invariant_kernel_preferred_within_the_slack(onednn):
    onednn(True)
    inv = {"onednn": True, "native": False}
    c = choose_kernels(_probe({"onednn": (20.4, 21), "native": (20.0, 21)}, inv), torch.bfloat16)
    assert c.single == "onednn" and c.invariant and "batch-invariant" in c.reason  # 2 % behind: invariant wins
    c = choose_kernels(_probe({"onednn": (24.0, 25), "native": (20.0, 21)}, inv), torch.bfloat16)
    assert c.single == "native" and c.invariant is False  # 20 % behind: speed wins, and the choice says so
    assert any("--linear-kernel onednn" in n and "bit for bit" in n for n in c.notes), c.notes
    c = choose_kernels(_probe({"onednn": (24.0, 25), "native": (20.0, 21)}, {}), torch.bfloat16)
    assert any("no kernel is batch-invariant" in n for n in c.notes)
    noisy = choose_kernels(_probe({"onednn": (20, 21), "native": (24, 25)}, inv, quiet=False), torch.bfloat16)
    assert any("busy host" in n for n in noisy.notes)


def test_kernel_choice_on_an_avx2_host(onednn):
    onednn(False)  # no oneDNN bf16: native bf16 costs ~n for n rows, fp32 is memory-bound
    p = _probe({"native": (34, 300.0), "fp32": (36, 45.0), "int8": (50, 400.0)},
               {"native": False, "fp32": False, "int8": False})
    c = choose_kernels(p, torch.bfloat16, drafting=kernel_probe.Drafting())
    assert (c.single, c.multi) == ("native", "native") and c.invariant is False
    assert any(n.startswith("fp32 would be faster") and "numerics" in n for n in c.notes), c.notes


def test_row_split_runs_two_kernels():
    # a row split runs the single-row kernel for one row and the other for more
    lin = nn.Linear(8, 4).bfloat16()
    calls = []

    class Spy(nn.Module):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def forward(self, x):
            calls.append(self.name)
            return lin(x)

    split = cpu_packing.RowSplitLinear(lin, Spy("single"), Spy("multi"))
    split(torch.randn(1, 1, 8).bfloat16())
    split(torch.randn(1, 5, 8).bfloat16())
    split(torch.randn(3, 1, 8).bfloat16())
    assert calls == ["single", "multi", "multi"]


def test_kernels_compute_the_product():
    torch.manual_seed(0)
    lin = nn.Linear(64, 48).bfloat16()
    x = torch.randn(2, 5, 64).bfloat16()
    ref = x.float() @ lin.weight.float().T + lin.bias.float()
    f32 = cpu_packing.Fp32Linear(lin)(x)
    assert f32.dtype == torch.bfloat16 and f32.shape == (2, 5, 48)
    assert torch.allclose(f32.float(), ref, atol=2e-2, rtol=2e-2)
    if cpu_packing.int8_supported():
        q = cpu_packing.Int8Linear(lin)
        y = q(x)
        assert y.shape == (2, 5, 48) and q.qweight.dtype == torch.int8 and q.weight is lin.weight
        assert (y.float() - ref).abs().max() < 0.05 * ref.abs().max()
    assert cpu_packing.build_kernel("native", lin) is lin
    assert not cpu_packing.kernel_available("fp32", torch.float32, "cpu")  # fp32 on fp32 weights is native
    assert cpu_packing.changes_numerics("int8", torch.float32) and not cpu_packing.changes_numerics("fp32", torch.float32)


def _small_bf16_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64), nn.Linear(128, 64)).bfloat16()


def test_forced_kernels_and_errors():
    m = _small_bf16_model()
    c = kernel_choice(m, "fp32", "cpu")
    assert (c.single, c.multi) == ("fp32", "fp32") and c.changes_numerics and "numerics" in c.reason
    assert kernel_choice(m, "native", "cpu").changes_numerics is False
    with pytest.raises(SpecloomError, match="unknown linear kernel"):
        kernel_choice(m, "fp8", "cpu")
    assert kernel_choice(m.float(), "auto", "cpu").tag == "native"  # fp32: the only exact kernel, no probe
    c = kernel_choice(m, "auto", "meta")
    assert c.tag == "native" and c.probe is None  # not a CPU: nothing to probe


def _count_probes(monkeypatch) -> list:
    """The widths of every kernel probe run from now on (None: a full probe)."""
    calls, real = [], kernel_probe.probe_kernels
    monkeypatch.setattr(kernel_probe, "probe_kernels", lambda *a, **k: calls.append(k.get("widths")) or real(*a, **k))
    return calls


def _tiny_bf16_target():
    from specloom.config import ModelConfig
    from specloom.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = ModelConfig.from_hf({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                               "vocab_size": 128, "max_position_embeddings": 512})
    m = LlamaForCausalLM(cfg)
    for p in m.parameters():
        nn.init.normal_(p, std=0.1)
    return m.bfloat16().eval()


def test_a_provisional_kernel_choice_is_timed_again_only_on_a_quiet_host(tmp_path, monkeypatch):
    """A probe timed beside other work is cached as provisional. A load on a host still busy uses it (timing again
    would give another provisional choice and cost every load ~25 s on SmolLM2); a load on a quiet host times it
    again."""
    from specloom.host import contention

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(kernel_probe, "BUSY_LOOK_S", 0.0)
    monkeypatch.setattr(contention, "MIN_WALL_S", 0.0)
    monkeypatch.setattr(contention, "BUSY_SHARE", 0.2)
    share = {"now": 0.6}
    monkeypatch.setattr(contention.Contention, "others", lambda self: share["now"])
    m = _tiny_bf16_target()
    calls = _count_probes(monkeypatch)
    lines = []
    first = kernel_choice(m, "auto", "cpu", log=lines.append)
    (path,) = (tmp_path / "specloom" / "host").glob("kernels-*.json")
    assert json.loads(path.read_text())["quiet"] is False and "provisional" in lines[-1], lines
    calls.clear()
    lines.clear()
    again = kernel_choice(m, "auto", "cpu", log=lines.append)  # still busy: the provisional choice, no timing
    assert calls == [] and again.single == first.single and "still busy" in lines[-1], lines
    share["now"] = 0.0  # quiet: timed again, and cached as this host's own
    kernel_choice(m, "auto", "cpu")
    assert calls == [None] and json.loads(path.read_text())["quiet"] in (True, False)
    assert "others" not in json.loads(path.read_text())


def test_probe_times_whole_passes_is_cached_and_heals(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    m = _tiny_bf16_target()
    calls = _count_probes(monkeypatch)
    c = kernel_choice(m, "auto", "cpu")
    files = list((tmp_path / "specloom" / "host").glob("kernels-*.json"))
    assert len(files) == 1 and host_key() in files[0].name
    saved = json.loads(files[0].read_text())
    assert set(saved["ms"]) == set(kernel_probe.candidates(torch.bfloat16, "cpu"))
    assert saved["widths"] == list(kernel_probe.WIDTHS) and all(v["1"] > 0 for v in saved["ms"].values())
    assert set(saved["invariant"]) == set(saved["ms"]) and c.single in kernel_probe.exact_candidates(torch.bfloat16, "cpu")
    assert all(type(x) is nn.Linear for x in m.modules() if hasattr(x, "in_features"))  # the probe put them back
    quiet = saved["quiet"]
    calls.clear()
    kernel_choice(m, "auto", "cpu")
    # a quiet cached probe is only checked against a live decode step; a busy one is measured again
    assert calls == ([(1,)] if quiet else [None]), calls
    # a cached decode step far slower than the live one was taken under load: measured again
    for v in saved["ms"].values():
        v["1"] *= 100
    saved["quiet"] = True
    files[0].write_text(json.dumps(saved))
    calls.clear()
    kernel_choice(m, "auto", "cpu")
    assert calls == [(1,), None], calls
    # a corrupt cache is measured again, not a traceback
    files[0].write_text("{not json")
    calls.clear()
    lines = []
    kernel_choice(m, "auto", "cpu", log=lines.append)
    assert calls and calls[-1] is None
    assert any("kernel probe cache" in x and "unreadable: measuring again" in x for x in lines), lines
    json.loads(files[0].read_text())  # rewritten whole


def test_forced_kernel_reports_batch_invariance():
    m = _tiny_bf16_target()
    c = kernel_choice(m, "native", "cpu")
    assert c.invariant in (True, False)
    from specloom.models import invariant_linear

    if invariant_linear.available():
        assert kernel_choice(m, "invariant", "cpu").invariant is True


class _WidthDependent(nn.Module):
    """A kernel whose accumulation depends on the pass width, as oneDNN's bf16 matmul on an AVX512-BF16 host
    without AMX: a multi-row pass sums in float64, a row alone in fp32 -- the same product, parting in the last
    bf16 bit of only a few outputs in a thousand."""

    def __init__(self, linear, bad: bool):
        super().__init__()
        self.w, self.bad = linear.weight.detach().float(), bad

    def forward(self, x):
        if x.shape[0] == 1 or not self.bad:
            return torch.cat([(r.float() @ self.w.T).to(x.dtype) for r in x.split(1)])  # row by row: invariant
        return (x.double() @ self.w.double().T).to(x.dtype)


def test_batch_invariance_check_catches_rare_last_bit_differences(monkeypatch):
    """The kernel probe's invariance check compares every row of several pass widths: a kernel whose rounding
    depends on the row count in a few outputs in a thousand is caught, for plain linears and for linears held as
    GGUF blocks (checked on their dense copies), while an invariant kernel passes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1536, 576, bias=False)).bfloat16()
    monkeypatch.setattr(cpu_packing, "build_kernel", lambda name, lin: _WidthDependent(lin, name == "bad"))
    assert kernel_probe.batch_invariant(model, "bad") is False
    assert kernel_probe.batch_invariant(model, "good") is True
    from specloom.models import ggml_linear

    if not ggml_linear.available():
        return
    held = ggml_linear.GGMLLinear([(ggml_linear.quantize_q8_0(model[0].weight.float()),
                                    ggml_linear.KERNEL_TYPES["Q8_0"])], 1536, torch.bfloat16)
    assert kernel_probe.batch_invariant(nn.Sequential(held), "bad") is False
    assert kernel_probe.batch_invariant(nn.Sequential(held), "ggml") is True


# -- the depth -------------------------------------------------------------------------------------------------

# a host whose verification rows cost what they cost on an AVX512-BF16 EPYC without AMX (measured: v(5) = 1.57)
STEEP = {1: 1.0, 2: 1.06, 3: 1.22, 5: 1.57, 9: 2.4, 17: 4.1}


def test_tree_shape_table_keeps_the_tuned_tree_on_its_host_and_shrinks_it_where_rows_cost_more():
    """The EAGLE shape table scores every shape as the chooser does, tau / (v(nodes + 1) + c0 + c1 x passes): a
    curve like the one the tree was tuned on keeps it; where each verification row costs more, a smaller shape
    predicting more wins; a shape that only ties does not replace the tuned one."""
    from specloom.drafters.eagle.drafter import ShapeTable

    shapes = [(2, 4, 4, 2.0, 1.0), (1, 1, 1, 1.5, 0.0), (1, 4, 4, 1.7, 0.0), (3, 4, 8, 2.3, 2.0)]
    table = ShapeTable(shapes, 0.19, {1: 0.12, 4: 0.14}, (2, 4, 4))
    assert table.tau_now == 2.0
    assert table.best(curve(CHEAP)) is None  # 2.0 / (1.08 + 0.33) = 1.42 beats 1.5 / 1.21 = 1.24
    assert table.best(curve(STEEP)) == (1, 1, 1, 1.5)  # 1.5 / 1.25 = 1.20 against 2.0 / 1.90 = 1.05
    tie = ShapeTable([(2, 4, 4, 2.0, 1.0), (1, 1, 1, 1.43, 0.0)], 0.19, {1: 0.12, 4: 0.14}, (2, 4, 4))
    assert tie.best(curve(CHEAP)) is None  # 1.43 / 1.21 = 1.18 < 1.42
    # among shapes within 2 % of the best, the cheapest: against the depth-1 chain's 1.5 / 1.25 = 1.20, a
    # depth-2 two-node chain (v(3) 1.22 + 0.19 + 0.12 x 1 pass) leading by 2.5 % is taken, one leading by 1 % not
    lead = ShapeTable(shapes + [(2, 1, 2, 1.882, 1.0)], 0.19, {1: 0.12, 4: 0.14}, (2, 4, 4))
    assert lead.best(curve(STEEP)) == (2, 1, 2, 1.882)
    near = ShapeTable(shapes + [(2, 1, 2, 1.854, 1.0)], 0.19, {1: 0.12, 4: 0.14}, (2, 4, 4))
    assert near.best(curve(STEEP)) == (1, 1, 1, 1.5)


def test_auto_refits_the_bundled_eagle3_tree_to_the_host_curve_and_stays_exact():
    """`auto` on a host whose rows cost more re-chooses the bundled EAGLE-3's tree from its shape table (the
    suffix hybrid follows, with a prior scaled to the new shape), output still plain decoding's; a request that
    sets a shape, or `fixed` speculation, keeps its tree."""
    from specloom.loading import load_target, resolve

    try:
        resolve("smollm2-135m")
    except SpecloomError:
        pytest.skip("smollm2-135m not installed")
    model, tok = load_target("smollm2-135m", "fp32", progress=False)
    plain = Engine(model, tok)
    spec = SpeculativeConfig.parse({"method": "eagle3", "suffix_decoding": True})
    eng = Engine(model, tok, spec, speculation="auto", cost=curve(STEEP))
    before = (eng.drafter.inner.depth, eng.drafter.inner.width, eng.drafter.inner.num_nodes)
    tau0 = eng.prior_tau()
    assert eng.depth_policy() is not None
    inner = eng.drafter.inner
    after = (inner.depth, inner.width, inner.num_nodes)
    assert after != before and after[2] < before[2] and eng.drafter.num_nodes == inner.num_nodes
    assert eng.prior_tau() < tau0
    p = "List three prime numbers and explain why they are prime."
    a, b = plain.generate(p, chat=True, max_tokens=40), eng.generate(p, chat=True, max_tokens=40)
    assert b.token_ids == a.token_ids
    mine = Engine(model, tok, SpeculativeConfig.parse({"method": "eagle3", "num_speculative_tokens": 2,
                                                       "tree_width": 4, "num_draft_tokens": 4}),
                  speculation="auto", cost=curve(STEEP))
    mine.depth_policy()
    assert (mine.drafter.depth, mine.drafter.width, mine.drafter.num_nodes) == (2, 4, 4)
    fixed = Engine(model, tok, SpeculativeConfig.parse({"method": "eagle3"}), speculation="fixed")
    fixed.depth_policy()
    assert (fixed.drafter.depth, fixed.drafter.width) == before[:2]


def test_depth_from_the_host_curve_for_both_host_kinds():
    # a chain drafter (n-gram, depth 6): deep on the bf16 host, plain or depth 1 where verifying costs ~n
    fast = DepthPolicy("auto", 6, curve(CHEAP))
    assert fast.mode == "load_aware" and fast.choose([0.7], [6]) == [6]
    assert fast.expected_speedup(0.7, 6) > 2.0 and fast.pays_alone(0.5, 6)
    slow = DepthPolicy("auto", 6, curve(AVX2))
    assert slow.choose([0.5], [6]) == [0] and not slow.pays_alone(0.5, 6)
    assert slow.choose([0.7], [6]) in ([0], [1])
    assert 1 <= slow.choose([0.9], [6])[0] <= 2  # very good drafts: a shallow chain still pays there
    assert DepthPolicy("auto", 6, curve(LINEAR_IN_N)).choose([0.9], [6]) == [0]  # cost exactly n: never pays
    # a tree drafter (EAGLE-3 shape: 6 deep, 24 nodes): trees are cheap on the bf16 host, not on the AVX2 host
    tree = dict(nodes_per_depth=4.0, full_nodes=24)
    assert DepthPolicy("auto", 6, curve(CHEAP), **tree).choose([0.7], [6])[0] >= 3
    assert DepthPolicy("auto", 6, curve(AVX2), **tree).choose([0.5], [6]) == [0]
    # drafting cost counts: an expensive drafter goes shallower or off
    fast.draft_cost = 0.5
    assert fast.choose([0.7], [6])[0] < 6
    # the fixed and off modes ignore the curve
    assert DepthPolicy("fixed", 6).choose([0.0], [3]) == [3] and DepthPolicy("off", 6).choose([1.0], [6]) == [0]


class _Ctx:
    k, max_nodes, state = 0, None, None


class _Row:
    def __init__(self, pol: DepthPolicy):
        self.drafting, self.ctx, self.acc = True, _Ctx(), pol.new_acceptance()

    def stop_drafting(self):
        self.drafting, self.ctx.state = False, None


def _run_policy(pol: DepthPolicy, report, steps: int, max_k: int) -> tuple[list[int], _Row]:
    """Drive one fake row through the policy (plan, step, observe) for up to `steps` steps (until it stops
    drafting); `report(k, i)` gives the StepReport of step i drafted `k` deep. Returns the depth chosen per step and the row."""
    row, ks = _Row(pol), []

    class Stepper:
        drafter = None

        def step(self, rows, plan):
            return report(plan.depths[0], len(ks))

    for _ in range(steps):
        if not row.drafting:
            break
        stepper = Stepper()
        plan = pol.plan(stepper, [row], [max_k])
        pol.observe([row], plan, stepper.step([row], plan))
        ks.append(plan.depths[0])
    return ks, row


def test_unlucky_first_steps_do_not_stop_a_drafter_that_pays():
    """A tree drafter whose prior pays on a cheap-verification host: its first two steps accept nothing (alpha
    0.5 -> 0.2 by the row's own counts). It keeps drafting through its trial steps (at the prior, or at its own drafts' upper bound where
    lower); when its drafts
    then pay it stays on; and the next request starts drafting too (the running average that the unlucky row
    pulled down does not stop it). A drafter that keeps failing stops before its trial ends."""
    from specloom.step import StepReport
    from specloom.tree import DraftTree

    pol = DepthPolicy("auto", 2, curve(CHEAP), prior_alpha=0.5, nodes_per_depth=5.0, full_nodes=10)

    def run(accepts, steps):
        def report(k, i):
            # the bundled EAGLE-3's shape: 10 drafted nodes, 2 deep (4 at depth 1 when the policy asks for 1)
            parents = [[-1], [-1, 0, 0, 0, 0], [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3]][k]
            tree = DraftTree(list(range(1, len(parents) + 1)), parents)
            # drafting costs 0.125 of a decode step per depth (the bundled EAGLE-3's measured share)
            return StepReport(1, len(tree), 0.02, 0.0025 * k, [tree], [min(accepts(i), k)])

        return _run_policy(pol, report, steps, 2)

    ks, row = run(lambda i: 0 if i < 2 else 2, 30)  # two unlucky steps, then every draft accepted
    assert all(k > 0 for k in ks) and row.drafting, ks
    ks, _ = run(lambda i: 2, 5)  # the next request drafts from its first step
    assert ks[0] > 0, ks
    # nothing ever accepted: it stops drafting before the trial's end, once its own drafts (0 of 5) rule out
    # what would pay, and is turned off after `patience` idle steps
    ks, row = run(lambda i: 0, 30)
    drafted = [k for k in ks if k > 0]
    assert ks[:len(drafted)] == drafted and 3 <= len(drafted) < pol.trial and ks.count(0) == pol.patience, ks
    assert not row.drafting


def test_a_drafters_catch_up_is_not_priced_as_drafting():
    """A draft model catches up lazily: its first drafted step feeds the whole prompt (measured on the Qwen pair:
    2.0 target steps per depth where steady drafting costs 0.48), and so does its first step after a pause. Only
    steps without such a backlog price drafting; with them counted, the median of the first few steps said 1.25
    per depth and the policy turned a drafter that pays 1.1x off for every later request."""
    from specloom.step import StepReport
    from specloom.tree import DraftTree

    # the Qwen 1.5B invariant-kernel curve; drafting 0.5 of a decode step per depth when caught up
    qwen = {1: 1.0, 2: 1.25, 3: 1.47, 5: 1.81, 9: 2.36, 17: 3.65}
    pol = DepthPolicy("auto", 3, curve(qwen), prior_alpha=0.5)
    state = {"last": 0}

    def report(k, i):
        tree = DraftTree(list(range(1, k + 2)), list(range(-1, k)))
        backlog = k > 0 and state["last"] == 0  # the first drafted step, or the first after a pause
        state["last"] = k
        per_depth = 0.02 * (2.5 if backlog else 0.5)
        return StepReport(1, len(tree), 0.02 * pol.cost(1, len(tree)), per_depth * k, [tree], [k])  # seconds

    for request, steps in enumerate((2, 20, 20)):  # a short warm-up request (as `--compare-plain` runs), then two
        state["last"] = 0
        ks, row = _run_policy(pol, report, steps, 3)
        assert row.drafting and all(k > 0 for k in ks), (request, ks)
    assert pol.draft_cost == pytest.approx(0.5, rel=0.05)
    # a paused row's first step back carries the backlog too: not priced
    before = pol.draft_cost
    row = _Row(pol)
    row.acc.caught_up = False
    state["last"] = 0

    class Stepper:
        drafter = None

        def step(self, rows, plan):
            return report(plan.depths[0], 0)

    stepper = Stepper()
    plan = pol.plan(stepper, [row], [3])
    pol.observe([row], plan, stepper.step([row], plan))
    assert pol.draft_cost == before


def test_evidence_that_stops_drafting_is_forgotten_after_a_quiet_stretch():
    """Drafting's cost and the optimism of the policy's predictions are renewed only by drafted steps. A stretch
    measured while other work loaded the host (drafting at 3 decode steps per depth; predictions that ran 1.5x
    high) vetoes every depth even at acceptance 1, so no later request drafted, not even a probe, and the evidence
    stood for the engine's life (seen: the README default at tau 1.00 for 25 requests in a row). After
    `forget_after` steps without a measured drafted step the policy starts over; once the host is quiet the next
    request drafts throughout at the cost it now measures. Not earlier: the quiet stretch is counted in full."""
    from specloom.step import StepReport
    from specloom.tree import DraftTree

    pol = DepthPolicy("auto", 2, curve(CHEAP), prior_alpha=0.7, idle_free=True)  # EAGLE-like: idle steps free
    pol.forget_after = 64
    per_depth = {"busy": 3.0}

    def report(k, i):
        tree = DraftTree(list(range(1, k + 2)), list(range(-1, k)))
        return StepReport(1, len(tree), 0.02 * pol.cost(1, len(tree)), 0.02 * per_depth["busy"] * k, [tree], [k])

    ks, row = _run_policy(pol, report, 30, 2)  # the busy stretch: measured, then no depth pays
    assert ks[0] > 0 and not row.drafting and pol.draft_cost == pytest.approx(3.0), ks
    assert not pol.pays_alone(1.0, 2)
    pol._drafted = [48.0, 32.0, 32.0, 32.0]  # the predictions ran high too (1.5x)
    assert pol.optimism() == pytest.approx(1.5)
    per_depth["busy"] = 0.1  # the host is quiet again
    quiet, runs = 0, []
    while len(runs) < 40:
        ks, row = _run_policy(pol, report, 30, 2)
        runs.append(ks)
        if any(ks):
            break
        quiet += len(ks)
    assert any(runs[-1]), "no request drafted again after the busy stretch"
    assert pol.forget_after - 9 <= quiet <= pol.forget_after, quiet  # forgotten after the quiet stretch, not before
    ks, row = _run_policy(pol, report, 30, 2)  # the next request: drafts every step at the new cost
    assert row.drafting and all(k > 0 for k in ks) and pol.draft_cost == pytest.approx(0.1), ks
    assert pol.optimism() == 1.0


def test_a_drafted_step_is_judged_at_the_width_the_plan_priced():
    """A hybrid's depth-1 step that verifies its suffix tree 8 deep: priced as a 2-token pass, run as a 9-token
    one. Its cost is checked against the price (not against the pass it ran), so its extra tokens and its extra
    cost are weighed together in `optimism`: tokens that pay for the wider pass leave it at 1, tokens that do not
    raise it."""
    from specloom.depth import PolicyPlan
    from specloom.step import StepReport
    from specloom.tree import DraftTree

    verify = {1: 1.0, 2: 1.15, 3: 1.3, 5: 1.6, 9: 2.5, 17: 4.2}

    def run(accepted):
        live = BatchCost({(1, t): 0.02 * v for t, v in verify.items()})  # measured, as Engine.generate's
        pol = DepthPolicy("auto", 1, live, prior_alpha=0.5, idle_free=True, calibrate=False)
        row = _Row(pol)
        for _ in range(40):
            plan = PolicyPlan([1], None, [0.5], set(), set(), False)
            assert plan.width == 1  # (the policy's own plans say; this one is made by hand:)
            plan.width = pol.nodes(1)
            tree = DraftTree(list(range(1, 10)), list(range(-1, 8)))  # 8 deep: a 9-token pass
            pol.observe([row], plan, StepReport(1, 9, 0.02 * pol.cost(1, 9), 0.0, [tree], [accepted]))
        return pol.optimism()

    assert run(6) == 1.0  # 7 tokens for 2.5 decode steps where 1.5 were expected of 1.15: ahead of the price
    assert run(1) == pytest.approx(1.5)  # 2 tokens for 2.5 steps: 1.5 / 2 x 2.5 / 1.15 = 1.63, at its cap


def test_a_streak_of_rejections_does_not_idle_a_row_whose_drafts_pay_as_a_whole():
    """After its trial a row is judged at no less than the upper bound (z = 1) of all its own drafts: a row
    that accepted 12 of 30 single drafts (0.4, break-even here 0.3) keeps drafting through 5 rejections in a
    row; one that accepted 2 of 30 idles at once, and so does the first without the bound."""
    verify = {1: 1.0, 2: 1.3, 3: 1.6, 5: 2.2, 9: 3.4, 17: 5.8}
    pol = DepthPolicy("auto", 1, curve(verify), prior_alpha=0.4, idle_free=True)
    good, bad = pol.new_acceptance(), pol.new_acceptance()
    for i in range(30):
        good.update(1, 1 if i % 5 in (0, 2) else 0)
        bad.update(1, 1 if i in (3, 17) else 0)
    for _ in range(5):
        good.update(1, 0)
    assert good.alpha < 0.3 < pol.alpha(good) and pol.choose([pol.alpha(good)], [1]) == [1]
    assert pol.choose([pol.alpha(bad)], [1]) == [0]
    pol.lifetime_z = 0.0
    assert pol.choose([pol.alpha(good)], [1]) == [0]


def test_plain_fallback_probes_a_cheap_drafter_and_turns_a_costly_one_off():
    """Where no depth pays (verification ~n steps), an n-gram-like drafter is probed at depth 1 after 8 idle
    steps, again at every step while the probe finds no draft (that cost nothing), then after 8 again (the
    period's cap, `explore_max`); a drafter that updates state every step is turned off after `patience` idle
    steps."""
    from specloom.step import StepReport
    from specloom.tree import DraftTree

    def run(cheap, has_draft, steps):
        def report(k, i):
            tree = DraftTree([1, 2], [-1, 0]) if k and has_draft(i) else DraftTree([1], [-1])
            return StepReport(1, len(tree), 0.02 * len(tree), 0.0, [tree], [0])

        return _run_policy(DepthPolicy("auto", 4, curve(LINEAR_IN_N), cheap=cheap), report, steps, 4)

    ks, row = run(True, lambda i: i >= 10, 40)  # no draft at the first probes (steps 7-9), one at step 10
    assert ks[:7] == [0] * 7 and ks[7:11] == [1] * 4 and ks[11:18] == [0] * 7 and ks[18] == 1, ks
    assert row.drafting
    ks, row = run(False, lambda i: True, 40)
    assert ks == [0] * 8 and not row.drafting and row.ctx.state is None, ks


def test_one_row_curve_is_measured_interleaved_and_monotone_in_rows(tiny):
    from specloom.cost import measure_batch_cost, monotone

    # more rows never cost less; a few tokens may really cost less than one (oneDNN bf16 on an AVX-512 EPYC:
    # c(1, 3) = 0.9): the tokens axis stays as measured
    noisy = {(1, 1): 1.0, (1, 2): 1.3, (1, 3): 0.7, (1, 5): 1.2, (2, 1): 0.9, (2, 2): 1.0, (2, 3): 2.0, (2, 5): 1.9}
    m = monotone(noisy)
    assert [m[(1, t)] for t in (1, 2, 3, 5)] == [1.0, 1.3, 0.7, 1.2]
    assert [m[(2, t)] for t in (1, 2, 3, 5)] == [1.0, 1.3, 2.0, 1.9]
    cost = measure_batch_cost(tiny("llama").model, 1, context=16, repeats=2)
    assert cost.rows == [1] and cost.tokens == list(TOKENS) and cost(1, 1) == 1.0
    assert cost(1, 33) >= cost(1, 17) and cost(2, 5) == pytest.approx(2 * cost(1, 5))  # one-row curve: linear in n


def test_tree_tuners_read_the_same_curve_mechanism(tiny, tmp_path, monkeypatch):
    """`verify_cost_curve` (the tree tuners' one-row curve, trees up to 64 nodes) is the serving grid's
    mechanism over other widths: measured once, cached beside it, read back equal; a corrupt file is measured
    again."""
    from specloom import cost as cost_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    first = cost_mod.verify_cost_curve(model)
    assert first.rows == [1] and first.tokens == list(cost_mod.TREE_SIZES) and first(1, 1) == 1.0
    (path,) = (tmp_path / "specloom" / "verify_cost").glob("tree2-*.json")
    monkeypatch.setattr(cost_mod, "measure_batch_cost", lambda *a, **k: pytest.fail("measured again"))
    assert cost_mod.verify_cost_curve(model).relative() == pytest.approx(first.relative())
    path.write_text("{not json")
    monkeypatch.undo()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cost_mod.verify_cost_curve(model)(1, 64) > 0 and path.read_text().startswith("{")


def test_cached_curve_is_anchored_to_the_machines_speed_now(tiny, tmp_path, monkeypatch):
    from specloom import cost as cost_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    first = cost_mod.batch_cost_cached(model, 1)
    assert list((tmp_path / "specloom" / "verify_cost").glob("batch2-*-r1-h*.json"))
    nine = first(1, 9)
    # the host is 10x slower now, the curve's shape unchanged
    three = first(1, 3)
    monkeypatch.setattr(cost_mod, "time_passes", lambda m, ts, repeats: {1: 10 * first.base, 3: 10 * first.base * three,
                                                                           9: 10 * first.base * nine})
    again = cost_mod.batch_cost_cached(model, 1)
    assert again.base == pytest.approx(10 * first.base)
    assert all(again(1, t) == pytest.approx(first(1, t)) for t in TOKENS)  # same shape
    before = dict(again.seconds)
    again.observe(1, 5, again.base * again(1, 5))  # a pass as predicted: nothing to calibrate
    assert again.seconds == pytest.approx(before)


def test_cached_curve_whose_shape_this_host_no_longer_shows_is_measured_again(tiny, tmp_path, monkeypatch):
    """A curve cached while other processes slowed the multi-token passes (so steep that no drafter could pay)
    is not trusted for ever: the read checks c(1, 9) against a fresh probe and measures again."""
    import json

    from specloom import cost as cost_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    cost_mod.batch_cost_cached(model, 1)
    path = next((tmp_path / "specloom" / "verify_cost").glob("batch2-*-r1-h*.json"))
    steep = {k: v * (1 if k == "1x1" else 8) for k, v in json.loads(path.read_text()).items()}
    path.write_text(json.dumps(steep))
    monkeypatch.setattr(cost_mod, "measure_batch_cost",
                        lambda m, rows, budget_s=None: cost_mod.BatchCost({(1, t): 1.0 + 0.01 * t for t in TOKENS}))
    monkeypatch.setattr(cost_mod, "time_passes", lambda m, ts, repeats: {1: 1.0, 3: 1.03 / 1.01, 9: 1.1})
    lines = []
    cost = cost_mod.batch_cost_cached(model, 1, log=lines.append)
    assert "disagrees with this host now" in lines[0] and "3-token pass" in lines[0], lines
    assert float(lines[0].split("pass: ")[1].split()[0]) > 7  # the steep cached figure, named
    assert cost(1, 9) == pytest.approx(1.09 / 1.01)  # the new measurement, and it replaced the cached file
    assert json.loads(path.read_text())["1x9"] == pytest.approx(1.09)
    lines.clear()
    cost_mod.batch_cost_cached(model, 1, log=lines.append)  # now it agrees: read
    assert lines == [f"verify cost curve read from {path}"]


def test_shape_check_judges_what_rows_cost_beyond_one_token():
    """A cached curve is re-measured when what a pass costs beyond one decode step moved: the curve this host
    cached beside a data generator (a 3-token pass at 1.15 decode steps, 1.31 quiet) was within the old 1.3 factor
    on the whole pass; noise between quiet looks (1.29-1.33) and near-free rows (a GPU's) are not judged."""
    from specloom.cost import shape_moved

    assert shape_moved(1.15, 1.31) and shape_moved(1.31, 1.15)
    assert shape_moved(8.0, 1.02) and shape_moved(1.5, 2.3)
    assert not shape_moved(1.29, 1.33) and not shape_moved(1.66, 1.76)
    assert not shape_moved(1.01, 1.05)  # 4x the excess, but 0.04 of a decode step: noise


def test_a_flattened_cached_curve_is_measured_again_unless_the_check_ran_beside_other_work(tiny, tmp_path,
                                                                                         monkeypatch):
    import json

    from specloom import cost as cost_mod
    from specloom.host import contention

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    cost_mod.batch_cost_cached(model, 1)
    path = next((tmp_path / "specloom" / "verify_cost").glob("batch2-*-r1-h*.json"))
    flat = {f"1x{t}": 1e-3 * (1.0 + 0.075 * (t - 1)) for t in TOKENS}  # 3 tokens: 1.15 decode steps
    quiet = cost_mod.BatchCost({(1, t): 1e-3 * (1.0 + 0.155 * (t - 1)) for t in TOKENS})  # 1.31
    probe = lambda m, ts, repeats: {t: quiet.base * quiet(1, t) for t in ts}  # noqa: E731
    monkeypatch.setattr(cost_mod, "time_passes", probe)
    # the check ran while other processes used 60 % of the CPUs: the cached curve (measured quiet) is kept
    path.write_text(json.dumps(flat))
    monkeypatch.setattr(contention, "BUSY_SHARE", 0.2)
    monkeypatch.setattr(contention.Contention, "others", lambda self: 0.6)
    monkeypatch.setattr(cost_mod, "measure_batch_cost", lambda *a, **k: pytest.fail("measured beside other work"))
    lines = []
    kept = cost_mod.batch_cost_cached(model, 1, log=lines.append)
    assert kept(1, 3) == pytest.approx(1.15) and "kept" in lines[-1], lines
    # quiet: the flattened curve is measured again and replaced
    monkeypatch.setattr(contention.Contention, "others", lambda self: 0.0)
    monkeypatch.setattr(cost_mod, "measure_batch_cost", lambda m, rows, budget_s=None: quiet)
    lines.clear()
    fresh = cost_mod.batch_cost_cached(model, 1, log=lines.append)
    assert "disagrees with this host now" in lines[0] and "3-token pass: 1.15" in lines[0], lines
    assert fresh(1, 3) == pytest.approx(1.31)
    assert json.loads(path.read_text())["1x3"] == pytest.approx(1.31e-3)


def test_prior_from_the_drafters_measured_tau():
    for k in (1, 4, 6):
        for a in (0.1, 0.4, 0.8):
            assert tau_to_alpha(geometric_tokens(a, k), k) == pytest.approx(a, abs=1e-6)
    assert tau_to_alpha(1.0, 4) == 0.0 and tau_to_alpha(9.0, 4) == 1.0

    class D:
        prior_tau = 1.6

    assert drafter_prior_tau(D()) == 1.6
    try:
        from specloom.loading import load_config, resolve

        cfg = load_config(resolve("smollm2-135m"))[0]
    except SpecloomError:
        pytest.skip("smollm2-135m not installed")
    class E:
        prior_tau = None
    tau = drafter_prior_tau(E(), SpeculativeConfig.parse({"method": "eagle3"}), cfg)
    assert tau is not None and 1.0 < tau < 3.0  # the bundled EAGLE-3's manifest figure
    assert drafter_prior_tau(E(), SpeculativeConfig.parse({"method": "ngram"}), cfg) is None


N = 24
REPEAT = [5, 6, 7, 8, 9] * 6  # n-gram drafts get accepted


def _engines(t, spec, cost):
    spec = SpeculativeConfig.parse(spec)
    return Engine(t.model, t.tokenizer, spec, speculation="auto", cost=cost), Engine(t.model, t.tokenizer)


@pytest.mark.parametrize("host", ["bf16", "avx2"])
def test_auto_speculation_is_exact_and_follows_the_host(tiny, host):
    """Auto depth on a forced cost curve: the bf16 host drafts deep (n-gram), the AVX2 host decodes plain (n-gram:
    a depth-1 probe now and then; draft_model, which updates its own KV every step, is turned off before its
    prefill); the output is plain decoding's whatever is chosen."""
    t = tiny("llama")
    c = CHEAP if host == "bf16" else LINEAR_IN_N
    plain = Engine(t.model, t.tokenizer)
    prompts = (REPEAT, [17, 99, 4, 250, 31])
    want = [plain.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids for ids in prompts]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4},
                 {"method": "draft_model", "model": t.path, "num_speculative_tokens": 4}):
        auto = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(spec), speculation="auto", cost=curve(c))
        for ids, ref in zip(prompts, want):
            got = auto.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
            assert got.token_ids == ref, (spec, ids)
            s = got.speculation
            assert s["mode"] == "auto" and s["steps"] == got.num_target_passes - 1
            if host == "bf16" and spec["method"] == "ngram":  # drafting costs ~nothing: deep
                assert s["mean_depth"] >= 2, (spec, s)
            if host == "avx2":
                assert s["drafted_steps"] <= 2, (spec, s)  # only probes (after 8, then 16 idle steps)
                if spec["method"] == "draft_model":
                    assert s["drafted_steps"] == 0 and not s["drafting_at_end"] and got.num_draft_tokens == 0


def test_fixed_and_off_modes(tiny):
    t = tiny("llama")
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    want = Engine(t.model, t.tokenizer).generate(prompt_token_ids=REPEAT, max_tokens=N, ignore_eos=True)
    fixed = Engine(t.model, t.tokenizer, spec).generate(prompt_token_ids=REPEAT, max_tokens=N, ignore_eos=True)
    off = Engine(t.model, t.tokenizer, spec, speculation="off").generate(prompt_token_ids=REPEAT, max_tokens=N,
                                                                          ignore_eos=True)
    assert fixed.token_ids == off.token_ids == want.token_ids
    assert fixed.speculation["mode"] == "fixed" and fixed.num_draft_tokens > 0
    assert off.num_draft_tokens == 0 and off.speculation["mode"] == "off"
    with pytest.raises(SpecloomError, match="speculation"):
        Engine(t.model, t.tokenizer, spec, speculation="sometimes")


# -- reports and the CLI ---------------------------------------------------------------------------------------

def test_bench_report_records_the_host(tiny, tmp_path):
    from specloom.bench.harness import run_bench

    t = tiny("llama")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(f"w{i}" for i in REPEAT)}) + "\n")
    r = run_bench(t.path, str(prompts), max_tokens=12, dtype="fp32", progress=False,
                  speculative_config={"method": "ngram"}, json_out=str(tmp_path / "out.json"))
    saved = json.loads((tmp_path / "out.json").read_text())
    for rep in (r, saved):
        assert rep["host"]["cpu_flags"] == host_info()["cpu_flags"] and "mkldnn_bf16" in rep["host"]
        assert rep["speculation"] == "auto" and rep["linear_kernel"]["tag"] == "native"
        assert rep["identical_outputs"] == 1


def test_generate_compare_plain(tiny, capsys):
    from test_cli import run_in_process

    t = tiny("llama")
    prompt = " ".join(f"w{i}" for i in REPEAT)
    args = ("generate", t.path, "--prompt", prompt, "--max-tokens", "24", "--dtype", "fp32",
            "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}', "--compare-plain")
    rc, out, err = run_in_process(capsys, *args)
    assert rc == 0, err
    assert "plain decoding, same prompt, same run" in err and "speed-up" in err and "tau" in err
    assert "prefill excluded, 2 rounds interleaved" in err and "host: " in err and "linear kernel" in err
    rc, out, err = run_in_process(capsys, *args, "--json", "--compare-rounds", "1")
    assert rc == 0, err
    d = json.loads(out)
    assert d["identical_to_plain"] and d["plain"]["token_ids"] == d["token_ids"] and len(d["token_ids"]) == 24
    assert d["speedup"] > 0 and d["decode_tokens_per_second"] > 0 and d["host"]["threads"] >= 1
    assert d["speculation"]["mode"] == "auto" and d["first_difference"] is None and d["rounds"] == 1


def test_curve_measurement_is_bounded_logged_and_cached(tiny, tmp_path, monkeypatch):
    """Start-up's verify-cost measurement says that it runs and where it is cached, stops its repeats at the time
    bound (one warm-up and one timed round always), and a second start reads the cache instead of measuring."""
    from specloom import cost as cost_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    calls = {"n": 0}
    real = type(model).forward

    def counting(self, *a, **kw):
        calls["n"] += 1
        return real(self, *a, **kw)

    monkeypatch.setattr(type(model), "forward", counting)
    monkeypatch.setattr(cost_mod, "busy_shape", lambda cost: "")  # a loaded host's noise would measure twice
    lines = []
    first = cost_mod.batch_cost_cached(model, 2, log=lines.append, budget_s=0.0)
    grid = 2 * len(TOKENS)  # rows 1 and 2
    assert calls["n"] == 2 + 2 * grid  # the rows' prefill, then warm-up + one timed round: the bound cut the rest
    path = next((tmp_path / "specloom" / "verify_cost").glob("batch2-*-r2-h*.json"))
    assert "measuring verify cost curve" in lines[0] and f"cached at {path}" in lines[0]
    assert "measured in" in lines[1]
    lines.clear()
    calls["n"] = 0
    probes = []  # the read's check of the cached shape, at the shape it cached (a tiny model's timings are noise)
    monkeypatch.setattr(cost_mod, "time_passes",
                        lambda m, ts, repeats: probes.append(ts) or {t: first.base * first(1, t) for t in ts})
    cost_mod.batch_cost_cached(model, 2, log=lines.append)
    assert lines == [f"verify cost curve read from {path}"] and calls["n"] == 0 and probes == [(1, 3, 9)]


def test_corrupt_verify_cost_cache_is_measured_again(tiny, tmp_path, monkeypatch):
    from specloom.cost import batch_cost_cached

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    lines = []
    first = batch_cost_cached(model, 1, log=lines.append, budget_s=1.0)
    files = list((tmp_path / "specloom" / "verify_cost").glob("*.json"))
    assert len(files) == 1
    for bad in ("{not json", '{"1x1": "fast"}', "[]"):
        files[0].write_text(bad)
        lines.clear()
        cost = batch_cost_cached(model, 1, log=lines.append, budget_s=1.0)
        assert any("unreadable: measuring it again" in m for m in lines), (bad, lines)
        assert set(cost.seconds) == set(first.seconds)
        json.loads(files[0].read_text())  # rewritten whole


def test_a_burst_of_other_work_does_not_remeasure_the_curve(tiny, tmp_path, monkeypatch):
    """The shape check looks twice before measuring again: a first probe slowed by a burst of other work (its
    multi-token passes 1.6 decode steps where the curve says ~1) is overruled by the fastest of both looks."""
    from specloom import cost as cost_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    first = cost_mod.batch_cost_cached(model, 1)
    calm = {1: first.base, 3: first.base * first(1, 3), 9: first.base * first(1, 9)}
    looks = [{1: calm[1], 3: 1.6 * calm[3] * 1.5, 9: 1.6 * calm[9] * 1.5}, calm]
    monkeypatch.setattr(cost_mod, "time_passes", lambda m, ts, repeats: looks.pop(0))
    monkeypatch.setattr(cost_mod, "measure_batch_cost", lambda *a, **k: pytest.fail("measured again"))
    lines = []
    again = cost_mod.batch_cost_cached(model, 1, log=lines.append)
    assert not looks and "read from" in lines[-1], lines
    assert all(again(1, t) == pytest.approx(first(1, t)) for t in TOKENS)


def test_a_curve_measured_on_a_busy_host_is_measured_again_and_never_cached(tiny, tmp_path, monkeypatch):
    """A 2-token pass 2.3x a 3-token one (measured, and once cached, with another process on a core): measured
    again; cached only once a measurement looks like a host's own."""
    from specloom import cost as cost_mod

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = tiny("llama").model
    busy = cost_mod.BatchCost({(1, t): (2.84 if t == 2 else 1.0 + 0.05 * t) for t in TOKENS})
    good = cost_mod.BatchCost({(1, t): 1.0 + 0.05 * t for t in TOKENS})
    assert cost_mod.busy_shape(busy).startswith("1 x 2 tokens took") and cost_mod.busy_shape(good) == ""
    results = [busy, busy]
    monkeypatch.setattr(cost_mod, "measure_batch_cost", lambda m, rows, budget_s=None: results.pop(0))
    lines = []
    assert cost_mod.batch_cost_cached(model, 1, log=lines.append) is busy  # used for this run ...
    assert not list((tmp_path / "specloom" / "verify_cost").glob("*.json"))  # ... never cached
    assert any("not cached" in line for line in lines)
    results[:] = [busy, good]
    assert cost_mod.batch_cost_cached(model, 1) is good
    assert len(list((tmp_path / "specloom" / "verify_cost").glob("batch2-*.json"))) == 1


def test_other_work_is_told_from_our_own(monkeypatch):
    """Contention.others: all CPUs' busy seconds since the start, less this process's own, per CPU-second of the
    window. One other process on one of two cores: 0.5; our own threads busy on both: 0."""
    from specloom.host import contention

    clock = {"wall": 100.0, "busy": 1000.0, "own": 10.0}
    monkeypatch.setattr(contention.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(contention, "_busy_seconds", lambda: clock["busy"])
    monkeypatch.setattr(contention, "_own_seconds", lambda: clock["own"])
    monkeypatch.setattr(contention.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(contention, "BUSY_SHARE", 0.2)  # (conftest judges every host quiet)
    watch = contention.Contention()
    clock.update(wall=104.0, busy=1008.0, own=14.0)  # 4 s: 8 CPU-seconds busy, 4 of them ours
    assert watch.others() == pytest.approx(0.5)
    assert watch.busy_host().startswith("other processes used 50%")
    ours = contention.Contention()
    clock.update(wall=106.0, busy=1012.0, own=18.0)  # 2 s, both CPUs busy with our own threads only
    assert ours.others() == pytest.approx(0.0) and ours.busy_host() == ""
    short = contention.Contention()
    clock.update(wall=106.1, busy=1012.2)
    assert short.others() is None  # below /proc/stat's resolution: not judged
    monkeypatch.setattr(contention, "_busy_seconds", lambda: None)  # no /proc/stat (not Linux)
    assert contention.Contention().others() is None


def test_timings_taken_beside_other_work_are_used_but_not_cached(tiny, tmp_path, monkeypatch):
    """A verify-cost curve measured while another process used half the CPUs (every pass slowed alike: a flat
    curve whose shape check cannot see it) is used for this run and not cached; a quiet measurement is. The
    kernel probe is cached as provisional (not `quiet`) and measured again on the next load."""
    from specloom import cost as cost_mod
    from specloom.host.contention import Contention

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    busy = ["other processes used 50% of the CPUs meanwhile"]
    monkeypatch.setattr(Contention, "busy_host", lambda self: busy[0])
    model = tiny("llama").model
    lines = []
    cost_mod.batch_cost_cached(model, 1, log=lines.append, budget_s=0.5)
    assert not list((tmp_path / "specloom" / "verify_cost").glob("*.json"))
    assert any("other processes used 50%" in x and "not cached" in x for x in lines), lines
    busy[0] = ""
    cost_mod.batch_cost_cached(model, 1, budget_s=0.5)
    assert len(list((tmp_path / "specloom" / "verify_cost").glob("*.json"))) == 1

    busy[0] = "other processes used 50% of the CPUs meanwhile"
    m = _tiny_bf16_target()
    calls = _count_probes(monkeypatch)
    lines = []
    c = kernel_choice(m, "auto", "cpu", log=lines.append)
    saved = json.loads(next((tmp_path / "specloom" / "host").glob("kernels-*.json")).read_text())
    assert saved["quiet"] is False and saved["others"] == busy[0]
    assert any("other processes used 50%" in x and "provisional" in x for x in lines), lines
    assert any("other processes used 50%" in n for n in c.notes), c.notes
    busy[0] = ""
    calls.clear()
    kernel_choice(m, "auto", "cpu")
    assert calls == [None]  # measured again, not read
    saved = json.loads(next((tmp_path / "specloom" / "host").glob("kernels-*.json")).read_text())
    assert "others" not in saved or saved["quiet"] is True or saved["spread"] > kernel_probe.NOISY
