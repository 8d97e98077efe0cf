"""EAGLE-3's drafting pass as one C call (models/fused_stack.py `run_eagle3`, kernels/decoder_stack.c
`eagle3_pass`): the input projection, the embedding rows, both norms, the layer, the output norm, the head and its
argmax, bit for bit what the layer-by-layer path computes; and on the real model the drafts it gives are the
drafts the Python path gives, while it does run."""
import json

import pytest
import torch

from specloom.drafters.eagle.model import EagleDraftModel, eagle_config_for, init_weights
from specloom.models import fused_stack, ggml_linear


def _needs_repacked():
    if not ggml_linear.repacked_path():
        pytest.skip("this CPU lacks AVX512-BF16: drafters stay bf16 and draft layer by layer")


def test_one_call_is_the_layer_by_layer_pass_bit_for_bit(tiny):
    _needs_repacked()
    from specloom.models.cpu_packing import pack_linears

    t = tiny("llama")
    cfg = eagle_config_for(t.model.config, True, (1, 2, 3), 200)
    m = EagleDraftModel(cfg)
    init_weights(m, 0, std=0.3)
    m = m.bfloat16()
    m.attach_target(t.model)
    table = t.model.embed_tokens.weight.detach().bfloat16()
    m._shared["embed"] = torch.nn.Embedding.from_pretrained(table)  # a bf16 table (a GGUF target: GGML rows)
    pack_linears(m)
    m.stack_projections()
    step = m.eagle_step()
    assert step is not None
    g = torch.Generator().manual_seed(3)
    kv_c, kv_p = m.new_kv(32), m.new_kv(32)
    pos = 0
    with torch.inference_mode():
        for T in (6, 1, 3):  # a catch-up over a prompt, a decode row, an accepted draft and its bonus token
            feats = torch.randn(T, 3 * cfg.target_hidden_size, generator=g).bfloat16()
            ids = torch.randint(0, t.model.config.vocab_size, (T,), generator=g)
            positions = torch.arange(pos, pos + T)[None]
            p = kv_p.begin([0], [T])
            h = m(m.input_hidden(feats[None], ids[None]), ids[None], positions, p)[0]
            kv_p.commit()
            want = m.draft_logits(h[-1:])[0]
            p = kv_c.begin([0], [T])
            p.set_positions(positions)
            cos, sin = m.rope(positions, torch.bfloat16)
            x, logits, best = fused_stack.run_eagle3(step, feats, ids, p, cos, sin)
            kv_c.commit()
            pos += T
            assert torch.equal(x, h)
            assert torch.equal(logits.float(), want)
            assert int(best) == int(want.argmax())
            assert torch.equal(kv_c.k[:, 0, :, :pos], kv_p.k[:, 0, :, :pos])
            assert torch.equal(kv_c.v[:, 0, :, :pos], kv_p.v[:, 0, :, :pos])
    m.norm.weight.data.mul_(2)  # a changed weight: the one call steps aside, as the fused layer does
    assert fused_stack.run_eagle3(step, feats, ids, kv_c.begin([0], [1]), cos[:, :1], sin[:, :1]) is None


@pytest.mark.parametrize("shape", [{"num_speculative_tokens": 3, "tree_width": 1}, {}])
def test_real_drafts_equal_the_layer_by_layer_drafts(shape, monkeypatch):
    """The bundled EAGLE-3 on SmolLM2-135M, greedy, a depth-3 chain and the bundle's tree: the same drafts step
    by step and the same output with the one call as without it, and it ran at every step."""
    _needs_repacked()
    import specloom.drafters.eagle.drafter as ed
    import specloom.engine as engine
    from specloom.errors import SpecloomError

    try:
        eng = engine.load("smollm2-135m", json.dumps({"method": "eagle3", **shape}), speculation="fixed",
                          progress=False)
    except SpecloomError as e:
        pytest.skip(f"smollm2-135m not available: {e}")
    ran, real = [], fused_stack.run_eagle3
    monkeypatch.setattr(fused_stack, "run_eagle3", lambda *a: ran.append(real(*a)) or ran[-1])
    drafts, propose = [], ed.EagleDrafter.propose
    def recorded(self, ctxs):
        trees = propose(self, ctxs)
        drafts.append([(list(t.tokens), list(t.parents)) for t in trees])
        return trees

    monkeypatch.setattr(ed.EagleDrafter, "propose", recorded)
    outs = {}
    for one_call in (True, False):
        drafts.clear()
        if not one_call:
            monkeypatch.setattr(eng.drafter.model, "eagle_step", lambda: None)
        tokens = [eng.generate(prompt=p, max_tokens=40, chat=True).token_ids
                  for p in ("Write a Python function that reverses a list.", "Name three rivers in Europe.")]
        outs[one_call] = (tokens, list(drafts))
    assert outs[True] == outs[False]
    assert len(outs[True][1]) > 10
    assert len(ran) == len(outs[True][1]) and all(r is not None for r in ran)
