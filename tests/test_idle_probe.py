"""Idle rows under load-aware speculation (issue 13 follow-up): a drafter whose per-row state catches up lazily
(`Drafter.idle_free`: EAGLE-1/3, MTP, Medusa, draft model, DFlash, DSpark, n-gram, suffix) is not turned off for
good where it cannot pay; it is probed now and then and drafts again once its text turns predictable. The
catch-up after a long idle stretch is one drafter pass over the missed positions and the output stays plain
decoding's; the suffix half of a hybrid keeps drafting (free drafts) while its model half idles."""

import pytest

from specloom import Engine
from specloom.drafters.base import Drafter
from specloom.sampling import SamplingParams
from specloom.scheduler import BatchScheduler, Sequence
from specloom.cost import BatchCost
from specloom.depth import DepthPolicy
from specloom.speculative import SpeculativeConfig
from specloom.step import StepReport
from specloom.tree import DraftTree

from test_hidden_drafters import drafters, make_eagle, make_medusa  # noqa: F401  (module fixture)

CHEAP = {1: 1.0, 2: 1.02, 3: 1.04, 5: 1.08, 9: 1.2, 17: 1.5}  # a oneDNN-bf16 host: drafting pays at fair alpha
LINEAR_IN_N = {t: float(t) for t in CHEAP}  # verification costs its token count: no acceptance pays


def curve(c: dict) -> BatchCost:
    return BatchCost({(1, t): 0.02 * v for t, v in c.items()}, frozen=True)


def test_builtin_kinds_declare_free_idle_steps():
    from specloom.drafters.block.drafter import DFlashDrafter, DSparkDrafter
    from specloom.drafters.draft_model.drafter import DraftModelDrafter
    from specloom.drafters.eagle.drafter import Eagle1Drafter, Eagle3Drafter
    from specloom.drafters.medusa.drafter import MedusaDrafter
    from specloom.drafters.mtp.drafter import MTPDrafter
    from specloom.drafters.ngram.drafter import NgramDrafter
    from specloom.drafters.suffix.drafter import SuffixDrafter

    for cls in (Eagle1Drafter, Eagle3Drafter, MTPDrafter, MedusaDrafter, DraftModelDrafter, DFlashDrafter,
                DSparkDrafter, NgramDrafter, SuffixDrafter):
        assert cls.idle_free is True, cls
    # the default: free only for a drafter without target features and own KV (as the policy's `cheap`)
    assert _Lazy(False).idle_free is False and Drafter().idle_free is True


class _Lazy(Drafter):
    """EAGLE-like to the policy: reads target features, keeps a KV of its own; `lazy` says its idle steps are
    free (as EagleDrafter's: features kept, caught up at the next draft)."""

    needs_hidden = (1,)

    def __init__(self, lazy: bool):
        self.lazy = lazy

    @property
    def idle_free(self) -> bool:
        return self.lazy

    @property
    def num_speculative_tokens(self) -> int:
        return 2

    def memory(self) -> dict:
        return {"weights": 0, "kv_per_1k_tokens": 1000}


class _Ctx:
    k, max_nodes, state, budget = 0, None, None, 0


class _Row:
    """A pool row as the policy sees it: drafting, a context, a cap of 2."""
    drafting, budget = True, 1000

    def __init__(self):
        self.ctx = _Ctx()

    def cap(self, drafter):
        return 2

    def stop_drafting(self):
        self.drafting, self.ctx.state = False, None


def _run(policy, drafter, accepts, steps):
    """`steps` steps of one fake row through the policy (plan, step, observe); the drafter accepts
    min(accepts(i), k)."""
    row = _Row()
    row.acc = policy.new_acceptance()
    ks = []

    class Stepper:
        def step(self, rows, plan):
            k = plan.depths[0]
            tree = DraftTree(list(range(1, k + 2)), list(range(-1, k)))  # a chain k deep
            return StepReport(1, len(tree), 0.02, 0.001 * k, [tree], [min(accepts(len(ks)), k)])

    Stepper.drafter = drafter
    for _ in range(steps):
        if not row.drafting:
            break
        stepper = Stepper()
        plan = policy.plan(stepper, [row], [2])
        policy.observe([row], plan, stepper.step([row], plan))
        ks.append(plan.depths[0])
    return ks, row


def test_lazy_drafter_is_probed_and_drafts_again_when_its_text_turns_predictable():
    """Acceptance first bad (nothing accepted for 40 steps), then good (everything): an EAGLE-like lazy drafter
    drafts through its trial, idles, is probed (every 8 idle steps) and, once a probe is accepted,
    drafts again for good. A drafter whose idle steps are not free is turned off after `patience` idle steps,
    as before, and never comes back."""
    def accepts(i):
        return 0 if i < 40 else 2

    lazy = _Lazy(True)
    pol = DepthPolicy.for_drafter("auto", lazy, curve(CHEAP))
    assert pol.idle_free and not pol.cheap
    ks, row = _run(pol, lazy, accepts, 120)
    assert row.drafting and len(ks) == 120
    i0 = next(i for i in range(pol.trial, 120) if ks[i] == 0)  # idle once its drafts as a whole rule it out
    assert all(k > 0 for k in ks[:i0]) and i0 <= pol.trial + 4 and ks[i0:i0 + 7] == [0] * 7, ks
    assert ks[i0 + 7] == 1 and ks[i0 + 8:i0 + 15] == [0] * 7 and ks[i0 + 15] == 1, ks  # probes every 8 steps
    back = next(i for i in range(40, 120) if ks[i] > 0)
    assert back < 40 + pol.explore_max + 1 and all(k > 0 for k in ks[back:]), ks  # drafting again for good
    ks, row = _run(DepthPolicy.for_drafter("auto", _Lazy(False), curve(CHEAP)), _Lazy(False), accepts, 120)
    # not free: turned off for the rest of the request once its drafts as a whole rule drafting out (its depth
    # falling as the evidence mounts: 0 of 5 drafts accepted bounds its acceptance at 0.25) and `patience` idle
    # steps later
    i0 = ks.index(0)
    assert not row.drafting and len(ks) == i0 + 8 and ks[i0:] == [0] * 8 and pol.trial <= i0 <= pol.trial + 4, ks
    assert ks[:i0] == sorted(ks[:i0], reverse=True) and ks[i0 - 1] == 1, ks


MID = {1: 1.0, 2: 1.25, 3: 1.5, 5: 2.0, 9: 3.0, 17: 5.0}  # verification neither free nor linear


def _request(policy, drafter, accepts, steps, probe_cost):
    """One request through `admit`, then plan / step / observe: a probe (a depth-1 step after idle ones) catches
    the drafter up and costs `probe_cost` extra decode steps of drafting; a depth-1 step otherwise 0.05.
    Returns the depths chosen."""
    class Stepper:
        pass

    Stepper.drafter = drafter
    row, ks = _Row(), []
    policy.admit(row, drafter)
    for _ in range(steps):
        if not row.drafting:
            break
        plan = policy.plan(Stepper(), [row], [2])
        k = plan.depths[0]
        tree = DraftTree(list(range(1, k + 2)), list(range(-1, k)))
        draft = 0.02 * (probe_cost if plan.probed else 0.05) * k
        rep = StepReport(1, len(tree), 0.02 * policy.cost(1, len(tree)), draft, [tree], [min(accepts(len(ks)), k)])
        policy.observe([row], plan, rep)
        ks.append(k)
    return ks


def test_probes_that_cost_more_than_drafting_returns_stop_for_most_requests():
    """A probe catches the drafter up over the prompt and the idle positions (EAGLE-3 alone on the EPYC: 1.8 decode
    steps for 1.5 tokens; 113 probes in 26 requests, 0.82x). When what the drafter's passes returned (tokens less
    their cost, `DepthPolicy.value`) is below zero, only every `explore_every`-th new request is probed (the
    others decode plain); a drafter whose probes find text it drafts well keeps probing every request."""
    lazy = _Lazy(True)
    pol = DepthPolicy.for_drafter("auto", lazy, curve(MID), prior_tau=1.2)  # prior too low to draft unprobed
    probed = []
    for _ in range(12):  # probes cost 1.5 steps of drafting and are never accepted
        ks = _request(pol, lazy, lambda i: 0, 64, probe_cost=1.5)
        probed.append(1 in ks)
    assert pol.value < 0
    # the first request probes; once its probes have cost more than they returned, one in explore_every (4)
    assert probed == [True] + ([False] * 3 + [True]) * 2 + [False] * 3, probed
    good = DepthPolicy.for_drafter("auto", lazy, curve(MID), prior_tau=1.2)
    probed = []
    for _ in range(12):  # the same probes, accepted: the rows draft on (two tokens a step)
        ks = _request(good, lazy, lambda i: 2, 64, probe_cost=1.5)
        probed.append(1 in ks or 2 in ks)
    assert good.value > 0 and all(probed), (good.value, probed)


@pytest.mark.parametrize("lazy", [False, True])
def test_trial_ends_early_when_the_evidence_rules_the_drafter_out_but_not_after_an_unlucky_start(lazy):
    """A drafter whose manifest promises tau 2.4 (prior alpha 0.78) on a host where verification is not free:
    a row that accepts nothing stops drafting after 4 steps, not its whole 8-step trial (its own drafts' upper
    bound, 0 of 4, is 0.29, below what pays); a row whose first two steps accept nothing and every later one
    everything keeps drafting (0 of 2 still allows 0.45); a row accepting half keeps drafting too."""
    def run(accepts):
        pol = DepthPolicy.for_drafter("auto", _Lazy(lazy), curve(MID), prior_tau=2.4)
        assert pol.prior_alpha == pytest.approx(0.78, abs=0.01)
        return _run(pol, _Lazy(lazy), accepts, 40)[0]

    ks = run(lambda i: 0)
    assert ks[:4] == [2, 2, 1, 1] and ks[4:11] == [0] * 7, ks  # (lazy: probed later, at depth 1)
    ks = run(lambda i: 0 if i < 2 else 2)
    assert all(k > 0 for k in ks) and ks[-20:] == [2] * 20, ks
    ks = run(lambda i: 1)
    assert all(k > 0 for k in ks), ks


def test_lazy_drafter_is_turned_off_where_no_acceptance_could_pay():
    """Where verification costs its token count, no acceptance pays: probing would be waste, so even a lazy
    drafter is turned off (a cheap one, n-gram, is still probed: test_host_fit)."""
    pol = DepthPolicy.for_drafter("auto", _Lazy(True), curve(LINEAR_IN_N))
    ks, row = _run(pol, _Lazy(True), lambda i: 2, 40)
    assert not row.drafting and ks == [0] * 8, ks


def test_catch_up_groups_do_not_pad_every_row_to_a_long_catch_up():
    """A row back from 64 idle steps catches up over 64 positions: a pass shared with rows of 1-2 positions
    would pad every row to 64 (rows x 64 slots); it gets its own pass, the short rows share one. Short
    catch-ups (a normal step, at most PAD_FREE wide) stay one pass, and the capacity split is unchanged."""
    from specloom.drafters.rows import PAD_FREE, fitting_groups

    class Ctx:
        def __init__(self, row):
            self.row = row

    class Store:
        def __init__(self, lengths, max_len=1000):
            self.lengths, self.max_len = lengths, max_len

    ctxs = [Ctx(r) for r in range(4)]
    assert fitting_groups(ctxs, [1, 64, 2, 1], Store([100] * 4)) == [[1], [0, 2, 3]]
    assert fitting_groups(ctxs, [1, PAD_FREE, 2, 1], Store([100] * 4)) == [[0, 1, 2, 3]]
    assert fitting_groups(ctxs, [40, 64, 2, 1], Store([100] * 4)) == [[0, 1], [2, 3]]
    assert fitting_groups(ctxs[:2], [40, 64], Store([950, 100])) == [[1], [0]]  # 950 + 64 slots overflow


N = 90


def _plain(t, ids, n=N):
    return Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=n, ignore_eos=True).token_ids


def test_eagle3_exact_through_idle_and_probe_cycles_and_one_pass_catch_up(drafters):
    """A random EAGLE-3 (it accepts almost nothing) under auto speculation on a cheap-verification curve: it
    drafts through its trial, idles, and is probed after 60 idle steps (explore period fixed at 60 here). The
    probe's catch-up feeds the drafter every missed position in one ragged pass (its size is the positions
    committed since the drafter last ran); the greedy output equals plain decoding's, and the row is still
    drafting at the end."""
    t, paths = drafters
    spec = SpeculativeConfig.parse({"method": "eagle3", "model": paths["eagle3"], "num_speculative_tokens": 2,
                                    "tree_width": 1})
    e = Engine(t.model, t.tokenizer, spec, speculation="auto", cost=curve(CHEAP), max_model_len=256)
    pol = e.depth_policy()
    assert pol.idle_free and not pol.cheap
    pol.explore_base = pol.explore_max = 60
    d = e.drafter
    sizes, passes = [], []
    take, fwd = d._take_feats, d.model.forward

    def take_feats(ctxs):
        feats = take(ctxs)
        sizes.append([f.shape[0] for f in feats])
        passes.append(0)
        return feats

    def forward(*a, **kw):
        if passes:
            passes[-1] += 1
        return fwd(*a, **kw)

    d._take_feats, d.model.forward = take_feats, forward
    ids = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]
    r = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
    assert r.token_ids == _plain(t, ids)
    s = r.speculation
    assert s["drafting_at_end"] and s["drafted_steps"] >= pol.trial + 1, s
    big = max(sizes, key=lambda m: m[0])[0]
    assert big >= 60, sizes  # the probe after 60 idle steps caught up over them ...
    i = [m[0] for m in sizes].index(big)
    assert passes[i] == 1, passes  # ... in one drafter pass (a depth-1 probe needs no other)


def test_batched_rows_idle_probe_and_stay_exact(drafters):
    """The serving scheduler, load-aware on a cheap curve, 3 rows for 5 requests (rows join, leave and move):
    random EAGLE-3 and Medusa drafters idle and are probed every 3..12 idle steps; every request gives its
    alone output and no row is ever turned off."""
    t, paths = drafters
    prompts = [[5, 6, 7, 8] * 4, [40, 41, 42, 43, 44, 45, 46], [9, 200, 9, 200, 17], [77] * 3, [12, 250, 3, 99]]
    want = [_plain(t, p, 40) for p in prompts]
    cost = BatchCost({(n, k): 1.0 + 0.01 * (n - 1) + 0.02 * k for n in (1, 2, 4) for k in CHEAP}, frozen=True)
    for method in ("eagle3", "medusa"):
        e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": method, "model": paths[method]}),
                   max_model_len=256)
        sch = BatchScheduler(e, rows=3, mode="load_aware", cost=cost)
        pol = sch.policy
        pol.explore_base, pol.explore_max = 3, 12
        steps = []
        observe = pol.observe

        def spy(rows, plan, rep):
            observe(rows, plan, rep)
            steps.append((plan.depths, [r.drafting for r in rows]))

        pol.observe = spy
        try:
            seqs = [Sequence(p, 40, SamplingParams(), ignore_eos=True) for p in prompts]
            sch.submit(seqs)
            assert [s.wait(120).token_ids for s in seqs] == want, method
        finally:
            sch.close()
        assert all(all(d) for _, d in steps), method  # never turned off
        idle = sum(k == 0 for ks, _ in steps for k in ks)
        assert idle > 40 and sum(k > 0 for ks, _ in steps[40:] for k in ks) > 0, method  # idle, then probes


def test_hybrid_suffix_half_drafts_while_the_model_half_idles(drafters):
    """EAGLE-3 with suffix decoding in front, auto speculation, a verification row at a quarter of a decode step
    (on the near-free CHEAP curve even its ~0.15 acceptance pays): the random model half pays nothing, so after
    its trial the row idles; the answer's second half is in the suffix cache, and there the suffix half's free
    trees are verified although the model half idles (and accepted: the row drafts again). Before, the pair
    was turned off for good after `patience` idle steps. Output: plain decoding's."""
    t, paths = drafters
    ids = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]
    truth = _plain(t, ids, 56)
    spec = SpeculativeConfig.parse({"method": "eagle3", "model": paths["eagle3"], "num_speculative_tokens": 2,
                                    "tree_width": 1, "suffix_decoding": True})
    e = Engine(t.model, t.tokenizer, spec, speculation="auto", cost=curve(MID), max_model_len=256)
    e.drafter.suffix.add_response(truth[28:])  # the second half only
    pol = e.depth_policy()
    taken = []
    orig = pol._free_drafts

    def spy(*a):
        got = orig(*a)
        taken.append(len(got))
        return got

    pol._free_drafts = spy
    r = e.generate(prompt_token_ids=ids, max_tokens=56, ignore_eos=True)
    assert r.token_ids == truth
    assert r.speculation["drafting_at_end"]
    assert sum(taken) >= 1, taken  # a free suffix tree was verified while the model half idled
    assert r.num_accepted_tokens >= 12, r.num_accepted_tokens  # the cached half, drafted and accepted
