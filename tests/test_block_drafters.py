"""Block drafters (DFlash, DFlash 2, DSpark) on a tiny random fp32 target: random-init drafters give output identical to
plain greedy decoding (Markov heads vanilla / gated / rnn, confidence head, a truncating threshold); "oracle" slots
that predict the true continuation are all accepted (tau = drafts + 1); temperature sampling matches plain
sampling; every checkpoint layout round-trips (z-lab, speculators dflash/dspark, DeepSpec, built into a target HF
directory, bundled overlay); bad settings and files fail clearly; `specloom train dflash|dspark` smoke test."""

import json
import os
import random
import shutil

import pytest
import torch

import specloom
from specloom import Engine, SpecloomError
from specloom.drafters import DRAFTERS
from specloom.drafters.block.format import add_to_target_dir
from specloom.drafters.block.model import BlockDraftConfig, BlockDraftModel
from specloom.drafters.checkpoint import save_drafter, specloom_meta
from specloom.drafters.eagle.model import init_weights
from specloom.speculative import SpeculativeConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
N = 29
IDS = (1, 2, 3)  # HF hidden_states ids of the 3-layer tiny target (z-lab ids 0, 1, 2)


def make_block(t, dspark: bool, block: int, markov: str | None = None, layers: int = 2, seed: int = 0,
               confidence: bool = False, dflash2: bool = False) -> BlockDraftModel:
    c = t.model.config
    cfg = BlockDraftConfig(
        hidden_size=c.hidden_size, num_layers=layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
        head_dim=c.head_dim, intermediate_size=96, vocab_size=c.vocab_size, block_size=block, mask_token_id=3,
        feature_ids=IDS, target_hidden_size=c.hidden_size, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        anchor_predicts=dspark, markov_rank=8 if markov else 0, markov_head_type=markov or "vanilla",
        confidence_head=confidence,
        **(dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6) if dflash2 else {}))
    m = BlockDraftModel(cfg)
    init_weights(m, seed, std=0.3)
    m.attach_target(t.model)
    return m


def save(t, m, kind, path, **kw):
    save_drafter(kind, m, path, specloom_meta(kind, t.model, t.tokenizer, m.config.feature_ids),
                 dtype=torch.float32, **kw)
    return path


@pytest.fixture(scope="module")
def blocks(tiny, tmp_path_factory):
    t = tiny("llama")
    root = tmp_path_factory.mktemp("blocks")
    return t, {
        "dflash": save(t, make_block(t, False, 5), "dflash", str(root / "dflash")),
        "dspark": save(t, make_block(t, True, 4, "vanilla", confidence=True), "dspark", str(root / "dspark")),
        "dspark_gated": save(t, make_block(t, True, 4, "gated", seed=1), "dspark", str(root / "gated"),
                             fmt="speculators"),
        "dspark_rnn": save(t, make_block(t, True, 3, "rnn", seed=2, confidence=True), "dspark", str(root / "rnn")),
        # random convs and selector (not their neutral start): every part of DFlash 2 shapes the drafts
        "dflash2": save(t, make_block(t, False, 5, seed=3, dflash2=True), "dflash2", str(root / "dflash2")),
    }


def plain(t, ids, **kw):
    return Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True, **kw)


def engine(t, path, method, **extra):
    return Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": method, "model": path, **extra}))


CASES = [
    ("dflash", {}),
    ("dflash", {"num_speculative_tokens": 2}),
    ("dspark", {}),
    ("dspark_gated", {}),
    ("dspark_rnn", {}),
    ("dflash2", {}),
    ("dflash2", {"num_speculative_tokens": 2}),
    # trees from the slots' top-w (a beam over joint scores within the node budget)
    ("dflash", {"tree_width": 3, "num_draft_tokens": 9}),
    ("dspark_rnn", {"tree_width": 2, "num_draft_tokens": 5}),
    ("dspark_gated", {"tree_width": 4}),
    ("dflash2", {"tree_width": 3, "num_draft_tokens": 10}),
]


@pytest.mark.parametrize("name,extra", CASES)
def test_random_drafter_identical(blocks, name, extra):
    t, paths = blocks
    e = engine(t, paths[name], name.split("_")[0], **extra)
    for ids in PROMPTS:
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == plain(t, ids).token_ids
        assert got.num_target_passes <= N
        assert got.num_draft_tokens > 0
    mem, c = e.drafter.memory(), e.drafter.model.config  # own tensors only (the target's embedding/head are shared)
    assert mem["weights"] == sum(p.numel() * 4 for p in e.drafter.model.parameters())
    assert mem["kv_per_1k_tokens"] == 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * 1000


def test_confidence_threshold_truncates(blocks):
    t, paths = blocks
    full = engine(t, paths["dspark"], "dspark")
    cut = engine(t, paths["dspark"], "dspark", confidence_threshold=0.9)
    for ids in PROMPTS:
        a = full.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        b = cut.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert a.token_ids == b.token_ids == plain(t, ids).token_ids
        assert 0 < b.num_draft_tokens < a.num_draft_tokens, (a.num_draft_tokens, b.num_draft_tokens)


def test_confidence_cut_is_non_anticipating(blocks, monkeypatch):
    """DSpark paper, Appendix A: target p = (.7, .3), draft q = (.5, .5). A cut decided after seeing the drafted
    token (drop the draft when it is token 1) makes the output (.85, .15); a cut decided before the token is drawn
    leaves it p = (.7, .3). Monte Carlo through the real verifier (the test can fail: the retrospective rule does),
    then the DSpark drafter's order: each slot's confidence is computed from the token chosen before it, before
    that slot's own token is drawn."""
    from specloom.drafters.block import drafter as block_drafter
    from specloom.sampling import SamplingParams
    from specloom.tree import DraftTree
    from specloom.verify import verify

    p_logits = torch.log(torch.tensor([[0.7, 0.3], [0.5, 0.5]]))
    q = torch.tensor([[0.5, 0.5]])
    params = SamplingParams(temperature=1.0, rule="rejection")
    g = torch.Generator().manual_seed(0)

    def first_token_share(retrospective: bool, n: int = 20000) -> float:
        zeros = 0
        for _ in range(n):
            x = int(torch.multinomial(q[0], 1, generator=g))
            keep = x == 0 if retrospective else bool(torch.rand((), generator=g) < 0.5)
            tree = DraftTree.chain(0, [x], q) if keep else DraftTree.chain(0, [])
            zeros += verify(tree, p_logits[:len(tree)], params, g).tokens[0] == 0
        return zeros / n

    assert abs(first_token_share(False) - 0.7) < 0.015
    assert abs(first_token_share(True) - 0.85) < 0.015
    # the drafter: confidence of slot p from the token of slot p - 1 (the root first), before slot p is drawn
    t, paths = blocks
    e = engine(t, paths["dspark"], "dspark", confidence_threshold=0.3)
    m = e.drafter.model
    events = []
    conf = m.confidence_logit
    m.confidence_logit = lambda h, prev: events.append(("conf", prev.tolist())) or conf(h, prev)
    real_draw = block_drafter.draw

    def spy_draw(*a, **k):
        out = real_draw(*a, **k)
        events.append(("draw", list(out)))
        return out

    monkeypatch.setattr(block_drafter, "draw", spy_draw)
    propose = e.drafter.propose
    e.drafter.propose = lambda ctxs: events.append(("step", [c.tokens[-1] for c in ctxs])) or propose(ctxs)
    e.generate(prompt_token_ids=PROMPTS[0], max_tokens=10, ignore_eos=True, temperature=1.0, seed=3)
    steps = 0
    for a, b in zip(events, events[1:]):
        if b[0] == "step":
            continue
        assert (a[0], b[0]) in {("step", "conf"), ("conf", "draw"), ("draw", "conf")}, (a, b)
        if b[0] == "conf":  # reads the root (a step's first slot) or the token just drawn
            assert b[1] == a[1], (a, b)
            steps += a[0] == "step"
    assert steps >= 2


class _Oracle:
    """Every drafted slot j of a step with root position n scores the true token x_{n+1+j} far above the rest."""

    def __init__(self, drafter, truth):
        d, self.truth = drafter, truth
        orig = d.propose

        def propose(ctxs):
            self.n = len(ctxs[0].tokens) - 1
            return orig(ctxs)

        def draft_logits(h):  # h (rows, slots, H)
            out = torch.zeros(*h.shape[:-1], 256)
            for j in range(h.shape[-2]):
                out[..., j, truth[min(self.n + 1 + j, len(truth) - 1)]] = 100.0
            return out

        d.propose = propose
        d.model.draft_logits = draft_logits


@pytest.mark.parametrize("name,extra", [("dflash", {}), ("dspark", {}), ("dspark_rnn", {}), ("dflash2", {}),
                                        ("dflash", {"tree_width": 3}), ("dflash2", {"tree_width": 2})])
def test_oracle_all_accepted(blocks, name, extra):
    t, paths = blocks
    for ids in PROMPTS:
        truth = ids + plain(t, ids).token_ids
        e = engine(t, paths[name], name.split("_")[0], **extra)
        _Oracle(e.drafter, truth)
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == truth[len(ids):]
        k = e.drafter.num_speculative_tokens
        if not extra:  # a chain: every draft accepted (a tree also drafts siblings that lose)
            assert got.num_accepted_tokens == got.num_draft_tokens
        assert got.mean_accepted_length == pytest.approx(k + 1, rel=0.15)


@pytest.mark.parametrize("name,extra", [("dflash", {}), ("dspark_gated", {}), ("dflash2", {}),
                                        ("dflash2", {"tree_width": 3, "num_draft_tokens": 8})])
def test_sampling_distribution(blocks, name, extra, sampling_tv):
    t, paths = blocks
    e = engine(t, paths[name], name.split("_")[0], **extra)
    tv = sampling_tv(e, Engine(t.model, t.tokenizer), PROMPTS[0])
    assert tv < 0.12, tv


def _same(a: BlockDraftModel, b: BlockDraftModel):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k].float(), sb[k].float()), k
    assert a.config.to_dict() == b.config.to_dict()


def test_formats_round_trip(blocks, tmp_path):
    from safetensors.torch import load_file, save_file

    t, paths = blocks
    src = engine(t, paths["dflash"], "dflash").drafter.model
    raw = json.load(open(os.path.join(paths["dflash"], "config.json")))
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["dflash_config"]["target_layer_ids"] == [0, 1, 2]
    assert raw["num_hidden_layers"] == 2 and raw["num_target_layers"] == 3 and "embed_tokens.weight" not in \
        load_file(os.path.join(paths["dflash"], "model.safetensors"))
    out = save(t, src, "dflash", str(tmp_path / "dflash_spec"), fmt="speculators")
    raw = json.load(open(os.path.join(out, "config.json")))
    assert raw["speculators_model_type"] == "dflash" and raw["aux_hidden_state_layer_ids"] == [1, 2, 3]
    _same(src, engine(t, out, "dflash").drafter.model)

    ds = engine(t, paths["dspark_rnn"], "dspark").drafter.model
    for fmt in ("speculators", "overlay"):
        out = save(t, ds, "dspark", str(tmp_path / f"dspark_{fmt}"), fmt=fmt)
        _same(ds, engine(t, out, "dspark").drafter.model)
    # DeepSpec layout: top-level Qwen3 keys, decoder-layer-output ids, frozen embed/head copies (ignored)
    spec_dir = str(tmp_path / "dspark_speculators")
    sd = load_file(os.path.join(spec_dir, "model.safetensors"))
    sd["embed_tokens.weight"] = torch.zeros(256, 64)
    sd["lm_head.weight"] = torch.zeros(256, 64)
    sr = json.load(open(os.path.join(spec_dir, "config.json")))
    deep = {"architectures": ["Qwen3DSparkModel"], **sr["transformer_layer_config"], "num_target_layers": 3,
            "block_size": 3, "mask_token_id": 3, "target_layer_ids": [0, 1, 2], "markov_rank": 8,
            "markov_head_type": "rnn", "enable_confidence_head": True, "confidence_head_with_markov": True}
    os.makedirs(tmp_path / "deepspec")
    save_file(sd, str(tmp_path / "deepspec" / "model.safetensors"))
    json.dump(deep, open(tmp_path / "deepspec" / "config.json", "w"))
    _same(ds, engine(t, str(tmp_path / "deepspec"), "dspark").drafter.model)


def test_dflash2_checkpoint_and_selector(blocks, tmp_path):
    """The z-lab DFlash 2 layout round-trips; its drafts are the selector's: every draft lies in its slot's top-k
    of the unrescored logits, and q (sampling) is supported on those k only; a checkpoint without its selector,
    or served as the wrong kind, fails with one clear line."""
    from safetensors.torch import load_file, save_file

    t, paths = blocks
    d2 = engine(t, paths["dflash2"], "dflash2").drafter
    raw = json.load(open(os.path.join(paths["dflash2"], "config.json")))
    assert raw["architectures"] == ["DFlash2DraftModel"]
    dc = raw["dflash_config"]
    assert (dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_rank"], dc["selector_top_k"]) == (2, 16, 8, 6)
    sd = load_file(os.path.join(paths["dflash2"], "model.safetensors"))
    assert sd["candidate_selector.predecessor_codebook"].shape == (256, 8)  # stored without `.weight`
    assert sd["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 64 // 16, 64)
    again = save(t, d2.model, "dflash2", str(tmp_path / "again"))
    _same(d2.model, engine(t, again, "dflash2").drafter.model)
    # the drafts are the selector's choice among the top-k, and q lives on them
    m = d2.model
    seen = []
    orig = m.candidate_selector.full

    def spy(logits, h, prev, **kw):
        out = orig(logits, h, prev, **kw)
        seen.append((logits.topk(6, -1).indices, out))
        return out

    m.candidate_selector.full = spy
    e = engine(t, paths["dflash2"], "dflash2")
    e.drafter.model.candidate_selector.full = spy
    e.generate(prompt_token_ids=PROMPTS[0], max_tokens=8, ignore_eos=True, temperature=0.8, seed=1)
    assert seen
    for top, full in seen:
        finite = torch.isfinite(full)
        assert (finite.sum(-1) == 6).all()
        assert torch.equal(finite.nonzero()[:, -1].view(top.shape).sort(-1).values, top.sort(-1).values)
    # incomplete and mismatched checkpoints
    bad = tmp_path / "no_selector"
    shutil.copytree(paths["dflash2"], bad)
    sd = {k: v for k, v in load_file(str(bad / "model.safetensors")).items() if not k.startswith("candidate_")}
    save_file(sd, str(bad / "model.safetensors"))
    with pytest.raises(SpecloomError, match="has no candidate selector .* incomplete") as err:
        engine(t, str(bad), "dflash2")
    assert "\n" not in str(err.value)
    with pytest.raises(SpecloomError, match='DFlash 2 checkpoint .* not dflash .*"dflash2"'):
        engine(t, paths["dflash2"], "dflash")
    with pytest.raises(SpecloomError, match='this is a dflash checkpoint, not dflash2 .*"dflash"'):
        engine(t, paths["dflash"], "dflash2")


def test_block_tree_is_the_beam_over_slots(blocks):
    """A DFlash tree: depth 1 holds the first slot's top-w tokens, each deeper node is a top-w token of its slot
    under the best w nodes above, kept by joint log-probability within the node budget; the depth policy's node
    cap (`max_nodes`) shrinks it; tau is at least the chain's on the same prompts (the chain is the tree's
    first-choice path)."""
    t, paths = blocks
    e = engine(t, paths["dflash"], "dflash", tree_width=3, num_draft_tokens=9)
    d = e.drafter
    trees = []
    orig = d.propose

    def spy(ctxs):
        out = orig(ctxs)
        trees.extend(out)
        return out

    d.propose = spy
    e.generate(prompt_token_ids=PROMPTS[0], max_tokens=12, ignore_eos=True)
    assert trees and all(len(tr) - 1 <= 9 for tr in trees)
    assert any(not tr.is_chain for tr in trees)
    assert max(len(tr.children(0)) for tr in trees) == 3
    chain = engine(t, paths["dflash"], "dflash")
    tree = engine(t, paths["dflash"], "dflash", tree_width=3, num_draft_tokens=12)
    tau = [sum(x.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).mean_accepted_length
               for ids in PROMPTS) for x in (chain, tree)]
    assert tau[1] >= tau[0], tau


def test_block_checkpoint_carries_a_default_tree(blocks, tmp_path):
    """A block drafter's checkpoint may name its default tree (`specloom.tree_width`, `num_draft_tokens`, as an
    EAGLE checkpoint does): used where the request names none, overridden by the request's tree settings, and a
    confidence cut asked for (by the request, or the checkpoint's own threshold) drafts a chain; the output stays
    the target's own; a bad value is one clear line."""
    t, paths = blocks
    own = tmp_path / "dspark_tree"
    shutil.copytree(paths["dspark"], own)
    raw = json.load(open(own / "config.json"))
    block = raw.get("specloom_dspark") or raw["specloom"]
    block.update(tree_width=3, num_draft_tokens=7)
    json.dump(raw, open(own / "config.json", "w"))
    e = engine(t, str(own), "dspark")
    assert (e.drafter.width, e.drafter.num_nodes) == (3, 7)
    ref = plain(t, PROMPTS[0])
    out = e.generate(prompt_token_ids=PROMPTS[0], max_tokens=N, ignore_eos=True)
    assert out.token_ids == ref.token_ids
    assert (engine(t, str(own), "dspark", tree_width=2).drafter.num_nodes) == min(4 * 2, 4 * 4)  # the request's shape
    assert engine(t, str(own), "dspark", tree_width=2, num_draft_tokens=5).drafter.num_nodes == 5
    cut = engine(t, str(own), "dspark", confidence_threshold=0.5).drafter
    assert (cut.width, cut.num_nodes, cut.threshold) == (1, None, 0.5)
    block.update(confidence_threshold=0.4)
    json.dump(raw, open(own / "config.json", "w"))
    assert engine(t, str(own), "dspark").drafter.width == 1
    block.update(confidence_threshold=0.0, tree_width="wide")
    json.dump(raw, open(own / "config.json", "w"))
    with pytest.raises(SpecloomError, match="tree_width must be an integer") as err:
        engine(t, str(own), "dspark")
    assert "\n" not in str(err.value)


def _target_copy(t, dst, index: bool = False) -> str:
    shutil.copytree(t.path, dst)
    if index:
        from safetensors import safe_open

        with safe_open(os.path.join(dst, "model.safetensors"), framework="pt") as f:
            wm = {k: "model.safetensors" for k in f.keys()}
        json.dump({"metadata": {}, "weight_map": wm}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
    return dst


def test_builtin_in_target_dir(blocks, tmp_path):
    t, paths = blocks
    ds = engine(t, paths["dspark"], "dspark").drafter.model
    for index in (False, True):
        d = _target_copy(t, str(tmp_path / f"target_{index}"), index)
        add_to_target_dir(ds, d, specloom_meta("dspark", t.model, t.tokenizer, ds.config.feature_ids),
                          dtype=torch.float32)
        raw = json.load(open(os.path.join(d, "config.json")))
        assert raw["dspark_block_size"] == 4 and raw["dspark_target_layer_ids"] == [0, 1, 2]
        assert raw["n_mtp_layers"] == 2 and raw["dspark_noise_token_id"] == 3
        if index:
            wm = json.load(open(os.path.join(d, "model.safetensors.index.json")))["weight_map"]
            assert wm["mtp.1.markov_head.markov_w1.weight"] == "model-dspark.safetensors"
        e = specloom.load(d, {"method": "dspark"}, dtype="fp32", progress=False,  # found without "model"
                          speculation="fixed")  # the drafter really drafts (auto follows the host)
        assert e.drafter.method == "dspark" and e.drafter.num_speculative_tokens == 4
        _same(ds, e.drafter.model)
        for ids in PROMPTS:
            assert e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True).token_ids == \
                plain(t, ids).token_ids
    # a missing mtp.* tensor is named
    from safetensors.torch import load_file, save_file

    f = os.path.join(d, "model-dspark.safetensors")
    sd = load_file(f)
    sd.pop("mtp.1.markov_head.markov_w1.weight")
    save_file(sd, f)
    with pytest.raises(SpecloomError, match=r"mtp\.1\.markov_head\.markov_w1\.weight' is missing"):
        specloom.load(d, {"method": "dspark"}, dtype="fp32", progress=False)


def test_bundled_overlay_found(blocks, tmp_path, monkeypatch):
    import specloom.drafters.checkpoint as ck

    t, paths = blocks
    with pytest.raises(SpecloomError, match="has no built-in dspark drafter"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "dspark"}))
    with pytest.raises(SpecloomError, match="no bundled dflash drafter"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "dflash"}))
    bundle = tmp_path / "bundled"
    shutil.copytree(paths["dspark"], bundle / "tiny" / "dspark")
    shutil.copytree(paths["dflash"], bundle / "tiny" / "dflash")
    monkeypatch.setattr(ck, "BUNDLED", str(bundle))
    for method in ("dspark", "dflash"):
        e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": method}))
        assert e.drafter.method == method
        assert e.generate(prompt_token_ids=PROMPTS[0], max_tokens=N, ignore_eos=True).token_ids == \
            plain(t, PROMPTS[0]).token_ids


def test_bad_settings_and_files(blocks, tmp_path):
    t, paths = blocks
    cfg = t.model.config

    def both(spec, match):
        s = SpeculativeConfig.parse(spec)
        with pytest.raises(SpecloomError, match=match):
            DRAFTERS[s.method].check(s, cfg)  # before the target loads
        with pytest.raises(SpecloomError, match=match):
            Engine(t.model, t.tokenizer, s)

    for k in (2, 7):
        both({"method": "dspark", "model": paths["dspark"], "num_speculative_tokens": k},
             rf"trained with a block of 4 and drafts exactly 4 tokens in one pass; num_speculative_tokens={k} "
             r"cannot be served .* set it to 4")
    both({"method": "dflash", "model": paths["dflash"], "num_speculative_tokens": 5}, "drafts at most 4 tokens")
    both({"method": "dflash", "model": paths["dflash"], "confidence_threshold": 0.3}, "needs a drafter with a "
         "confidence head")
    both({"method": "dflash", "model": paths["dspark"]}, 'this is a dspark checkpoint, not dflash .*"dspark"')
    both({"method": "dspark", "model": paths["dflash"]}, "this is a dflash checkpoint, not dspark")
    both({"method": "dspark", "model": paths["dspark"], "tree_width": 3, "confidence_threshold": 0.5},
         "confidence_threshold cuts a chain; with tree_width 3")
    both({"method": "dflash", "model": paths["dflash"], "num_draft_tokens": 8}, "num_draft_tokens sizes a tree; give "
         "tree_width > 1")
    with pytest.raises(SpecloomError, match="tree_width") as err:  # no per-slot distributions to branch on
        SpeculativeConfig.parse({"method": "ngram", "tree_width": 3})
    assert "\n" not in str(err.value)
    for bad in (1.5, -0.1, "high", True):
        with pytest.raises(SpecloomError, match="confidence_threshold"):
            SpeculativeConfig.parse({"method": "dspark", "confidence_threshold": bad})
    # layer ids past the target's depth (z-lab convention: decoder-layer outputs, 3 layers -> ids -1..2)
    deep = tmp_path / "deep"
    shutil.copytree(paths["dflash"], deep)
    raw = json.load(open(deep / "config.json"))
    raw["dflash_config"]["target_layer_ids"] = [0, 1, 7]
    json.dump(raw, open(deep / "config.json", "w"))
    both({"method": "dflash", "model": str(deep)}, r"target layer ids \[7\] exceed the target's depth: it has 3 "
         "layers")
    spec = tmp_path / "spec_deep"
    save(t, engine(t, paths["dflash"], "dflash").drafter.model, "dflash", str(spec), fmt="speculators")
    raw = json.load(open(spec / "config.json"))
    raw["aux_hidden_state_layer_ids"] = [1, 2, 9]
    json.dump(raw, open(spec / "config.json", "w"))
    both({"method": "dflash", "model": str(spec)}, r"target layer ids \[9\] exceed the target's depth: it has 3")


# -- training ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dataset(tiny, tmp_path_factory):
    from specloom.cli import main

    t = tiny("llama")
    root = tmp_path_factory.mktemp("train_block")
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    with open(prompts, "w") as f:
        for _ in range(32):
            words = " ".join(f"w{rng.randrange(4, 60)}" for _ in range(rng.randrange(4, 16)))
            f.write(json.dumps({"turns": [words]}) + "\n")
    data = str(root / "data")
    assert main(["data", "--target", t.path, "--prompts", str(prompts), "--out", data, "--max-new-tokens", "16",
                 "--batch-size", "16", "--dtype", "fp32"]) == 0
    return t, data, root


@pytest.mark.parametrize("kind,extra", [("dflash", ["--block-size", "4"]),
                                        ("dflash2", ["--block-size", "4", "--selector-rank", "8",
                                                     "--selector-top-k", "4", "--conv-group-size", "16",
                                                     "--slot-weights", "dpace", "--block-loss", "dspark"]),
                                        ("dspark", ["--block-size", "3", "--markov-rank", "8",
                                                    "--markov-head", "gated", "--warm-start-layer", "-1"])])
def test_train_block_drafter(dataset, kind, extra):
    from specloom.cli import main

    t, data, root = dataset
    out = str(root / f"ckpt_{kind}")
    assert main(["train", kind, "--target", t.path, "--data", data, "--out", out, "--steps", "30", "--lr", "3e-3",
                 "--tokens-per-batch", "256", "--warmup", "2", "--save-every", "30", "--num-anchors", "8",
                 "--draft-intermediate", "64", *extra]) == 0
    hist = json.load(open(os.path.join(out, "history.json")))
    first = sum(h["loss"] for h in hist[:5]) / 5
    last = sum(h["loss"] for h in hist[-5:]) / 5
    assert last < first - 0.1, (first, last)
    raw = json.load(open(os.path.join(out, "config.json")))
    assert raw["specloom"]["kind"] == kind and raw["specloom"]["manifest"]["steps"] == 30
    if "--warm-start-layer" in extra:  # the warm start is part of the recipe a resumed run must repeat
        st = torch.load(os.path.join(out, "train_state.pt"), weights_only=False)
        assert st["settings"]["warm_start_layer"] == -1
    if kind == "dspark":
        assert raw["dspark_block_size"] == 3 and raw["dspark_markov_head_type"] == "gated"
    elif kind == "dflash2":
        assert raw["architectures"] == ["DFlash2DraftModel"] and raw["dflash_config"]["selector_rank"] == 8
        assert "in_top_k" in hist[-1]
    else:
        assert raw["architectures"] == ["DFlashDraftModel"] and raw["num_hidden_layers"] == 1
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": kind, "model": out}))
    for ids in ([5, 6, 7, 8, 9], [30, 31, 12, 40]):
        a = e.generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True)
        assert a.token_ids == plain(t, ids).token_ids[:20]
        assert a.num_draft_tokens > 0


def test_warm_start_from_a_dflash_checkpoint(dataset, capsys):
    """`--init-from` a DFlash checkpoint: DFlash 2 and DSpark (another block size: the DSpark paper's warm start)
    start from its backbone (fc, hidden_norm, layers, norm equal after a step at lr 0); a DFlash of another shape
    is one clear line."""
    from safetensors.torch import load_file

    from specloom.cli import main

    t, data, root = dataset
    common = ["--target", t.path, "--data", data, "--tokens-per-batch", "256", "--warmup", "1", "--num-anchors", "4",
              "--draft-intermediate", "64"]
    src = str(root / "warm_src")
    assert main(["train", "dflash", *common, "--out", src, "--steps", "3", "--lr", "3e-3", "--block-size", "4"]) == 0
    base = load_file(os.path.join(src, "model.safetensors"))
    for kind, extra, name in (("dflash2", ["--block-size", "4", "--conv-group-size", "16", "--selector-rank", "8"],
                               lambda n: n),
                              ("dspark", ["--block-size", "3", "--markov-rank", "8"],
                               lambda n: "mtp.0.main_proj.weight" if n == "fc.weight" else
                               "mtp.0.main_norm.weight" if n == "hidden_norm.weight" else
                               "mtp." + n[len("layers."):] if n.startswith("layers.") else "mtp.0." + n)):
        out = str(root / f"warm_{kind}")
        assert main(["train", kind, *common, "--out", out, "--steps", "1", "--lr", "0", "--init-from", src,
                     *extra]) == 0
        got = load_file(os.path.join(out, "model.safetensors"))
        for n, v in base.items():
            assert torch.equal(got[name(n)].float(), v.float()), (kind, n)
    capsys.readouterr()
    assert main(["train", "dspark", *common, "--out", str(root / "warm_bad"), "--steps", "1", "--init-from", src,
                 "--draft-intermediate", "32"]) != 0
    err = capsys.readouterr().err
    assert "needs a DFlash drafter of the same shape" in err and "Traceback" not in err


def test_dpace_weights():
    """D-PACE: w_j = sum_{m >= j} prod_{i <= m} a_i with a_i = sum_v min(p, q): a slot weighs the accepted tokens
    it can still lead to (normalised to mean 1)."""
    from specloom.drafters.block.trainer import dpace_weights

    big = 30.0
    tgt = torch.tensor([[[big, 0, 0], [big, 0, 0], [big, 0, 0]]])
    same = dpace_weights(tgt.clone(), tgt)  # a = 1 everywhere: w = (3, 2, 1) / 2
    assert torch.allclose(same, torch.tensor([[1.5, 1.0, 0.5]]), atol=1e-4)
    half = torch.tensor([[[big, 0, 0], [0, big, 0], [big, 0, 0]]])  # slot 2 never accepted: a = (1, 0, 1)
    w = dpace_weights(half, tgt)
    assert torch.allclose(w, torch.tensor([[3.0, 0.0, 0.0]]), atol=1e-4)


def test_block_warm_start_copies_target_layers(tiny):
    """--warm-start-layer for dflash/dspark: draft layers start as the target's layers from that one on, fc picks
    the last feature, a narrower MLP keeps the target's strongest neurons; out of range is one clear message."""
    from specloom.drafters.block.model import BlockDraftConfig, BlockDraftModel
    from specloom.drafters.block.trainer import warm_start
    from specloom.errors import SpecloomError

    t = tiny("llama")
    c = t.model.config
    L, H = len(t.model.layers), c.hidden_size
    cfg = BlockDraftConfig(hidden_size=H, num_layers=2, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
                           head_dim=c.head_dim, intermediate_size=c.intermediate_size // 2,
                           vocab_size=c.vocab_size, block_size=4, mask_token_id=3, feature_ids=(1, 2),
                           target_hidden_size=H)
    m = BlockDraftModel(cfg, t.model)
    warm_start(m, t.model, -2)
    for i, src in enumerate(t.model.layers[L - 2:]):
        dst = m.layers[i]
        qn = c.num_heads * c.head_dim
        torch.testing.assert_close(dst.self_attn.q_proj.weight, src.self_attn.qkv_proj.weight[:qn].float())
        torch.testing.assert_close(dst.self_attn.o_proj.weight, src.self_attn.o_proj.weight.float())
        down = src.mlp.down_proj.weight.float()
        kept = dst.mlp.down_proj.weight
        assert kept.shape[1] == c.intermediate_size // 2
        cols = [int(((down - kept[:, j:j + 1]).abs().sum(0) == 0).nonzero()[0]) for j in range(kept.shape[1])]
        assert cols == sorted(set(cols))  # distinct target neurons, in order
        gate = src.mlp.gate_up_proj.weight.float()[:c.intermediate_size]
        torch.testing.assert_close(dst.mlp.gate_proj.weight, gate[cols])
    torch.testing.assert_close(m.hidden_norm.weight, t.model.layers[L - 2].input_layernorm.weight.float())
    assert torch.equal(m.fc.weight[:, -H:], torch.eye(H)) and not m.fc.weight[:, :-H].any()
    for bad in (-1, L - 1, -L - 1):  # two draft layers need two target layers from the start one
        with pytest.raises(SpecloomError, match="warm-start-layer"):
            warm_start(m, t.model, bad)
