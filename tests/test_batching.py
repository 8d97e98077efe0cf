"""Continuous batching with speculation (scheduler.py, kv.py): sequences that join and leave between
steps, each with its own drafter state and ragged draft tree padded into one target pass, give exactly what each
gives alone -- for every drafter kind, with everything accepted (self-draft) and nothing accepted (random
drafters), on tiny fp32 targets; the sampling distribution is unchanged; cancelled sequences free their row at
once; a full queue refuses; the load-aware policy lowers the depth as the batch grows."""

import random
import shutil
import time

import pytest
import torch

from specloom import Engine, SpecloomError
from specloom.drafters.checkpoint import specloom_meta
from specloom.drafters.mtp.format import save_into_target
from specloom.sampling import SamplingParams
from specloom.scheduler import BatchScheduler, QueueFull, Sequence
from specloom.depth import Acceptance, DepthPolicy
from specloom.cost import BatchCost
from specloom.speculative import SpeculativeConfig
from test_block_drafters import make_block, save as save_block
from test_hidden_drafters import make_eagle, make_medusa
from test_mtp import random_mtp

N = 23


def _prompts(seed=0, count=7):
    rng = random.Random(seed)
    ps = [[rng.randrange(4, 256) for _ in range(rng.randrange(3, 40))] for _ in range(count)]
    ps[0] = [5, 6, 7, 8] * 6  # repetitive: n-gram drafts get accepted
    return ps


def run_batched(engine, prompts, rows=3, mode="fixed", stagger=True, **kw):
    """Submit the prompts (half at once, the rest while those run) to a scheduler with fewer rows than prompts,
    so sequences queue, join mid-flight and leave; returns their results in order."""
    sch = BatchScheduler(engine, rows=rows, mode=mode, **kw)
    try:
        seqs = [Sequence(p, N, SamplingParams(), ignore_eos=True) for p in prompts]
        half = len(seqs) // 2
        sch.submit(seqs[:half])
        for s in seqs[half:]:
            if stagger:
                time.sleep(0.01)
            sch.submit([s])
        results = [s.wait(120) for s in seqs]
        assert sch.pool.active == 0 and sch.num_running == 0  # every row came back
        return results
    finally:
        sch.close()


@pytest.fixture(scope="module")
def kinds(tiny, tmp_path_factory):
    """Specs for every drafter kind on the tiny llama target (random drafters: almost nothing accepted)."""
    t = tiny("llama")
    root = tmp_path_factory.mktemp("batch_drafters")
    mtp_dir = str(root / "target_with_mtp")
    shutil.copytree(t.path, mtp_dir)
    save_into_target(random_mtp(t, 2), mtp_dir, specloom_meta("mtp", t.model, t.tokenizer, (3,)),
                     dtype=torch.float32)
    return t, mtp_dir, {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},
        "self_draft": {"method": "draft_model", "model": t.path, "num_speculative_tokens": 4},
        "draft_model_tree": {"method": "draft_model", "model": tiny("qwen3").path, "num_speculative_tokens": 3,
                             "tree_width": 2},
        "eagle_tree": {"method": "eagle", "model": make_eagle(t, str(root / "eagle"), False),
                       "num_speculative_tokens": 4, "tree_width": 3, "num_draft_tokens": 9},
        "eagle3": {"method": "eagle3", "model": make_eagle(t, str(root / "eagle3"), True, draft_vocab=200),
                   "num_speculative_tokens": 3},
        "medusa": {"method": "medusa", "model": make_medusa(t, str(root / "medusa"))},
        "dflash": {"method": "dflash", "model": save_block(t, make_block(t, False, 5), "dflash", str(root / "df"))},
        "dspark": {"method": "dspark", "model": save_block(t, make_block(t, True, 4, "vanilla", confidence=True),
                                                          "dspark", str(root / "ds"))},
        "dflash2_tree": {"method": "dflash2", "model": save_block(t, make_block(t, False, 5, seed=3, dflash2=True),
                                                                 "dflash2", str(root / "df2")),
                         "tree_width": 3, "num_draft_tokens": 8},
        "dspark_tree": {"method": "dspark", "model": save_block(t, make_block(t, True, 3, "rnn", seed=2),
                                                               "dspark", str(root / "ds_rnn")), "tree_width": 2},
    }


@pytest.mark.parametrize("kind", ["ngram", "self_draft", "draft_model_tree", "eagle_tree", "eagle3", "medusa",
                                  "dflash", "dspark", "mtp", "dflash2_tree", "dspark_tree"])
def test_batched_identical_to_alone(kinds, kind):
    t, mtp_dir, specs = kinds
    if kind == "mtp":
        import specloom

        engine = specloom.load(mtp_dir, {"method": "mtp", "num_speculative_tokens": 3}, dtype="fp32", progress=False)
        engine.model, engine.tokenizer = t.model, t.tokenizer  # the same target weights as the plain reference
    else:
        engine = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(specs[kind]), max_model_len=256)
    prompts = _prompts()
    want = [Engine(t.model, t.tokenizer).generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids
            for p in prompts]
    got = run_batched(engine, prompts)
    assert [r.token_ids for r in got] == want
    drafted = sum(r.num_draft_tokens for r in got)
    assert drafted > 0, "the drafter never drafted inside the batch"
    if kind == "self_draft":  # the target drafting for itself: every draft accepted
        assert all(r.num_accepted_tokens == r.num_draft_tokens for r in got)


@pytest.mark.parametrize("family", ["gemma3", "qwen2"])
def test_batched_other_families_and_load_aware(tiny, family):
    """Sliding-window layers (Gemma-3, window 8, contexts past it) and the load-aware mode keep outputs exact."""
    t = tiny(family)
    engine = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4}),
                    max_model_len=256)
    prompts = _prompts(seed=1)
    want = [Engine(t.model, t.tokenizer).generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids
            for p in prompts]
    cost = BatchCost({(n, k): 1.0 + 0.02 * n * k for n in (1, 2, 4) for k in (1, 2, 3, 5)})
    assert [r.token_ids for r in run_batched(engine, prompts, rows=4, mode="load_aware", cost=cost)] == want


@pytest.mark.parametrize("kind", ["self_draft", "ngram", "eagle_tree", "dspark", "dflash2_tree"])
def test_batched_sampling_equals_alone_seed_for_seed(kinds, kind):
    """Under sampling each sequence keeps its own generator and draws in the same order as alone, so a seeded
    sequence gives the very same tokens batched as alone -- and the alone engine's distribution is tested against
    plain sampling for every drafter kind (sampling_tv tests)."""
    t, _, specs = kinds
    ids = [5, 6, 7, 8, 5, 6, 7]
    engine = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(specs[kind]), max_model_len=64)
    sch = BatchScheduler(engine, rows=6, mode="fixed", max_queue=1000)
    try:
        seqs = [Sequence(ids, 9, SamplingParams(temperature=1.0, top_k=3, seed=s), ignore_eos=True)
                for s in range(60)]
        sch.submit(seqs)
        got = [s.wait(120) for s in seqs]
    finally:
        sch.close()
    alone = [engine.generate(prompt_token_ids=ids, max_tokens=9, temperature=1.0, top_k=3, seed=s, ignore_eos=True)
             for s in range(60)]
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]
    assert sum(r.num_draft_tokens for r in got) > 0
    assert len({tuple(r.token_ids) for r in got}) > 10  # really sampled


def test_cancel_frees_row_and_queue_limit(tiny):
    t = tiny("llama")
    engine = Engine(t.model, t.tokenizer, max_model_len=512)
    sch = BatchScheduler(engine, rows=1, mode="off", max_queue=1)
    try:
        long = Sequence([5, 6, 7], 400, SamplingParams(), ignore_eos=True)
        sch.submit([long])
        while long.t_first is None:
            time.sleep(0.005)
        queued = Sequence([9, 10], 5, SamplingParams(), ignore_eos=True)
        sch.submit([queued])  # waits for the row
        with pytest.raises(QueueFull, match="capacity"):
            sch.submit([Sequence([9, 10], 5, SamplingParams(), ignore_eos=True)])
        long.cancel()
        r = long.wait(30)
        assert r.finish_reason == "abort" and len(r.token_ids) < 400
        assert queued.wait(30).finish_reason == "length"  # the freed row served the queued request
        assert sch.pool.active == 0
        with pytest.raises(SpecloomError, match="context"):
            sch.submit([Sequence([5] * 500, 100, SamplingParams())])
    finally:
        sch.close()


def test_load_aware_policy_depth_falls_with_load():
    # c(n, T): flat while the pass is weight-bound, then linear in the number of tokens (CPU-like)
    cost = BatchCost({(n, k): max(1.0, n * k / 6) for n in (1, 2, 4, 8, 16) for k in (1, 2, 3, 5, 9, 17)})
    pol = DepthPolicy("load_aware", 4, cost)
    pol.draft_cost = 0.02  # drafting one depth costs 2 % of a decode step
    depths = [max(pol.choose([0.7] * n, [4] * n)) for n in (1, 2, 4, 8, 16)]
    assert depths[0] == 4 and depths[-1] == 0 and depths == sorted(depths, reverse=True), depths
    assert pol.choose([0.02], [4]) == [0]  # a request whose drafts are never accepted stops drafting
    assert pol.choose([0.9, 0.05], [4, 4])[1] < pol.choose([0.9, 0.05], [4, 4])[0]
    pol.draft_cost = 0.5  # an expensive drafter: shallower
    assert max(pol.choose([0.7], [4])) < 4
    assert DepthPolicy("off", 4).choose([0.9], [4]) == [0] and DepthPolicy("fixed", 4).choose([0.1], [2]) == [2]
    # online calibration: when passes at the chosen depth really cost 3x the curve, the policy goes shallower
    pol.draft_cost = 0.02
    before = max(pol.choose([0.7] * 2, [4] * 2))
    assert before >= 1
    for _ in range(60):
        cost.observe(2, 1 + before, 3.0 * cost.base * cost(2, 1 + before))
    assert max(pol.choose([0.7] * 2, [4] * 2)) < before
    acc = Acceptance(prior=0.5)
    for _ in range(20):
        acc.update(4, 4)
    assert acc.alpha > 0.9


def test_memory_budget_sizes_the_pool(tiny):
    from specloom.scheduler import parse_size, plan_memory

    t = tiny("llama")
    engine = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "draft_model", "model": t.path}),
                    max_model_len=512)
    big = plan_memory(engine, 8, None)
    assert big["rows"] == 8
    per_row = big["target_kv_per_row"] + big["drafter_kv_per_row"] + big["activations_per_row"]
    fixed = big["target_weights"] + big["drafter_weights"]
    assert plan_memory(engine, 8, fixed + 3 * per_row + 10)["rows"] == 3
    with pytest.raises(SpecloomError, match="too small"):
        plan_memory(engine, 8, fixed + per_row // 2)
    assert parse_size("2GiB") == 2 ** 31 and parse_size("512MB") == 512 * 10 ** 6
    with pytest.raises(SpecloomError, match="memory size"):
        parse_size("lots")


@pytest.mark.parametrize("kind", ["eagle_tree", "dflash2_tree"])
def test_load_aware_shrinks_trees_and_stays_exact(kinds, kind):
    """Load-aware depth below the drafter's own: the EAGLE-2 tree (or a block drafter's tree) keeps
    proportionally fewer nodes; still exact."""
    t, _, specs = kinds
    engine = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(specs[kind]), max_model_len=256)
    prompts = _prompts(seed=2)
    want = [Engine(t.model, t.tokenizer).generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids
            for p in prompts]
    # verification cheap for one row, dear for several: depth 4 alone, shallower in a batch
    cost = BatchCost({(n, k): 1.0 + 0.15 * (n - 1) * k for n in (1, 2, 4) for k in (1, 2, 3, 5, 9)})
    sizes = []
    sch = BatchScheduler(engine, rows=3, mode="load_aware", cost=cost)
    orig = sch.policy.choose

    def spy(alphas, caps):
        ks = orig([0.9] * len(alphas), caps)  # pretend high acceptance: the depth follows the batch size only
        sizes.append((len(alphas), max(ks)))
        return ks

    sch.policy.choose = spy
    try:
        seqs = [Sequence(p, N, SamplingParams(), ignore_eos=True) for p in prompts]
        sch.submit(seqs)
        got = [s.wait(120).token_ids for s in seqs]
    finally:
        sch.close()
    assert got == want
    by_n = {}
    for n, k in sizes:
        by_n.setdefault(n, set()).add(k)
    assert max(by_n.get(1, {0})) > min(by_n.get(3, {9})), by_n  # deeper alone than with three rows


def test_long_prompt_prefilled_in_chunks_between_steps(tiny):
    """A long prompt joining a running batch is prefilled a budget of tokens per step (100 here): the running
    sequence keeps emitting meanwhile, and both outputs stay exact."""
    t = tiny("llama")
    engine = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3}),
                    max_model_len=512)
    rng = random.Random(3)
    short, long = [5, 6, 7, 8] * 3, [rng.randrange(4, 256) for _ in range(450)]
    want = [Engine(t.model, t.tokenizer).generate(prompt_token_ids=p, max_tokens=40, ignore_eos=True).token_ids
            for p in (short, long)]
    sch = BatchScheduler(engine, rows=2, mode="fixed")
    sch.prefill_budget = 100
    during_prefill = []
    try:
        a = Sequence(short, 40, SamplingParams(), ignore_eos=True,
                     on_tokens=lambda new: during_prefill.append(sch.prefilling is not None))
        sch.submit([a])
        while a.t_first is None:
            time.sleep(0.001)
        b = Sequence(long, 40, SamplingParams(), ignore_eos=True)
        sch.submit([b])
        assert [a.wait(60).token_ids, b.wait(60).token_ids] == want
    finally:
        sch.close()
    assert sum(during_prefill) >= 3  # the short sequence stepped while the long prompt was being prefilled


@pytest.mark.parametrize("kind", ["eagle_tree", "dflash", "mtp", "self_draft"])
def test_long_prompt_joins_rows_near_capacity(kinds, kind, caplog):
    """A drafter's catch-up pads every row of its pass to the widest: a just-prefilled long prompt must not share
    a pass with a row close to its capacity (it overflowed the store and turned drafting off). Both rows stay
    exact, both keep drafting, and no drafter failure is logged."""
    t, mtp_dir, specs = kinds
    L = 300  # row capacity 300 + 256 slots: a row at ~290 plus a 290-token catch-up does not fit one pass
    if kind == "mtp":
        import specloom

        engine = specloom.load(mtp_dir, {"method": "mtp", "num_speculative_tokens": 2}, dtype="fp32",
                               progress=False, max_model_len=L)
        engine.model, engine.tokenizer = t.model, t.tokenizer
    else:
        engine = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(specs[kind]), max_model_len=L)
    rng = random.Random(7)
    first, second = [5, 6, 7, 8] * 3, [rng.randrange(4, 256) for _ in range(288)]
    want = [Engine(t.model, t.tokenizer).generate(prompt_token_ids=p, max_tokens=n, ignore_eos=True).token_ids
            for p, n in ((first, 286), (second, 12))]
    sch = BatchScheduler(engine, rows=2, mode="fixed")
    caplog.set_level("ERROR", logger="specloom")
    try:
        a = Sequence(first, 286, SamplingParams(), ignore_eos=True)
        sch.submit([a])
        while a.t_first is None or sch.pool.lengths[0] < 272:
            time.sleep(0.005)
        b = Sequence(second, 12, SamplingParams(), ignore_eos=True)
        sch.submit([b])
        got = [a.wait(120), b.wait(120)]
    finally:
        sch.close()
    assert [r.token_ids for r in got] == want
    assert not [r for r in caplog.records if "drafter" in r.getMessage()]
    assert got[1].num_draft_tokens > 0


def test_ragged_mask_wider_than_a_padding_row(tiny):
    """A drafter's tree pass masks its rows' last R slots; a padding row of the span may hold fewer than R slots
    (a row drafting nothing this step). The pass must still run, and a real row's attention must be unchanged."""
    model = tiny("llama").model
    kv = model.new_kv(64, batch=2, active=0)
    r0, r1 = kv.allocate(), kv.allocate()
    with torch.inference_mode():
        model(torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.arange(6)[None], kv.begin([r0], [6]))
        kv.commit(row=r0)
        mask = torch.ones(2, 2, 5, dtype=torch.bool)  # R = 5 > row 1's 0 + 2 slots
        mask[:, 0, -1] = False  # causal among the two new entries
        out = model(torch.tensor([[11, 12], [0, 0]]), torch.tensor([[6, 7], [0, 0]]), kv.begin([r0, r1], [2, 0]),
                    attn_mask=mask).logits
        alone = model.new_kv(64)
        model(torch.tensor([[5, 6, 7, 8, 9, 10]]), torch.arange(6)[None], alone)
        alone.commit()
        ref = model(torch.tensor([[11, 12]]), torch.tensor([[6, 7]]), alone).logits
    assert torch.allclose(out[0], ref[0], atol=1e-5)


def test_a_sequence_keeps_its_row_while_others_come_and_go(kinds):
    """Rows are addressed by index: a sequence keeps the pool row it was admitted to until it ends, whatever
    finishes before it (no row moves on retire), and outputs stay those of plain decoding."""
    t, _, specs = kinds
    engine = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(specs["eagle_tree"]), max_model_len=256)
    prompts = _prompts(seed=3)
    want = [Engine(t.model, t.tokenizer).generate(prompt_token_ids=p, max_tokens=n, ignore_eos=True).token_ids
            for p, n in zip(prompts, (4, 30, 8, 30, 6, 12, 30))]
    sch = BatchScheduler(engine, rows=3, mode="fixed")
    admitted, seen = {}, []
    step = sch.stepper.step

    def watched(rows, plan):
        for r in rows:
            admitted.setdefault(id(r.req), r.row)
            assert r.row == admitted[id(r.req)] == r.req.row  # the row it was admitted to
        seen.append(sorted(r.row for r in rows))
        return step(rows, plan)

    sch.stepper.step = watched
    try:
        seqs = [Sequence(p, n, SamplingParams(), ignore_eos=True)
                for p, n in zip(prompts, (4, 30, 8, 30, 6, 12, 30))]
        sch.submit(seqs)
        assert [s.wait(120).token_ids for s in seqs] == want
    finally:
        sch.close()
    assert any(rows != list(range(len(rows))) for rows in seen)  # steps over rows that are not 0..n-1 happened
