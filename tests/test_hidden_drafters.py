"""Hidden-state drafters (Medusa, EAGLE-1, EAGLE-3; chains and EAGLE-2 dynamic trees) on a tiny random fp32
target: greedy output identical to plain greedy decoding with random-init drafters (almost nothing accepted),
with "oracle" drafters whose scores are forced to the true continuation (everything accepted: tau = depth + 1),
and the sampling distribution matches plain sampling."""

import json
import os

import pytest
import torch

from specloom import Engine
from specloom.drafters.checkpoint import save_drafter, specloom_meta
from specloom.drafters.eagle.model import EagleDraftModel, eagle_config_for, init_weights
from specloom.drafters.medusa.drafter import MedusaHeads
from specloom.speculative import SpeculativeConfig

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52]]
N = 29


def make_eagle(t, path, eagle3: bool, seed=0, draft_vocab=None, **norms):
    L = t.model.config.num_layers
    ids = (1, L // 2, L - 1) if eagle3 else (L,)
    V = t.model.config.vocab_size
    cfg = eagle_config_for(t.model.config, eagle3, ids, draft_vocab or V)
    for k, v in norms.items():  # norm_before_fc, fc_norm, norm_output (EAGLE-3.1)
        setattr(cfg, k, v)
    m = EagleDraftModel(cfg)
    init_weights(m, seed, std=0.3)
    if eagle3 and cfg.draft_vocab_size < V:
        used = torch.randperm(V, generator=torch.Generator().manual_seed(seed))[:cfg.draft_vocab_size].sort().values
        m.d2t.copy_(used - torch.arange(cfg.draft_vocab_size))
        m.t2d.zero_()
        m.t2d[used] = True
    save_drafter("eagle3" if eagle3 else "eagle", m, path, specloom_meta(
        "eagle3" if eagle3 else "eagle", t.model, t.tokenizer, ids), dtype=torch.float32)
    return path


def make_medusa(t, path, heads=3, seed=0, token_map=None, own=False):
    """Random Medusa heads (`token_map`: a truncated head vocabulary; `own`: own output layers, Medusa v0.1)."""
    rows = t.model.config.vocab_size if token_map is None else len(token_map)
    m = MedusaHeads(t.model.config.hidden_size, heads, 1, rows if own else None, token_map)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    save_drafter("medusa", m, path, specloom_meta("medusa", t.model, t.tokenizer, (t.model.config.num_layers,)),
                 dtype=torch.float32, fmt="v0.1" if own else "v2")
    return path


@pytest.fixture(scope="module")
def drafters(tiny, tmp_path_factory):
    t = tiny("llama")
    root = tmp_path_factory.mktemp("drafters")
    return t, {
        "eagle": make_eagle(t, str(root / "eagle"), False),
        "eagle3": make_eagle(t, str(root / "eagle3"), True, draft_vocab=200),
        "medusa": make_medusa(t, str(root / "medusa")),
        "eagle31": make_eagle(t, str(root / "eagle31"), True, seed=1, fc_norm=True, norm_output=True),
    }


def plain(t, ids, **kw):
    return Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True, **kw)


CASES = [
    ("eagle", {"num_speculative_tokens": 3, "tree_width": 1}),
    ("eagle", {"num_speculative_tokens": 4, "tree_width": 3, "num_draft_tokens": 9}),
    ("eagle3", {"num_speculative_tokens": 2, "tree_width": 1}),
    ("eagle3", {"num_speculative_tokens": 5, "tree_width": 4, "num_draft_tokens": 12}),
    ("medusa", {}),
    ("medusa", {"num_speculative_tokens": 2}),
]


@pytest.mark.parametrize("method,extra", CASES + [("eagle31", {"num_speculative_tokens": 4, "tree_width": 3})])
def test_random_drafter_identical(drafters, method, extra):
    t, paths = drafters
    kind = "eagle3" if method == "eagle31" else method
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": kind, "model": paths[method], **extra}))
    for ids in PROMPTS:
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == plain(t, ids).token_ids
        assert got.num_target_passes <= N


class _Oracle:
    """Replaces a drafter's scoring so that depth d always ranks the true token x_{n+1+d} first."""

    def __init__(self, drafter, truth):
        self.d, self.truth = drafter, truth
        self.calls = 0

    def install(self):
        d = self.d
        orig_propose = d.propose

        def propose(ctxs):
            self.n = len(ctxs[0].tokens) - 1
            self.calls = 0
            return orig_propose(ctxs)

        d.propose = propose
        V = 256
        if hasattr(d, "heads"):  # Medusa: all heads at once
            def logits(h):  # h (rows, H) -> (heads, rows, V)
                out = torch.zeros(d.heads.num_heads, *h.shape[:-1], V)
                for k in range(d.heads.num_heads):
                    out[k, ..., self.truth[min(self.n + 1 + k, len(self.truth) - 1)]] = 10.0
                return out

            d.heads.logits = logits
        else:
            m = d.model
            V_d = m.config.draft_vocab_size
            to_draft = {int(i + m.d2t[i]) if m.config.eagle3 else i: i for i in range(V_d)}

            def draft_logits(h):
                rows = h.shape[0] if h.dim() == 2 else 1
                tok = self.truth[min(self.n + 1 + self.calls, len(self.truth) - 1)]
                self.calls += 1
                out = torch.zeros(rows, V_d)
                out[:, to_draft.get(tok, 0)] = 10.0
                return out

            m.draft_logits = draft_logits


@pytest.mark.parametrize("method,extra", [c for c in CASES if c[0] != "eagle3"])
def test_oracle_drafter_all_accepted(drafters, method, extra):
    t, paths = drafters
    for ids in PROMPTS:
        truth = ids + plain(t, ids).token_ids
        e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": method, "model": paths[method], **extra}))
        _Oracle(e.drafter, truth).install()
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == truth[len(ids):]
        k = e.drafter.num_speculative_tokens
        assert got.mean_accepted_length == pytest.approx(k + 1, rel=0.15)


def test_eagle3_oracle_full_vocab(drafters, tmp_path):
    t, _ = drafters
    path = make_eagle(t, str(tmp_path / "e3full"), True)
    for ids in PROMPTS:
        truth = ids + plain(t, ids).token_ids
        e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(
            {"method": "eagle3", "model": path, "num_speculative_tokens": 4, "tree_width": 2}))
        _Oracle(e.drafter, truth).install()
        got = e.generate(prompt_token_ids=ids, max_tokens=N, ignore_eos=True)
        assert got.token_ids == truth[len(ids):]
        assert got.mean_accepted_length > 4.0


@pytest.mark.parametrize("method,extra", [("eagle", {"tree_width": 1}), ("eagle3", {"tree_width": 3}),
                                          ("medusa", {})])
def test_sampling_distribution(drafters, method, extra, sampling_tv):
    """Temperature-1 samples of 4 tokens: per-position marginals and the joint of positions 2-3 agree between
    speculative and plain decoding (total variation bound with 400 samples each; the drafter must draft)."""
    t, paths = drafters
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse(
        {"method": method, "model": paths[method], "num_speculative_tokens": 3, **extra}))
    tv = sampling_tv(e, Engine(t.model, t.tokenizer), PROMPTS[0])
    assert tv < 0.12, tv


def test_formats_round_trip(drafters, tmp_path):
    from specloom.drafters.checkpoint import load_drafter

    t, paths = drafters
    src, _ = load_drafter(paths["eagle3"], "eagle3", t.model, t.tokenizer)
    for fmt in ("speculators", "eagle"):
        out = str(tmp_path / fmt)
        save_drafter("eagle3", src, out, {"kind": "eagle3"}, fmt=fmt, dtype=torch.float32)
        raw = json.load(open(os.path.join(out, "config.json")))
        if fmt == "speculators":
            assert raw["speculators_model_type"] == "eagle3" and "norm_before_residual" in raw
        again, _ = load_drafter(out, "eagle3", t.model, t.tokenizer)
        for (k, v), (k2, v2) in zip(sorted(src.state_dict().items()), sorted(again.state_dict().items())):
            assert k == k2 and torch.equal(v, v2), k
    e1, _ = load_drafter(paths["eagle"], "eagle", t.model, t.tokenizer)
    out = str(tmp_path / "e1")
    save_drafter("eagle", e1, out, {"kind": "eagle"}, dtype=torch.float32)
    again, _ = load_drafter(out, "eagle", t.model, t.tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(e1.state_dict().values(), again.state_dict().values()))
    med, _ = load_drafter(paths["medusa"], "medusa", t.model, t.tokenizer)
    for fmt in ("v2", "v0.1"):
        out = str(tmp_path / f"medusa_{fmt}")
        save_drafter("medusa", med, out, {"kind": "medusa"}, dtype=torch.float32, fmt=fmt)
        again, _ = load_drafter(out, "medusa", t.model, t.tokenizer)
        assert all(torch.equal(a, b) for a, b in zip(med.state_dict().values(), again.state_dict().values()))


def test_bundled_lookup_and_settings(drafters):
    from specloom import SpecloomError
    from specloom.drafters.checkpoint import bundled_dirs, find_drafter_dir

    t, paths = drafters
    with pytest.raises(SpecloomError, match="no bundled eagle3 drafter for this target"):
        Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle3"}))
    from types import SimpleNamespace

    from specloom.drafters.block.drafter import _declares_dspark
    from specloom.drafters.checkpoint import find_builtin_dir
    from specloom.drafters.mtp.format import declares_mtp

    builtin = {"mtp": declares_mtp, "dspark": _declares_dspark}  # found as built into the target (overlays)
    for method in ("eagle3", "eagle", "medusa", "dflash", "dflash2", "mtp", "dspark"):
        assert bundled_dirs(method), f"no bundled {method} drafter (package data missing?)"
        for d in bundled_dirs(method):  # every bundled drafter names its target and is found for it
            fp = json.load(open(os.path.join(d, "config.json")))["specloom"]["target_fingerprint"]
            cfg = SimpleNamespace(model_type=fp["architecture"], num_layers=fp["num_layers"],
                                  hidden_size=fp["hidden_size"], vocab_size=fp["vocab_size"], source_dir=None)
            if method in builtin:
                assert find_builtin_dir(method, cfg, builtin[method]) == d
            else:
                assert find_drafter_dir(None, method, cfg) == d
    for bad in ({"num_draft_tokens": 0}, {"num_draft_tokens": 1000}, {"tree_width": 0}):
        with pytest.raises(SpecloomError):
            SpeculativeConfig.parse({"method": "eagle3", **bad})


def test_drafter_memory_accounting(drafters):
    """`memory()` counts the drafter's own tensors (not the target's shared embedding/head) and its KV cache."""
    t, paths = drafters
    e = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle3", "model": paths["eagle3"]}))
    m = e.drafter.model
    own = sum(x.numel() * x.element_size() for x in [*m.parameters(), *m.buffers()])
    mem = e.drafter.memory()
    assert mem["weights"] == own
    c = m.config
    assert mem["kv_per_1k_tokens"] == 2 * c.num_kv_heads * c.head_dim * 4 * 1000
    e1 = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle", "model": paths["eagle"]}))
    shared = {t.model.lm_head.weight.data_ptr(), t.model.embed_tokens.weight.data_ptr()}
    assert not shared & {x.data_ptr() for x in e1.drafter.model.parameters()}  # borrowed, not counted
    assert e1.drafter.memory()["weights"] == sum(x.numel() * 4 for x in e1.drafter.model.parameters())
    ng = Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "ngram"}))
    assert ng.drafter.memory() == {"weights": 0, "kv_per_1k_tokens": 0}


def test_path_rows_is_the_gather_and_holds_no_pass_alive():
    """The rows a drafter keeps of a verified path: the same values as a gather, a slice where consecutive, and
    never a view into a larger pass (a row idle for many steps would keep every step's tensor alive)."""
    from specloom.drafters.base import path_rows

    x = torch.randn(3, 5, 4)
    for b in range(3):
        for path in ([0], [0, 1, 2], [2, 3], [0, 2, 4], [4], [1, 3]):
            got = path_rows(x[b], path)
            assert torch.equal(got, x[b][torch.tensor(path)])
            assert got.untyped_storage().nbytes() == got.numel() * got.element_size()
    alone = torch.randn(1, 2, 4)
    assert path_rows(alone[0], [0, 1]).data_ptr() == alone.data_ptr()  # the whole pass: a view, no copy
