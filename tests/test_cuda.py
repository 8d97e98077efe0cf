"""The CUDA path.

Runs everywhere (CPU):
* the synchronisation-free verifier (`_verify_sampling_batched`, what CUDA runs) gives the very same result as the
  CPU verifier seed for seed, and leaves the generator in the same state, on the sampling tests' trees and on
  random multi-level trees (so its logic is covered by the CPU suite);
* device names: `parse_device` accepts cpu / cuda / cuda:N and refuses anything else with one SpecloomError.

Runs on a device (skipped without one): `SPECLOOM_TEST_DEVICE` (default `cuda`) names it; the tiny llama target
is loaded there in fp32, and plain greedy decoding equals speculative greedy decoding for ngram, eagle3, dflash
and dspark, alone and through the BatchScheduler; sampling runs with the generator on the device; nothing
CPU-only (oneDNN packing, fp32 KV default) is applied there. `SPECLOOM_TEST_DEVICE=cpu` runs these same checks on
the CPU (to check the test itself).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from specloom import Engine, SpecloomError
from specloom.loading import load_target, parse_device
from specloom.sampling import SamplingParams, probs_from_logits
from specloom.tree import DraftTree
from specloom.verify import _verify_sampling, _verify_sampling_batched

DEVICE = os.environ.get("SPECLOOM_TEST_DEVICE", "cuda")


# -- the batched verifier equals the CPU one, seed for seed (CPU) ----------------------------------------------------

def _same_run(trials, params, seed):
    """Run both verifiers over the same trials, each with its own generator seeded alike and carried along from
    trial to trial (so any difference in what they consume shows up in every later trial)."""
    g_cpu, g_batched = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    n = 0
    for tree, logits in trials:
        a = _verify_sampling(tree, logits, params, g_cpu)
        b = _verify_sampling_batched(tree, logits, params, g_batched)
        assert a == b, (n, tree.tokens, tree.parents)
        n += 1
    assert torch.equal(g_cpu.get_state(), g_batched.get_state())  # the very same numbers consumed
    return n


@pytest.mark.parametrize("case", ["chain_sampled", "chain_fixed", "siblings_iid", "siblings_without_replacement",
                                  "siblings_fixed"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8)])
def test_batched_verifier_equals_cpu_verifier_on_sampling_cases(case, params):
    import test_verify as tv

    m = tv.Markov(params)
    trials = list(tv.CASES[case].trials(m, 1500, torch.Generator().manual_seed(7)))
    assert _same_run(trials, params, seed=11) == 1500


def _random_trees(n: int, V: int, with_q: bool, seed: int, params: SamplingParams):
    """Random trees of up to 14 nodes (chains, wide roots, siblings at every depth, repeated sibling tokens),
    logits that make some drafts likely (so paths go deep), and, with_q, a random draft distribution per node
    that sometimes equals the parent's p (then a drafted token outside p's support is rejected and leaves an
    empty residual: the fallback to p) or puts 0 on the drafted token."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        N = rng.randrange(1, 15)
        parents = [-1] + [rng.randrange(0, i) for i in range(1, N)]
        tokens = [rng.randrange(V) for _ in range(N)]
        logits = torch.randn(N, V, generator=g) * rng.choice([0.5, 2.0, 4.0])
        for i in range(1, N):  # the parent's row favours the drafted token now and then
            if rng.random() < 0.5:
                logits[parents[i], tokens[i]] += 3.0
        q = None
        if with_q:
            q = torch.randn(N, V, generator=g).softmax(-1)
            for i in range(1, N):
                r = rng.random()
                if r < 0.1:
                    q[i] = probs_from_logits(logits[parents[i]], params)
                elif r < 0.15:
                    q[i, tokens[i]] = 0.0
                    q[i] /= q[i].sum()
        yield DraftTree(tokens, parents, q), logits


@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5),
                                    SamplingParams(temperature=1.3, top_p=0.7)])
def test_batched_verifier_equals_cpu_verifier_on_random_trees(with_q, params):
    assert _same_run(list(_random_trees(600, 12, with_q, 3, params)), params, seed=5) == 600


def test_batched_verifier_default_generator():
    """generator=None draws from the default generator, as the CPU path does."""
    tree = DraftTree([0, 1, 2, 3], [-1, 0, 0, 0])
    logits = torch.zeros(4, 12)
    params = SamplingParams(temperature=1.0)
    torch.manual_seed(0)
    a = [_verify_sampling(tree, logits, params, None) for _ in range(50)]
    torch.manual_seed(0)
    b = [_verify_sampling_batched(tree, logits, params, None) for _ in range(50)]
    assert a == b


def test_verify_refuses_generator_on_another_device():
    from specloom.verify import verify

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA for a generator on another device")
    with pytest.raises(ValueError, match="generator"):
        verify(DraftTree([0, 1], [-1, 0]), torch.zeros(2, 5), SamplingParams(temperature=1.0),
               torch.Generator(device="cuda"))


# -- device names ----------------------------------------------------------------------------------------------------

def test_parse_device():
    assert parse_device("cpu") == torch.device("cpu")
    assert parse_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "gpu", "cuda:x", "", "meta"):
        with pytest.raises(SpecloomError, match="unknown device"):
            parse_device(bad)
    if not torch.cuda.is_available():
        for name in ("cuda", "cuda:0"):
            with pytest.raises(SpecloomError, match="use --device cpu"):
                parse_device(name)
    else:
        with pytest.raises(SpecloomError, match="CUDA device"):
            parse_device(f"cuda:{torch.cuda.device_count()}")


# -- on the device (skipped without one) -----------------------------------------------------------------------------

def _available(name: str) -> bool:
    try:
        parse_device(name)
    except SpecloomError:
        return False
    return True


on_device = pytest.mark.skipif(not _available(DEVICE), reason=f"device {DEVICE!r} not available")
N = 24
PROMPTS = [[5, 6, 7, 8] * 5, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [9, 200, 17, 3, 88, 41, 7]]


@pytest.fixture(scope="module")
def dev_setup(tiny, tmp_path_factory):
    """(tiny llama on the device in fp32, its tokenizer, {kind: speculative config}); the drafters are written
    from the CPU copy and loaded onto the device by the engine."""
    from test_block_drafters import make_block, save as save_block
    from test_hidden_drafters import make_eagle

    t = tiny("llama")
    root = tmp_path_factory.mktemp("device_drafters")
    model, tok = load_target(t.path, "fp32", progress=False, device=DEVICE)
    return model, tok, {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},
        "eagle3": {"method": "eagle3", "model": make_eagle(t, str(root / "eagle3"), True, draft_vocab=200),
                   "num_speculative_tokens": 3},
        "eagle3_tree": {"method": "eagle3", "model": str(root / "eagle3"), "num_speculative_tokens": 4,
                        "tree_width": 3, "num_draft_tokens": 9},
        "dflash": {"method": "dflash", "model": save_block(t, make_block(t, False, 5), "dflash", str(root / "df"))},
        "dspark": {"method": "dspark", "model": save_block(t, make_block(t, True, 4, "vanilla", confidence=True),
                                                          "dspark", str(root / "ds"))},
    }


def _spec_engine(model, tok, spec):
    from specloom.speculative import SpeculativeConfig

    return Engine(model, tok, SpeculativeConfig.parse(spec), max_model_len=256)


@on_device
def test_target_and_drafters_on_device(dev_setup):
    from specloom.models.cpu_packing import PackedLinear

    model, tok, specs = dev_setup
    dev = parse_device(DEVICE)
    assert all(p.device.type == dev.type for p in model.parameters())
    assert model.new_kv(8).k.device.type == dev.type
    for kind in ("eagle3", "dflash", "dspark"):
        e = _spec_engine(model, tok, specs[kind])
        assert all(p.device.type == dev.type for p in e.drafter.model.parameters()), kind
        assert all(b.device.type == dev.type for b in e.drafter.model.buffers()), kind
    if dev.type == "cuda":
        assert model.kv_dtype() == torch.float32  # an fp32 model: its own dtype
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        bf, _ = load_target(model.source.path, "bf16", progress=False, device=DEVICE)
        assert bf.kv_dtype() == torch.bfloat16  # fp32 KV is the CPU's default only
        assert not any(isinstance(m, PackedLinear) for m in bf.modules())  # oneDNN packing is CPU-only


@on_device
@pytest.mark.parametrize("kind", ["ngram", "eagle3", "eagle3_tree", "dflash", "dspark"])
def test_greedy_speculative_equals_plain_on_device(dev_setup, kind):
    model, tok, specs = dev_setup
    plain = Engine(model, tok, max_model_len=256)
    e = _spec_engine(model, tok, specs[kind])
    drafted = 0
    for ids in PROMPTS:
        want = plain.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == want
        drafted += got.num_draft_tokens
    assert drafted > 0


@on_device
@pytest.mark.parametrize("kind", [None, "ngram", "eagle3_tree"])
def test_cuda_graphs_replay_the_eager_passes(dev_setup, kind, monkeypatch):
    """Single-row passes replay as CUDA graphs (models/graphs.py) on a CUDA device: the graphs are captured and
    used, and the tokens equal the eager passes' (SPECLOOM_CUDA_GRAPHS=0), plain and speculative."""
    model, tok, specs = dev_setup
    spec = None if kind is None else specs[kind]
    graphed = Engine(model, tok, max_model_len=256) if spec is None else _spec_engine(model, tok, spec)
    got = [graphed.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids for ids in PROMPTS]
    monkeypatch.setenv("SPECLOOM_CUDA_GRAPHS", "0")
    eager = Engine(model, tok, max_model_len=256) if spec is None else _spec_engine(model, tok, spec)
    want = [eager.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids for ids in PROMPTS]
    assert got == want
    if parse_device(DEVICE).type == "cuda":
        g = graphed._kv.__dict__.get("_graphs")
        assert g and not g.failed and g.runs > 0
        assert all(x.graph is not None for x in g.graphs.values())
        assert eager._kv.__dict__.get("_graphs") is False
        if kind == "eagle3_tree":  # the drafting steps too (drafters/eagle/graphed.py)
            steps = [st for c in graphed._kv._companions.values() for st in c.__dict__.get("_eagle_steps", {}).values()]
            assert steps and all(st.graph is not None and not st.failed for st in steps)


@on_device
@pytest.mark.parametrize("kind", ["ngram", "eagle3", "dflash", "dspark"])
def test_batched_greedy_equals_plain_on_device(dev_setup, kind):
    from specloom.scheduler import BatchScheduler, Sequence

    model, tok, specs = dev_setup
    plain = Engine(model, tok, max_model_len=256)
    prompts = PROMPTS + [list(range(60, 60 + n)) for n in (3, 11, 30)]
    want = [plain.generate(prompt_token_ids=p, max_tokens=N, ignore_eos=True).token_ids for p in prompts]
    sch = BatchScheduler(_spec_engine(model, tok, specs[kind]), rows=3, mode="fixed")
    try:
        seqs = [Sequence(p, N, SamplingParams(), ignore_eos=True) for p in prompts]
        sch.submit(seqs)
        got = [s.wait(300) for s in seqs]
    finally:
        sch.close()
    assert [r.token_ids for r in got] == want
    assert sum(r.num_draft_tokens for r in got) > 0


@on_device
@pytest.mark.parametrize("kind", ["ngram", "eagle3_tree", "dspark"])
def test_sampling_runs_on_device(dev_setup, kind):
    """Sampling (generator on the device, the batched verifier): seeded runs repeat, differ across seeds, and a
    seeded sequence gives the same tokens batched as alone."""
    from specloom.scheduler import BatchScheduler, Sequence

    model, tok, specs = dev_setup
    e = _spec_engine(model, tok, specs[kind])
    ids = PROMPTS[0]
    kw = dict(prompt_token_ids=ids, max_tokens=12, temperature=1.0, top_k=4, ignore_eos=True)
    alone = [e.generate(seed=s, **kw) for s in range(12)]
    assert [r.token_ids for r in alone] == [e.generate(seed=s, **kw).token_ids for s in range(12)]
    assert len({tuple(r.token_ids) for r in alone}) > 3
    assert sum(r.num_draft_tokens for r in alone) > 0
    sch = BatchScheduler(e, rows=4, mode="fixed", max_queue=100)
    try:
        seqs = [Sequence(ids, 12, SamplingParams(temperature=1.0, top_k=4, seed=s), ignore_eos=True)
                for s in range(12)]
        sch.submit(seqs)
        got = [s.wait(300) for s in seqs]
    finally:
        sch.close()
    assert [r.token_ids for r in got] == [r.token_ids for r in alone]


@on_device
@pytest.mark.parametrize("case", ["chain_sampled", "siblings_without_replacement", "siblings_fixed"])
def test_verifier_distribution_on_device(case):
    """On the device the verifier draws a level's uniforms in one call from the device's generator (a different
    stream than the CPU's): its output is still distributed as the target's own sampling (test_verify's harness,
    20 000 samples, the total-variation bound scaled to that n; chi-square at significance 1e-4, since these nine
    fits run on a stream no seed here can pin)."""
    import test_verify as tv
    from specloom.verify import verify

    dev = parse_device(DEVICE)
    params = tv.T07_P08 if case != "siblings_fixed" else tv.T1
    g = SamplingParams(seed=1).generator(dev)

    def on_device(tree, logits, params, _cpu_generator):
        q = None if tree.draft_probs is None else tree.draft_probs.to(dev)
        return verify(DraftTree(tree.tokens, tree.parents, q), logits.to(dev), params, g)

    n = 20_000
    m, s = tv.sample(on_device, tv.CASES[case], params, n, seed=1)
    for name, f in tv.fits(m, tv.CASES[case], s).items():
        assert not f.impossible, f"{name}: tokens of probability 0 were emitted: {f}"
        assert f.chi2 <= tv.chi2_critical(f.dof, 1e-4), f"{name}: chi-square rejects at 1e-4: {f}"
        assert f.tv <= tv.TV_MAX * (tv.N_SAMPLES / n) ** 0.5, f"{name}: total variation too large: {f}"
