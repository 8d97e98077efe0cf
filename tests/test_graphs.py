"""The static pass behind CUDA graphs (models/graphs.py), checked on the CPU where it runs eagerly.

A replayed pass writes its keys/values with `index_copy_` at a slot held in a device tensor and attends over the
row's whole store with a mask built on the device. Run eagerly on the CPU, it must give what the ordinary pass
gives: the same logits (to fp32 rounding) for a causal and a tree-masked pass, and the very same greedy tokens,
plain and speculative (a chain drafter and an EAGLE-3 tree), with every single-row step going through it. The
capture itself needs a GPU: tests/test_cuda.py runs these comparisons there with graphs on and off.
"""

import pytest
import torch

from specloom import Engine
from specloom.loading import load_target
from specloom.models.graphs import GraphedPasses, StaticPass
from specloom.speculative import SpeculativeConfig


@pytest.fixture(scope="module")
def setup(tiny, tmp_path_factory):
    from test_hidden_drafters import make_eagle

    t = tiny("llama")
    model, tok = load_target(t.path, "fp32", progress=False)
    eagle = make_eagle(t, str(tmp_path_factory.mktemp("graphs") / "eagle3"), True, draft_vocab=200)
    return model, tok, {
        "ngram": {"method": "ngram", "num_speculative_tokens": 3},
        "eagle3_tree": {"method": "eagle3", "model": eagle, "num_speculative_tokens": 3, "tree_width": 3,
                        "num_draft_tokens": 7},
    }


PROMPTS = [[5, 6, 7, 8] * 5, [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52], [9, 200, 17, 3, 88, 41, 7]]


def _static(engine) -> GraphedPasses:
    """Route the engine's single-row passes through the static pass, run eagerly (the store is made big enough
    that the engine keeps it)."""
    kv = engine._kv_for(512)
    g = kv.__dict__["_graphs"] = GraphedPasses(engine.model, kv, capture=False)
    return g


@torch.inference_mode()
def test_static_pass_logits_equal_the_ordinary_pass(setup):
    model, _, _ = setup
    kv = model.new_kv(64)
    ids = torch.tensor([[5, 9, 11, 30, 2, 7, 8, 41, 3, 17]])
    model(ids, torch.arange(10)[None], kv)
    kv.commit()
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    toks, pos = torch.tensor([[12, 40, 41, 42]]), torch.tensor([[10, 11, 11, 12]])
    for mask in (None, tree):
        want = model(toks, pos, kv.begin([0], [4]), attn_mask=mask).logits
        p = kv.begin([0], [4])
        g = GraphedPasses(model, kv, capture=False)
        assert g.applies(p, mask)
        got = g.run(toks, pos, p, mask).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        kv.truncate(10)
    # the static pass wrote the same keys/values at the same slots as the ordinary one
    kv.begin([0], [4])
    model(toks, pos, kv.begin([0], [4]), attn_mask=tree)
    k_ref = kv.k[:, 0, :, 10:14].clone()
    kv.truncate(10)
    p = kv.begin([0], [4])
    GraphedPasses(model, kv, capture=False).run(toks, pos, p, tree)
    torch.testing.assert_close(kv.k[:, 0, :, 10:14], k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(kv.slot_pos[0, 10:14], pos[0])


def test_what_the_static_pass_takes(setup):
    model, _, _ = setup
    kv = model.new_kv(64, batch=2)
    g = GraphedPasses(model, kv, capture=False)
    assert not g.applies(kv.begin([0, 1], [2, 2]), None)  # two rows: eager
    kv.reset()
    assert g.applies(kv.begin([1], [3]), None)
    kv.reset()
    assert not g.applies(kv.begin([1], [40]), None)  # wider than MAX_WIDTH
    kv.reset()
    assert not g.applies(kv.begin([0], [3]), torch.ones(3, 5, dtype=torch.bool))  # a mask over earlier slots
    with pytest.raises(ValueError, match="static pass of 2 entries"):
        StaticPass(kv, 0, 2, torch.zeros(1, dtype=torch.long)).open(3)


@pytest.mark.parametrize("kind", [None, "ngram", "eagle3_tree"])
def test_generation_through_the_static_pass_equals_eager(setup, kind):
    model, tok, specs = setup
    spec = None if kind is None else SpeculativeConfig.parse(specs[kind])
    eager = Engine(model, tok, spec, max_model_len=256)
    static = Engine(model, tok, spec, max_model_len=256)
    g = _static(static)
    drafted = 0
    for ids in PROMPTS:
        want = eager.generate(prompt_token_ids=ids, max_tokens=24, ignore_eos=True)
        got = static.generate(prompt_token_ids=ids, max_tokens=24, ignore_eos=True)
        assert got.token_ids == want.token_ids
        drafted += got.num_draft_tokens
    assert g.runs >= len(PROMPTS) * 23 / (4 if kind else 1)  # every step after prefill went through it
    assert (drafted > 0) == (kind is not None)
    assert len({key[1] for key in g.graphs}) >= (2 if kind else 1)  # widths seen


def test_eagle_step_through_the_static_path_drafts_the_eager_trees(setup):
    """The EAGLE tree step a CUDA graph replays (drafters/eagle/graphed.py), run eagerly on the CPU: catch-up,
    every expansion depth (masks over earlier depths' rows) and the rerank on static passes give the very trees
    the eager step drafts, step for step, and the drafter store's books end where the eager step leaves them."""
    from specloom.drafters.eagle import graphed

    model, tok, specs = setup
    spec = SpeculativeConfig.parse(specs["eagle3_tree"])
    eager, static = Engine(model, tok, spec, max_model_len=256), Engine(model, tok, spec, max_model_len=256)
    trees = {"eager": [], "static": []}
    used = [0]

    def record(engine, name, fn):
        def propose(ctxs):
            out = fn(ctxs)
            trees[name].append([(t.tokens, t.parents) for t in out])
            return out
        engine.drafter.propose = propose

    def static_propose(ctxs):
        if len(ctxs) == 1:
            out = graphed.propose(static.drafter, ctxs[0], capture_graphs=False)
            if out is not None:
                used[0] += 1
                return out
        return type(static.drafter).propose(static.drafter, ctxs)

    record(eager, "eager", eager.drafter.propose)
    record(static, "static", static_propose)
    for ids in PROMPTS:
        a = eager.generate(prompt_token_ids=ids, max_tokens=24, ignore_eos=True)
        b = static.generate(prompt_token_ids=ids, max_tokens=24, ignore_eos=True)
        assert a.token_ids == b.token_ids
        assert trees["static"] == trees["eager"]
    # every step but a catch-up over a whole prompt longer than M_MAX (the first after prefill) went static
    assert used[0] >= len(trees["static"]) - sum(len(p) > graphed.M_MAX for p in PROMPTS) > 10
    assert any(len(t[0][0]) > 4 for t in trees["static"])  # trees deeper than one level were drafted
