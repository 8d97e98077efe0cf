"""Engine.generate on a tiny model: stop conditions, KV dtype, input checks."""

import pytest
import torch

from specloom import Engine, SpecloomError


def test_stop_string_and_max_tokens(tiny):
    t = tiny("llama")
    e = Engine(t.model, t.tokenizer)
    full = e.generate(prompt_token_ids=[5, 6, 7], max_tokens=12, ignore_eos=True)
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    words = full.text.split()
    stop = words[3]
    cut = e.generate(prompt_token_ids=[5, 6, 7], max_tokens=12, ignore_eos=True, stop=[stop])
    assert cut.finish_reason == "stop"
    assert stop not in cut.text and full.text.startswith(cut.text)
    assert cut.token_ids == full.token_ids[:len(cut.token_ids)]


def test_eos_stops(tiny):
    t = tiny("llama")
    e = Engine(t.model, t.tokenizer)
    free = e.generate(prompt_token_ids=[5, 6, 7], max_tokens=40, ignore_eos=True)
    t.tokenizer.eos_token_ids = frozenset({free.token_ids[4]})
    try:
        r = e.generate(prompt_token_ids=[5, 6, 7], max_tokens=40)
    finally:
        t.tokenizer.eos_token_ids = frozenset({1})
    assert r.finish_reason == "stop"
    assert r.token_ids == free.token_ids[:free.token_ids.index(free.token_ids[4]) + 1]


def test_kv_dtype_selectable(tiny):
    t = tiny("llama")
    ref = Engine(t.model, t.tokenizer).generate(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
    e = Engine(t.model, t.tokenizer, kv_dtype=torch.bfloat16)
    r = e.generate(prompt_token_ids=[5, 6, 7], max_tokens=8, ignore_eos=True)
    assert e._kv.dtype == torch.bfloat16
    assert len(r.token_ids) == 8 and r.num_target_passes == 8 and r.mean_accepted_length == 1.0
    assert Engine(t.model, t.tokenizer)._kv is None and ref.token_ids  # default engine allocates lazily


@pytest.mark.parametrize("kwargs, needle", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=600), "exceed the model's context of 512"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
])
def test_bad_requests(tiny, kwargs, needle):
    t = tiny("llama")
    with pytest.raises(SpecloomError, match=needle):
        Engine(t.model, t.tokenizer).generate(prompt_token_ids=[5, 6, 7], **kwargs)


def test_out_of_vocab_prompt(tiny):
    t = tiny("llama")
    with pytest.raises(SpecloomError, match="prompt token ids"):
        Engine(t.model, t.tokenizer).generate(prompt_token_ids=[5, 10_000])
