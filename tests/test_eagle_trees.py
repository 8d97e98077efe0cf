"""EAGLE-2 tree construction (drafters/eagle/drafter.py): the tensor rerank equals the reference list rerank on
random candidate sets with ties; stopping the expansion early (once no deeper candidate can enter a tree) gives
the same trees with fewer drafter passes; batched drafting gives every row the tree it gets alone (rows with
different depth caps and node budgets, EAGLE-1, EAGLE-3 and MTP); the EAGLE-3 head drafts over the draft
vocabulary only; stacked q/k/v and gate/up projections compute what the separate ones do."""

import random
import shutil
import warnings

import pytest
import torch

import specloom
from specloom import Engine
from specloom.drafters.checkpoint import specloom_meta
from specloom.drafters.eagle.drafter import EagleDrafter
from specloom.drafters.eagle.model import EagleDraftModel, eagle_config_for, init_weights
from specloom.drafters.mtp.format import save_into_target
from specloom.sampling import SamplingParams
from specloom.speculative import SpeculativeConfig
from specloom.step import Request, StepPlan, Stepper
from specloom.kv import TREE_SLACK
from test_hidden_drafters import make_eagle
from test_mtp import random_mtp

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
           [9, 200, 13, 77, 77, 3, 150, 21]]


# -- the rerank ------------------------------------------------------------------------------------------------
def reference_select(tokens, scores, parents, depth_of, k, budget):
    """The list rerank the tensor one replaced: the best `budget` candidates no deeper than k (ties: lower id),
    in id order, parents renumbered."""
    ids = [i for i in range(len(depth_of)) if depth_of[i] <= k]
    keep = sorted(sorted(ids, key=lambda i: (-scores[i], i))[:budget])
    node_of = {i: j + 1 for j, i in enumerate(keep)}
    return [tokens[i] for i in keep], [0 if parents[i] < 0 else node_of[parents[i]] for i in keep]


def random_candidates(rng, w, K):
    """An EAGLE-2 candidate set: w children per frontier node, the frontier the best w new candidates, scores
    falling along paths (log-probs rounded so that ties occur, some exactly 0)."""
    toks, scores, parents, depth_of = [], [], [], []

    def lp():
        return -round(rng.choice([0.0, 0.0, rng.random() * 3]), 1)

    for _ in range(w):
        toks.append(rng.randrange(1000)), scores.append(lp()), parents.append(-1), depth_of.append(1)
    frontier = list(range(w))
    for d in range(2, K + 1):
        first = len(toks)
        for f in frontier:
            for _ in range(w):
                toks.append(rng.randrange(1000)), scores.append(scores[f] + lp()), parents.append(f)
                depth_of.append(d)
        new = list(range(first, len(toks)))
        frontier = sorted(new, key=lambda i: (-scores[i], i))[:w]
    return toks, scores, parents, depth_of


def test_tensor_rerank_equals_reference():
    rng = random.Random(0)
    for trial in range(200):
        w, K = rng.randint(1, 4), rng.randint(1, 5)
        rows = [random_candidates(rng, w, K) for _ in range(rng.randint(1, 4))]
        ks = [rng.randint(1, K) for _ in rows]
        budgets = [rng.randint(1, 12) for _ in rows]
        depth_of = torch.tensor(rows[0][3])
        N = len(depth_of)
        toks = torch.tensor([r[0] for r in rows])
        # every row shares the candidate layout (depths); only tokens, scores and parents differ
        scores = torch.tensor([r[1] for r in rows], dtype=torch.float32)
        parents = torch.tensor([r[2] for r in rows])
        valid = depth_of[None] <= torch.tensor(ks)[:, None]
        n_keep = [min(b, sum(1 for d in rows[0][3] if d <= k)) for b, k in zip(budgets, ks)]
        ctxs = [type("C", (), {"tokens": [7]})() for _ in rows]
        trees = EagleDrafter._select(ctxs, toks, scores, parents, valid, n_keep)
        for r, k, b, tree in zip(rows, ks, budgets, trees):
            want_t, want_p = reference_select(r[0], r[1], r[2], r[3], k, b)
            assert tree.tokens == [7, *want_t] and tree.parents == [-1, *want_p], (trial, N)


# -- trees of real drafters: early stop, batched = alone ---------------------------------------------------------
@pytest.fixture(scope="module")
def specs(tiny, tmp_path_factory):
    t = tiny("llama")
    root = tmp_path_factory.mktemp("eagle_trees")
    mtp_dir = str(root / "target_with_mtp")
    shutil.copytree(t.path, mtp_dir)
    save_into_target(random_mtp(t, 2), mtp_dir, specloom_meta("mtp", t.model, t.tokenizer, (3,)),
                     dtype=torch.float32)
    return t, {
        "eagle": {"method": "eagle", "model": make_eagle(t, str(root / "eagle"), False),
                  "num_speculative_tokens": 4, "tree_width": 3, "num_draft_tokens": 7},
        "eagle3": {"method": "eagle3", "model": make_eagle(t, str(root / "eagle3"), True, draft_vocab=200),
                   "num_speculative_tokens": 5, "tree_width": 3, "num_draft_tokens": 8},
        "mtp": {"method": "mtp", "model": mtp_dir, "num_speculative_tokens": 4, "tree_width": 2,
                "num_draft_tokens": 5},
    }


def make_engine(t, spec, sharpen: float = 1.0):
    if spec["method"] == "mtp":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            e = specloom.load(spec["model"], spec, dtype="fp32", progress=False, speculation="fixed")
        e.model, e.tokenizer = t.model, t.tokenizer  # the same target weights (the drafter reads its features)
    else:
        e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(spec), max_model_len=256)
    d = e.drafter
    orig = d._logits
    if sharpen > 1:  # a confident drafter: peaked scores, deep trees
        d._logits = lambda h, depth: orig(h, depth) * sharpen
    elif sharpen < 1:  # an unsure one: logits scaled to at most `sharpen`, nearly uniform scores
        d._logits = lambda h, depth: (lambda x: x / x.abs().amax(-1, keepdim=True) * sharpen)(orig(h, depth))
    return e


def trees_of(engine, prompts, ks, budgets, steps, batched):
    """Trees each row drafts over `steps` speculative steps: all rows in one pool (batched) or each alone."""
    d = engine.drafter
    passes = [0]
    rows_fn = d._rows

    def counted(*a, **k):
        passes[0] += 1
        return rows_fn(*a, **k)

    d._rows = counted
    groups = []
    if batched:
        pool = engine.model.new_kv(256 + TREE_SLACK, batch=len(prompts), active=0)
        st = Stepper(engine.model, d, pool, engine.tokenizer)
        groups.append((st, [st.new_row(Request(p, 40, SamplingParams(), ignore_eos=True), pool.allocate())
                            for p in prompts], list(range(len(prompts)))))
    else:
        for i, p in enumerate(prompts):
            st = Stepper(engine.model, d, engine.model.new_kv(256 + TREE_SLACK), engine.tokenizer)
            groups.append((st, [st.new_row(Request(p, 40, SamplingParams(), ignore_eos=True), 0)], [i]))
    out = {i: [] for i in range(len(prompts))}
    try:
        for st, rows, _ in groups:
            for r in rows:
                while r.prefilled < len(r.req.ids):
                    st.prefill(r, 10 ** 9)
        for _ in range(steps):
            for st, rows, idx in groups:
                rep = st.step(rows, StepPlan([ks[i] for i in idx], [budgets[i] for i in idx]))
                for tree, i in zip(rep.trees, idx):
                    out[i].append((tree.tokens, tree.parents))
    finally:
        d._rows = rows_fn
    return out, passes[0]


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "mtp"])
@pytest.mark.parametrize("sharpen", [0.5, 1.0, 8.0])
def test_batched_trees_equal_alone_and_early_stop_exact(specs, kind, sharpen):
    t, spec = specs
    e = make_engine(t, spec[kind], sharpen)
    K = e.drafter.num_speculative_tokens
    ks, budgets = [K, 2, K], [None, 3, None]  # a row capped in depth, one with a smaller node budget
    got = {}
    for early in (True, False):
        e.drafter.early_stop = early
        for batched in (True, False):
            got[early, batched] = trees_of(e, PROMPTS, ks, budgets, steps=6, batched=batched)
    ref = got[False, False][0]
    assert all(len(v) == 6 for v in ref.values())
    for key, (trees, _) in got.items():
        assert trees == ref, key
    assert max(len(tok) for v in ref.values() for tok, _ in v) > 2, "no tree drafted"
    assert got[True, False][1] <= got[False, False][1]
    if sharpen < 1:  # an unsure drafter: deep candidates cannot beat shallow ones, the expansion stops early
        assert got[True, False][1] < got[False, False][1]


def test_early_stop_output_identical_to_plain(specs):
    t, spec = specs
    e = make_engine(t, spec["eagle3"])
    e.drafter.early_stop = True
    for ids in PROMPTS:
        want = Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=23, ignore_eos=True)
        got = e.generate(prompt_token_ids=ids, max_tokens=23, ignore_eos=True)
        assert got.token_ids == want.token_ids


# -- the head and the stacked projections ------------------------------------------------------------------------
def test_eagle3_drafts_over_the_draft_vocabulary(specs):
    t, spec = specs
    e = make_engine(t, spec["eagle3"])
    m = e.drafter.model
    V, Vd = t.model.config.vocab_size, m.config.draft_vocab_size
    assert Vd == 200 < V
    assert m.lm_head.weight.shape == (Vd, m.config.hidden_size)  # only the draft-vocabulary rows
    with torch.inference_mode():
        logits = e.drafter._logits(torch.randn(5, m.config.hidden_size), 0)
        assert logits.shape == (5, Vd)
        ids = m.to_target_ids(logits.topk(4, -1).indices)
        assert bool(m.t2d[ids].all()) and int(ids.max()) < V


def _layer_inputs(cfg, T, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, T, cfg.hidden_size, generator=g).to(dtype), torch.randint(0, 200, (1, T), generator=g),
            torch.arange(T)[None])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_stacked_projections_match_separate(tiny, dtype):
    from specloom.models.cpu_packing import pack_linears, packing_supported

    t = tiny("llama")
    cfg = eagle_config_for(t.model.config, True, (1, 2, 3), 200)
    m = EagleDraftModel(cfg)
    init_weights(m, 0, std=0.3)
    m = m.to(dtype)
    m.attach_target(t.model)
    pack_linears(m)
    u, toks, pos = _layer_inputs(cfg, 6, dtype)
    outs = []
    with torch.inference_mode():
        for stacked in (False, True):
            if stacked:
                m.stack_projections()
            kv = m.new_kv(16)
            outs.append(m(u, toks, pos, kv))
            kv.commit()
    assert m.layers[0].self_attn.__dict__.get("_qkv") is not None
    if dtype == torch.bfloat16 and packing_supported(dtype, "cpu"):
        assert torch.equal(outs[0], outs[1])  # the packed bf16 kernel: bit-identical products
    else:
        torch.testing.assert_close(outs[0], outs[1])
    # training (outside inference mode) uses the separate linears: gradients reach them
    m2 = EagleDraftModel(cfg)
    init_weights(m2, 0, std=0.3)
    m2.attach_target(t.model)
    m2.stack_projections()
    feats = torch.randn(1, 5, 3 * cfg.hidden_size)
    h = next(iter(m2.ttt_forward(feats, torch.randint(0, 200, (1, 5)), torch.ones(1, 5, dtype=torch.bool), 1)))[1]
    h.sum().backward()
    assert m2.layers[0].self_attn.q_proj.weight.grad is not None
    assert m2.layers[0].mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize("eagle3", [True, False])
def test_fused_drafter_layer_computes_the_layer(tiny, eagle3, monkeypatch):
    """Where a bf16 drafter drafts from Q8_0 weights, its layer runs as one C call (the target's decoder-stack
    kernel with the attention's input given): the same layer as the PyTorch path (whose attention is SDPA's, so
    close, not bit for bit) on a causal catch-up pass, a decode row and a tree-masked pass; it does run."""
    from specloom.models import fused_stack, ggml_linear

    if not ggml_linear.repacked_path():
        pytest.skip("this CPU lacks AVX512-BF16: drafters stay bf16")
    t = tiny("llama")
    cfg = eagle_config_for(t.model.config, eagle3, (1, 2, 3) if eagle3 else (t.model.config.num_layers,), 200)
    m = EagleDraftModel(cfg)
    init_weights(m, 0, std=0.3)
    m = m.bfloat16()
    m.attach_target(t.model)
    from specloom.models.cpu_packing import pack_linears

    pack_linears(m)
    m.stack_projections()
    assert m.__dict__.get("_fused") is not None
    torch.nn.Linear(4, 4)  # a weight registered anywhere else must not turn the fused layer off (it once did)
    ran, real = [], fused_stack.run_layer
    monkeypatch.setattr(fused_stack, "run_layer", lambda *a: ran.append(real(*a)) or ran[-1])
    g = torch.Generator().manual_seed(1)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    passes = [(6, None), (1, None), (3, mask)]
    outs = {}
    for fused in (True, False):
        if not fused:
            m.__dict__["_fused"] = None
        kv, pos, outs[fused] = m.new_kv(32), 0, []
        g.manual_seed(1)
        with torch.inference_mode():
            for T, am in passes:
                u = torch.randn(1, T, cfg.hidden_size, generator=g).bfloat16()
                toks = torch.randint(0, 200, (1, T), generator=g)
                p = kv.begin([0], [T])
                outs[fused].append(m(u, toks, torch.arange(pos, pos + T)[None], p, attn_mask=am))
                kv.commit()
                pos += T
    assert len(ran) == 3 and all(r is not None for r in ran)
    for a, b in zip(outs[True], outs[False]):
        assert a.shape == b.shape and a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=0.05, atol=0.05 * b.abs().max().item())


# -- the tree-shape replay (shape.py) prices shapes exactly as the drafter builds them --------------------------
def _walk(tree, truth):
    """Drafts of `tree` greedy verification accepts when the target continues with `truth`."""
    cur, n = 0, 0
    for tok in truth:
        kids = [i for i in tree.children(cur) if tree.tokens[i] == tok]
        if not kids:
            break
        cur, n = kids[0], n + 1
    return n


def test_shape_replay_matches_the_drafter(specs):
    from specloom.bench import eagle_shape as shape

    t, spec = specs
    e = make_engine(t, spec["eagle3"])
    d = e.drafter
    ids = PROMPTS[1]
    seq = ids + Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True).token_ids
    K = 4
    rp = shape._Replay(e, seq, len(ids), K)
    checked = 0
    for n in range(len(seq) - 1 - K, len(ids) - 1, -4):
        truth = seq[n + 1:n + 1 + K]
        for w in (1, 2, 3):
            cand = rp.expand(n, w, K)
            rec = shape._record(cand, truth, w, K)
            for depth in range(1, K + 1):
                for nodes in (1, 2, 3, 5, 8):
                    tree = d._select([rp.ctx], cand.tokens, cand.scores, cand.parents, cand.valid([depth]),
                                     cand.n_keep([depth], [nodes]))[0]
                    assert shape._accepted(rec, depth, nodes) == _walk(tree, truth), (n, w, depth, nodes)
                    # the passes an early-stopping expansion runs for this shape, counted offline
                    assert rp.expand(n, w, depth, budget=nodes).passes == shape._passes(rec, depth, nodes)
                    checked += 1
    assert checked > 100


def test_shape_choice_takes_the_cheapest_within_one_standard_error():
    from specloom.bench.eagle_shape import choose

    def row(name, cost, taus):
        return {"name": name, "verify_cost": cost, "draft_cost": 0.0, "tau_by_prompt": dict(enumerate(taus)),
                "predicted_speedup": sum(taus) / len(taus) / cost}

    best = row("best", 1.2, [2.0, 2.4, 1.6, 2.0])
    close = row("close, cheaper", 1.1, [1.8, 2.3, 1.35, 1.85])  # worse by less than its paired spread
    far = row("far, cheapest", 1.0, [1.2, 1.3, 1.1, 1.2])  # worse everywhere
    table = sorted([far, close, best], key=lambda r: -r["predicted_speedup"])
    assert table[0] is best
    assert choose(table)["name"] == "close, cheaper"
    assert choose([best, far])["name"] == "best"
