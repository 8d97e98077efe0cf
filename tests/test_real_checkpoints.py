"""The real checkpoints (GGUF, dequantized to fp32) against HF transformers loading the very same GGUF file."""

from __future__ import annotations

import time

import pytest
import torch

from conftest import hf_greedy
from specloom.engine import Engine

pytestmark = pytest.mark.real

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, a goldsmith "
    "from Mainz, combined movable metal type, an oil-based ink and a wooden screw press into a single system. "
    "Before his invention, books were copied by hand, which made them rare and expensive. Within a few decades, "
    "printing shops had spread to more than two hundred cities across Europe, and the price of books fell "
    "sharply. Scholars began to"
)
TOL = 1e-3
NEW_TOKENS = 64


@pytest.fixture(params=["smollm2", "gemma3_270m"])
def real(request):
    return request.getfixturevalue(request.param)


def prompt_ids(real) -> list[int]:
    ids = real.tokenizer.encode(PROMPT)
    assert 80 <= len(ids) <= 130, len(ids)
    return ids


def test_logits_match_hf(real):
    ids = prompt_ids(real)
    kv = real.model.new_kv(len(ids))
    with torch.inference_mode():
        ours = real.model(torch.tensor([ids]), torch.arange(len(ids))[None], kv).logits[0]
        ref = real.hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (len(ids), real.model.config.vocab_size)
    per_pos = (ours - ref).abs().amax(-1)
    print(f"\n{real.alias}: {len(ids)} tokens, max |logits - HF| = {per_pos.max().item():.3e} "
          f"(logit range {ref.min().item():.1f} .. {ref.max().item():.1f})")
    bad = (per_pos > TOL).nonzero().flatten().tolist()
    assert not bad, f"positions over {TOL}: {bad[:10]} (max diff {per_pos.max().item():.3e})"
    # the model actually predicts the text: most next tokens rank high
    assert (ours[:-1].argmax(-1) == torch.tensor(ids[1:])).float().mean() > 0.3


def test_greedy_matches_hf_generate(real):
    ids = prompt_ids(real)
    t0 = time.perf_counter()
    res = Engine(real.model, real.tokenizer).generate(prompt_token_ids=ids, max_tokens=NEW_TOKENS, ignore_eos=True)
    t1 = time.perf_counter()
    ref = hf_greedy(real.hf, ids, NEW_TOKENS)
    t2 = time.perf_counter()
    print(f"\n{real.alias} ({t1 - t0:.1f} s; HF {t2 - t1:.1f} s): {real.tokenizer.decode(res.token_ids)!r}")
    assert len(ref) == NEW_TOKENS
    assert res.token_ids == ref, (
        f"first difference at token {next(i for i, (a, b) in enumerate(zip(res.token_ids, ref)) if a != b)}:\n"
        f"ours: {real.tokenizer.decode(res.token_ids)!r}\nHF:   {real.tokenizer.decode(ref)!r}"
    )
    assert res.finish_reason == "length"
