"""bf16 speculation bit-identical to plain decoding (issue 35): on the real SmolLM2-135M in bf16, every layer's
result for a position is the same whether the position is decoded alone, inside a 9-token causal pass, in uneven
chunks, or on a path of a draft tree beside sibling branches; and greedy speculative output equals plain decoding
token for token. Fails naming the first layer (HF hidden-state index) whose per-position result depends on the
pass width."""

import pytest
import torch

from specloom.host import kernel_choice as kernel_probe
from specloom.errors import SpecloomError
from specloom.loading import load_target, resolve
from specloom.models import invariant_attention

TEXT = "The quick brown fox jumps over the lazy dog, then writes a short poem about speculative decoding."


def _exact_kernels():
    return [k for k in kernel_probe.exact_candidates(torch.bfloat16, "cpu") if k != "native"] or ["native"]


def _load_bf16(alias: str):
    """The real checkpoint in bf16 on the first exact kernel that this host measures batch-invariant (onednn on an
    AMX host; on an AVX512-BF16 host without AMX oneDNN's bf16 matmul is not, and `invariant` runs), or a skip
    naming what is missing."""
    if not invariant_attention.available():
        pytest.skip(f"invariant attention unavailable: {invariant_attention.unavailable_reason()}")
    try:
        resolve(alias)
    except SpecloomError as e:
        pytest.skip(f"{alias} not available: {e}")
    plain, _ = load_target(alias, "bf16", progress=False, kernel="native")  # nn.Linears, for the check
    kernel = next((k for k in _exact_kernels() if kernel_probe.batch_invariant(plain, k)), None)
    if kernel is None:
        pytest.skip(f"no exact bf16 kernel is batch-invariant on this host ({', '.join(_exact_kernels())})")
    del plain
    model, tok = load_target(alias, "bf16", progress=False, kernel=kernel)
    assert model.uses_invariant_attention()
    return model, tok


@pytest.fixture(scope="module")
def smollm2_bf16():
    return _load_bf16("smollm2-135m")


def _passes(model, ids, P, chunks, max_len=256):
    """Hidden states (every capture id) of ids[P:] fed in `chunks` after a prefill of ids[:P]."""
    L = model.config.num_layers
    cap = tuple(range(L + 1))
    kv = model.new_kv(max_len)
    with torch.inference_mode():
        model(torch.tensor([ids[:P]]), torch.arange(P)[None], kv)
        kv.commit()
        pos, outs = P, []
        for c in chunks:
            o = model(torch.tensor([ids[pos:pos + c]]), torch.arange(pos, pos + c)[None], kv, capture=cap)
            kv.commit()
            outs.append(o)
            pos += c
    return {k: torch.cat([o.hidden[k] for o in outs], 1) for k in cap}, torch.cat([o.logits for o in outs], 1)


def _first_difference(a: dict, b: dict):
    return next((k for k in sorted(a) if not torch.equal(a[k], b[k])), None)


def test_every_layer_is_pass_width_invariant(smollm2_bf16):
    model, tok = smollm2_bf16
    ids = tok.encode(TEXT)
    P = len(ids) - 9
    alone, la = _passes(model, ids, P, [1] * 9)
    for chunks in ([9], [3, 6], [2, 2, 5]):
        other, lb = _passes(model, ids, P, chunks)
        k = _first_difference(alone, other)
        assert k is None, f"chunks {chunks}: hidden state {k} differs from decoding one position at a time"
        assert torch.equal(la, lb)


def test_tree_path_equals_plain_decoding(smollm2_bf16):
    """A tree pass: root r, children x (a wrong branch) and y, y's child z; the path r -> y -> z (with x's slot
    between them) gives the bits of decoding r, y, z one at a time."""
    model, tok = smollm2_bf16
    ids = tok.encode(TEXT)
    P = len(ids) - 3
    r, y, z = ids[P:P + 3]
    x = (y + 17) % model.config.vocab_size
    L = model.config.num_layers
    cap = tuple(range(L + 1))
    plain, _ = _passes(model, ids, P, [1, 1, 1])
    kv = model.new_kv(256)
    with torch.inference_mode():
        model(torch.tensor([ids[:P]]), torch.arange(P)[None], kv)
        kv.commit()
        tokens = torch.tensor([[r, x, y, z]])
        positions = torch.tensor([[P, P + 1, P + 1, P + 2]])
        mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        out = model(tokens, positions, kv, attn_mask=mask, capture=cap)
    path = [0, 2, 3]
    for k in cap:
        assert torch.equal(out.hidden[k][:, path], plain[k]), f"hidden state {k} on the tree path differs"


def test_sliding_window_layers_are_invariant_past_the_window():
    """Gemma-3's sliding-window layers: a decode step reads only the last `window` slots, a verification pass
    masks the same keys out; past the window the two still agree bit for bit."""
    model, tok = _load_bf16("gemma3-270m")
    window = model.config.sliding_window
    ids = (tok.encode(TEXT) * (window // 8))[: window + 40]
    assert len(ids) == window + 40
    P = len(ids) - 6
    alone, la = _passes(model, ids, P, [1] * 6, max_len=len(ids) + 8)
    other, lb = _passes(model, ids, P, [6], max_len=len(ids) + 8)
    k = _first_difference(alone, other)
    assert k is None, f"hidden state {k} differs past the sliding window"
    assert torch.equal(la, lb)


def test_bf16_greedy_speculation_is_plain_decoding(smollm2_bf16):
    from specloom import Engine
    from specloom.speculative import SpeculativeConfig

    model, tok = smollm2_bf16
    plain = Engine(model, tok)
    prompts = ["Write a haiku about the sea.", "List three prime numbers and explain why they are prime."]
    for spec in ({"method": "ngram", "num_speculative_tokens": 4}, {"method": "eagle3"}):
        engine = Engine(model, tok, SpeculativeConfig.parse(spec), speculation="fixed")
        for p in prompts:
            a = plain.generate(p, chat=True, max_tokens=40)
            b = engine.generate(p, chat=True, max_tokens=40)
            assert b.token_ids == a.token_ids, (spec, p)
            assert b.num_target_passes <= a.num_target_passes
