"""specloom's model code against HF transformers on tiny random models of every supported family."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import EXTRA_FAMILIES, SLIDING_WINDOW, TINY_FAMILIES, VOCAB, hf_greedy, model_from_hf
from specloom.engine import Engine
from specloom.loading.weights import build_model

TOL = 1e-4


def prompt_for(family: str, seed: int = 0, n: int | None = None) -> list[int]:
    # Gemma's prompt is longer than its sliding window so that sliding layers really drop keys.
    n = n or (30 if family == "gemma3" else 20)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (n,), generator=g).tolist()


def run(model, ids: list[int], **kw):
    kv = model.new_kv(len(ids) + 8)
    with torch.inference_mode():
        return model(torch.tensor([ids]), torch.arange(len(ids))[None], kv, **kw)


def hf_run(hf, ids: list[int], **kw):
    with torch.no_grad():
        return hf(torch.tensor([ids]), **kw)


def our_greedy(model, ids: list[int], n: int) -> list[int]:
    """Prefill, then one token per forward pass through the KV cache."""
    kv = model.new_kv(len(ids) + n)
    out = []
    with torch.inference_mode():
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], kv, num_logits=1).logits[0, -1]
        kv.commit()
        for step in range(n):
            tok = int(logits.argmax())
            out.append(tok)
            if step == n - 1:
                break
            pos = len(ids) + step
            logits = model(torch.tensor([[tok]]), torch.tensor([[pos]]), kv).logits[0, -1]
            kv.commit()
            assert kv.length == pos + 1
    return out


@pytest.mark.parametrize("family", TINY_FAMILIES + EXTRA_FAMILIES)
def test_logits_match_hf(tiny, family):
    t = tiny(family)
    ids = prompt_for(family)
    ours = run(t.model, ids).logits
    ref = hf_run(t.hf, ids).logits
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape == (1, len(ids), VOCAB)
    assert ref.abs().max() > 1.0  # the random weights give non-trivial logits
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"{family}: max |logits - HF| = {diff}"


def test_model_from_in_memory_state_dict(tiny):
    """build_model from HF's state dict in memory is the same model as load_target from the saved directory."""
    t = tiny("gemma3")
    ids = prompt_for("gemma3")
    a = run(model_from_hf(t.hf), ids).logits
    b = run(t.model, ids).logits
    assert torch.equal(a, b)


def test_gemma_sliding_window_matters(tiny):
    """Guard for the test setup: the same Gemma weights with the window removed give different logits beyond the
    window (and identical ones inside it), so the match with HF really checks the sliding-window layers."""
    t = tiny("gemma3")
    ids = prompt_for("gemma3")
    assert len(ids) > t.model.config.sliding_window == SLIDING_WINDOW
    state = {k: v for k, v in t.model.state_dict().items() if k != "lm_head.weight"}
    wide = build_model(dataclasses.replace(t.model.config, sliding_window=10_000), state)
    ref = run(t.model, ids).logits
    no_window = run(wide, ids).logits
    assert (no_window[0, SLIDING_WINDOW:] - ref[0, SLIDING_WINDOW:]).abs().max() > 1e-2
    assert (no_window[0, :SLIDING_WINDOW] - ref[0, :SLIDING_WINDOW]).abs().max() <= 1e-5


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_matches_hf_generate(tiny, family):
    t = tiny(family)
    ids = prompt_for(family, seed=1)
    ref = hf_greedy(t.hf, ids, 20)
    assert len(ref) == 20
    assert len(set(ref)) >= 4  # guard: the random model does not just repeat one token
    assert our_greedy(t.model, ids, 20) == ref
    res = Engine(t.model, t.tokenizer).generate(prompt_token_ids=ids, max_tokens=20, ignore_eos=True)
    assert res.token_ids == ref
    assert res.finish_reason == "length"
    assert res.num_target_passes == 20


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_capture_matches_hf_hidden_states(tiny, family):
    t = tiny(family)
    L = t.model.config.num_layers
    ids = prompt_for(family, seed=2)
    ref = hf_run(t.hf, ids, output_hidden_states=True).hidden_states
    assert len(ref) == L + 1

    capture = (0, 1, L, -1)
    out = run(t.model, ids, capture=capture)
    assert set(out.hidden) == set(capture)
    for c in capture:
        h = out.hidden[c]
        assert h.shape == (1, len(ids), t.model.config.hidden_size)
        diff = (h.float() - ref[c]).abs().max().item()
        assert diff <= TOL, f"{family}: capture {c}: max diff {diff}"

    # every index, including the intermediate ones
    out = run(t.model, ids, capture=tuple(range(L + 1)))
    for c in range(L + 1):
        diff = (out.hidden[c] - ref[c]).abs().max().item()
        assert diff <= TOL, f"{family}: capture {c}: max diff {diff}"
    # capture does not change the logits
    assert torch.equal(out.logits, run(t.model, ids).logits)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("capture", [(), (-1,), (1,)])
def test_num_logits(tiny, family, capture):
    t = tiny(family)
    ids = prompt_for(family, seed=3)
    full = run(t.model, ids, capture=capture)
    one = run(t.model, ids, capture=capture, num_logits=1)
    assert one.logits.shape == (1, 1, VOCAB)
    assert (one.logits[0, 0] - full.logits[0, -1]).abs().max() <= 2e-5
    three = run(t.model, ids, capture=capture, num_logits=3)
    assert three.logits.shape == (1, 3, VOCAB)
    assert (three.logits[0] - full.logits[0, -3:]).abs().max() <= 2e-5
    for c in capture:  # captured hidden states still cover every position
        assert one.hidden[c].shape == full.hidden[c].shape
        assert (one.hidden[c] - full.hidden[c]).abs().max() <= 2e-5


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_batch_of_two_matches_single_runs(tiny, family):
    t = tiny(family)
    a, b = prompt_for(family, seed=4), prompt_for(family, seed=5)
    kv = t.model.new_kv(64, batch=2)
    n = len(a)
    with torch.inference_mode():
        out = t.model(torch.tensor([a, b]), torch.arange(n).expand(2, n), kv).logits
    assert out.shape == (2, n, VOCAB)
    ref = hf_run(t.hf, a).logits[0], hf_run(t.hf, b).logits[0]
    assert (out[0] - ref[0]).abs().max() <= TOL
    assert (out[1] - ref[1]).abs().max() <= TOL
