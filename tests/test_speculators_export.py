"""Our speculators-format exports (what vLLM serves) checked by the `speculators` package's own classes.

For each kind speculators has (eagle3, dflash, dspark, mtp): export -> speculators' `SpeculatorModelConfig`
parses and validates config.json (pydantic, the kind's config class chosen by `speculators_model_type`) -> its
model class for that kind takes our safetensors state dict (same names and shapes; only what it takes from the
verifier is absent) -> the same inputs through its modules give our drafter's outputs (EAGLE-3: the logits of 3
training-time-test steps; DFlash / DSpark: a block's hidden states, the Markov bias and the confidence; MTP: the
logits) -> specloom reads the export back to the same tensors and outputs.

The bundled SmolLM2 drafters are used without loading SmolLM2: a stand-in target holds a random embedding and
head of its shape (the drafters share the target's; both sides get the same one). Install speculators without
its dependencies (they would replace the CPU torch): pip install --no-deps speculators==0.9.0, after
`pip install -e '.[test]'` (which brings the few it imports).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

speculators = pytest.importorskip(
    "speculators", reason="the speculators package cannot be imported: pip install --no-deps speculators==0.9.0 "
    "after pip install -e '.[test]' (which brings datasets, loguru and hs-connectors, what it imports)")

from speculators import SpeculatorModel, SpeculatorModelConfig  # noqa: E402

from specloom.config import ModelConfig  # noqa: E402
from specloom.drafters.checkpoint import BUNDLED  # noqa: E402
from specloom.errors import SpecloomError  # noqa: E402
from specloom.export import validate, vllm_command, write_speculators  # noqa: E402

SMOL = os.path.join(BUNDLED, "smollm2-135m")
SMOL_CONFIG = ModelConfig(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                          num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
                          rope_theta=100000.0)
VERIFIER = "HuggingFaceTB/SmolLM2-135M-Instruct"


pytestmark = pytest.mark.usefixtures("one_thread")  # small matrices: one thread is faster


def no_init():
    """speculators' model classes initialise their (verifier-sized) embeddings and heads at construction; every
    tensor compared is loaded afterwards, so skip it."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


class StandIn:
    """What a drafter reads from its target: config, device, dtype, the embedding and (`head`) the LM head."""

    def __init__(self, config: ModelConfig, seed: int = 0, head: bool = False):
        g = torch.Generator().manual_seed(seed)
        self.config, self.device, self.dtype = config, torch.device("cpu"), torch.float32
        with torch.device("meta"):
            self.embed_tokens = torch.nn.Embedding(config.vocab_size, config.hidden_size)
            self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.embed_tokens.weight = torch.nn.Parameter(
            torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.05, requires_grad=False)
        if head:  # the drafters under test bring their own head, except MTP
            self.lm_head.weight = torch.nn.Parameter(
                torch.randn(config.vocab_size, config.hidden_size, generator=g) * 0.05, requires_grad=False)

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def logits(self, h):
        return self.lm_head(h).float()


@pytest.fixture(scope="module")
def smol():
    return StandIn(SMOL_CONFIG)


def raw(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def theirs(path: str, target):
    """speculators' config and model for an exported directory, built offline, holding our tensors (+ the
    target's embedding, which it takes from the verifier)."""
    from safetensors.torch import load_file

    cfg = SpeculatorModelConfig.from_pretrained(path, local_files_only=True)
    cfg.speculators_config.verifier.name_or_path = None  # nothing fetched from the hub
    cfg.transformer_layer_config._attn_implementation = "eager"
    with no_init():
        model = SpeculatorModel.registered_model_class_from_config(cfg)(cfg)
    sd = load_file(os.path.join(path, "model.safetensors"))
    sd["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    res = model.load_state_dict(sd, strict=False, assign=True)
    assert not res.unexpected_keys
    assert set(res.missing_keys) <= set(model._keys_to_ignore_on_load_missing), res.missing_keys
    return cfg, model.eval()


def same_tensors(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# -- EAGLE-3 -------------------------------------------------------------------------------------------------------

def test_bundled_eagle3_is_speculators_format():
    """The EAGLE-3 drafter we ship (written by an older writer) parses and fits speculators' Eagle3DraftModel."""
    v = validate(os.path.join(SMOL, "eagle3"))
    assert (v["config_class"], v["model_class"]) == ("Eagle3SpeculatorConfig", "Eagle3DraftModel")
    assert "embed_tokens.weight" in v["from_verifier"]


def _same_ttt_logits(src, sm, feats, toks, steps: int = 3) -> list:
    """The same features and tokens through speculators' training-time test (`sm`) and ours (`src`): the same
    logits per step on the rows whose teacher-forced token is real (not the padding). Returns ours."""
    T = toks.shape[1]
    with torch.no_grad():
        ours = [src.draft_logits(h) for _, h in src.ttt_forward(feats, toks, torch.ones(1, T, dtype=torch.bool),
                                                                 steps)]
        got = []
        hook = sm.lm_head.register_forward_hook(lambda mod, i, o: got.append(o.float()))
        sm(hidden_states=feats, input_ids=F.pad(toks[:, 1:], (0, 1)), document_ids=torch.zeros(1, T, dtype=torch.long),
           ttt_steps=steps)
        hook.remove()
    for j in range(steps):
        n = T - 1 - j
        torch.testing.assert_close(got[j][:, :n], ours[j][:, :n], atol=2e-3, rtol=1e-4)
        assert torch.equal(got[j][:, :n].argmax(-1), ours[j][:, :n].argmax(-1))
    return ours


def test_eagle3_export(smol, tmp_path):
    from specloom.drafters.eagle.format import build_eagle

    src = build_eagle(os.path.join(SMOL, "eagle3"), raw(os.path.join(SMOL, "eagle3")), smol, True)
    out = str(tmp_path / "eagle3")
    write_speculators("eagle3", src, out, {"kind": "eagle3", "depth": 3}, VERIFIER, ["LlamaForCausalLM"],
                      torch.float32)
    v = validate(out)
    assert v["tensors"] == 15  # the layer (10), fc, norm, lm_head, d2t, t2d
    cfg, sm = theirs(out, smol)
    assert type(cfg).__name__ == "Eagle3SpeculatorConfig"
    assert cfg.speculators_config.algorithm == "eagle3"
    assert cfg.speculators_config.proposal_methods[0].speculative_tokens == 3
    assert cfg.speculators_config.verifier.architectures == ["LlamaForCausalLM"]
    assert raw(out)["speculators_config"]["verifier"]["name_or_path"] == VERIFIER
    assert cfg.eagle_aux_hidden_state_layer_ids == [2, 15, 27] and cfg.norm_before_residual is False
    assert (cfg.draft_vocab_size, cfg.target_vocab_size, cfg.target_hidden_size) == (4864, 49152, 576)
    assert cfg.transformer_layer_config.model_type == "llama"
    assert torch.equal(sm.d2t, src.d2t) and torch.equal(sm.t2d, src.t2d)

    # the same features and tokens through speculators' training-time test and ours: the same logits per step
    g = torch.Generator().manual_seed(1)
    T = 12
    feats = torch.randn(1, T, 3 * 576, generator=g)
    toks = torch.randint(0, 49152, (1, T), generator=g)
    ours = _same_ttt_logits(src, sm, feats, toks)

    # and specloom reads the export back: the same tensors, the same logits
    again = build_eagle(out, raw(out), smol, True)
    same_tensors(src, again)
    with torch.no_grad():
        back = [again.draft_logits(h) for _, h in again.ttt_forward(feats, toks, torch.ones(1, T, dtype=torch.bool), 3)]
    assert all(torch.equal(a, b) for a, b in zip(ours, back))


@pytest.mark.parametrize("flags", [{"norm_before_fc": True}, {"fc_norm": True, "norm_output": True},
                                   {"norm_output": True}])
def test_eagle3_feature_norms_match_speculators(smol, tmp_path, flags):
    """speculators' EAGLE-3 norm flags (its training defaults now set norm_before_fc and norm_output; EAGLE-3.1 is
    fc_norm + norm_output): written, read back, and the same logits per training-time-test step as speculators'
    own model -- a checkpoint with them is not served as a plain EAGLE-3."""
    import dataclasses

    from specloom.drafters.eagle.format import build_eagle
    from specloom.drafters.eagle.model import EagleDraftModel

    base = build_eagle(os.path.join(SMOL, "eagle3"), raw(os.path.join(SMOL, "eagle3")), smol, True)
    src = EagleDraftModel(dataclasses.replace(base.config, **flags))
    state = {k: v.float() for k, v in base.state_dict().items()}
    g = torch.Generator().manual_seed(7)
    for k, v in src.state_dict().items():
        if k not in state:  # the new norms: weights away from one, so that they matter
            state[k] = 1 + 0.3 * torch.randn(v.shape, generator=g)
    src.load_state_dict(state)
    src.attach_target(smol)
    src.eval()
    out = str(tmp_path / "eagle3n")
    write_speculators("eagle3", src, out, {"kind": "eagle3", "depth": 3}, VERIFIER, ["LlamaForCausalLM"],
                      torch.float32)
    validate(out)
    r = raw(out)
    assert all(r[k] == flags.get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_output"))
    cfg, sm = theirs(out, smol)
    T = 10
    feats = torch.randn(1, T, 3 * 576, generator=g) * 4
    toks = torch.randint(0, 49152, (1, T), generator=g)
    _same_ttt_logits(src, sm, feats, toks)
    again = build_eagle(out, r, smol, True)
    assert all(getattr(again.config, k) == flags.get(k, False) for k in ("norm_before_fc", "fc_norm", "norm_output"))
    same_tensors(src, again)
    # both feature norms at once: one clear line
    r2 = dict(r, norm_before_fc=True, fc_norm=True)
    with pytest.raises(SpecloomError, match="norm_before_fc and fc_norm are both set"):
        build_eagle(out, r2, smol, True)


def test_eagle3_rope_scaling_written(tmp_path):
    """A Llama-3.x target's frequency-dependent RoPE scaling reaches the draft layer config vLLM builds from."""
    from specloom.config import RopeScaling
    from specloom.drafters.eagle.model import EagleDraftModel, eagle_config_for

    tc = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=500000.0,
                     rope_scaling=RopeScaling(8.0, 1.0, 4.0, 64))
    m = EagleDraftModel(eagle_config_for(tc, True, (1, 2, 3)))
    out = str(tmp_path / "e3")
    write_speculators("eagle3", m, out, {"kind": "eagle3"}, None, None, torch.float32)
    validate(out)
    cfg = SpeculatorModelConfig.from_pretrained(out, local_files_only=True)
    rope = cfg.transformer_layer_config.rope_parameters
    assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0 and rope["original_max_position_embeddings"] == 64
    assert raw(out)["speculators_config"]["verifier"]["name_or_path"] is None  # unknown: not invented


# -- DFlash, DSpark ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_block_export(smol, tmp_path, kind):
    """Bundled z-lab DFlash / DSpark overlay -> speculators dflash / dspark -> the same block outputs there."""
    from specloom.drafters.block.format import build_block

    path = os.path.join(SMOL, kind)
    src = build_block(path, raw(path), smol, kind)
    out = str(tmp_path / kind)
    write_speculators(kind, src, out, {"kind": kind}, "smollm2-135m", ["LlamaForCausalLM"], torch.float32)
    validate(out)
    assert raw(out)["speculators_config"]["verifier"]["name_or_path"] == VERIFIER  # the alias's HF repository
    cfg, sm = theirs(out, smol)
    c = src.config
    assert type(cfg).__name__ == ("DFlashSpeculatorConfig" if kind == "dflash" else "DSparkSpeculatorConfig")
    assert cfg.aux_hidden_state_layer_ids == list(c.feature_ids) == [2, 15, 27]
    assert (cfg.block_size, cfg.mask_token_id, cfg.sample_from_anchor) == (c.block_size, c.mask_token_id,
                                                                         c.anchor_predicts)
    assert cfg.speculators_config.proposal_methods[0].speculative_tokens == c.num_drafts
    assert cfg.transformer_layer_config.model_type == "qwen3" and cfg.draft_vocab_size == 49152
    if kind == "dspark":
        assert (cfg.markov_rank, cfg.markov_head_type, cfg.enable_confidence_head) == (32, "vanilla", True)

    g = torch.Generator().manual_seed(2)
    T, B = 10, c.block_size
    feats = torch.randn(1, T, 3 * 576, generator=g)
    block = torch.full((1, B), c.mask_token_id)
    block[0, 0] = 123
    bpos = (T + torch.arange(B))[None]

    def ours(m):
        return m.block_hidden(block, bpos, m.context_kv(feats, torch.arange(T)[None]))

    with torch.no_grad():
        h = ours(src)
        ctx = sm.hidden_norm(sm.fc(feats))
        x = sm.embed_tokens(block)
        pid = torch.cat([torch.arange(T)[None], bpos], 1)
        pe = sm.rotary_emb(x, pid)
        for layer in sm.layers:  # no mask: the block sees all the context and itself (non-causal)
            x = layer(hidden_states=x, target_hidden=ctx, attention_mask=None, position_ids=pid, position_embeddings=pe)
        torch.testing.assert_close(sm.norm(x), h, atol=1e-4, rtol=1e-4)
        if kind == "dspark":
            prev = torch.randint(0, 49152, (1, B), generator=g)
            torch.testing.assert_close(sm.markov_head.block_bias(prev_token_ids=prev, hidden_states=h),
                                       src.markov_bias(prev, h)[0], atol=1e-5, rtol=1e-5)
            conf = sm.confidence_head(torch.cat([h, sm.markov_head.prev_embeddings(prev)], -1))
            torch.testing.assert_close(conf, src.confidence_logit(h, prev), atol=1e-5, rtol=1e-5)

    again = build_block(out, raw(out), smol, kind)
    same_tensors(src, again)
    with torch.no_grad():
        assert torch.equal(ours(again), h)


# -- MTP -----------------------------------------------------------------------------------------------------------

def qwen3_target():
    from conftest import tiny_hf_config

    return StandIn(ModelConfig.from_hf(tiny_hf_config("qwen3").to_dict()), seed=3, head=True)


def test_mtp_export_qwen3(tmp_path):
    """One MTP layer of a Qwen3 target -> speculators mtp (MTPDraftModel) -> the same first-step logits there."""
    from specloom.drafters.mtp.format import load_mtp
    from specloom.drafters.mtp.model import MTPModel

    t = qwen3_target()
    src = MTPModel(t.config, 1)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in src.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    src.attach_target(t)
    out = str(tmp_path / "mtp")
    write_speculators("mtp", src, out, {"kind": "mtp"}, None, ["Qwen3ForCausalLM"], torch.float32)
    v = validate(out)
    assert v["model_class"] == "MTPDraftModel" and "lm_head.weight" in v["from_verifier"]
    cfg, sm = theirs(out, t)
    assert cfg.num_nextn_predict_layers == 1 and cfg.num_speculative_steps == 1
    assert cfg.transformer_layer_config.num_hidden_layers == t.config.num_layers
    sm.lm_head.weight.data = t.lm_head.weight.detach().clone()  # the verifier's head, as vLLM shares it

    T = 9
    final = torch.randn(1, T, t.config.hidden_size, generator=g)
    toks = torch.randint(4, t.config.vocab_size, (1, T), generator=g)
    with torch.no_grad():
        (_, h), = src.train_forward(final, toks, torch.ones(1, T, dtype=torch.bool))
        ours = src.logits(0, h)
        logits, _, _ = sm(input_ids=toks, hidden_states=final)
    n = logits[0].shape[1]  # speculators scores the rows whose target token exists
    torch.testing.assert_close(logits[0].float(), ours[:, :n], atol=1e-4, rtol=1e-4)

    again, _ = load_mtp(out, t)
    same_tensors(src, again)


def test_mtp_export_refused_without_a_speculators_form(tmp_path):
    from specloom.drafters.mtp.model import MTPModel

    llama = MTPModel(ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                                 num_heads=4, num_kv_heads=2, head_dim=8), 1)
    with pytest.raises(SpecloomError, match="Qwen3 decoder layers only"):
        write_speculators("mtp", llama, str(tmp_path / "a"), {}, None, None)
    two = MTPModel(qwen3_target().config, 2)
    with pytest.raises(SpecloomError, match="holds one MTP layer"):
        write_speculators("mtp", two, str(tmp_path / "b"), {}, None, None)
    with pytest.raises(SpecloomError, match="Medusa has no speculators kind"):
        write_speculators("medusa", None, str(tmp_path / "c"), {}, None, None)


# -- the command -------------------------------------------------------------------------------------------------

def test_export_command_tiny(tiny, tmp_path):
    """`specloom export` on a tiny HF target and an EAGLE-3 directory: validated, the verifier is the target's
    directory, and the exported drafter drafts exactly what the original does."""
    from specloom import Engine
    from specloom.drafters.checkpoint import save_drafter, specloom_meta
    from specloom.drafters.eagle.model import EagleDraftModel, eagle_config_for, init_weights
    from specloom.export import export
    from specloom.speculative import SpeculativeConfig

    t = tiny("llama")
    L = t.model.config.num_layers
    m = EagleDraftModel(eagle_config_for(t.model.config, True, (1, L // 2, L - 1)))
    init_weights(m, 0, std=0.3)
    src = str(tmp_path / "src")
    save_drafter("eagle3", m, src, specloom_meta("eagle3", t.model, t.tokenizer, (1, L // 2, L - 1), depth=2),
                 dtype=torch.float32, fmt="eagle")  # the official EAGLE-3 layout in, speculators out
    out = str(tmp_path / "out")
    r = export(t.path, {"method": "eagle3", "model": src}, out, dtype="fp32")
    assert r["validated"]["model_class"] == "Eagle3DraftModel"
    assert r["verifier"] == os.path.abspath(t.path)
    assert raw(out)["speculators_config"]["verifier"]["architectures"] == ["LlamaForCausalLM"]
    assert r["vllm"] == vllm_command("eagle3", os.path.abspath(out), os.path.abspath(t.path), 2)
    assert raw(out)["specloom"]["target_fingerprint"] == raw(src)["specloom"]["target_fingerprint"]

    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5]
    runs = [Engine(t.model, t.tokenizer, SpeculativeConfig.parse({"method": "eagle3", "model": p})).generate(
        prompt_token_ids=ids, max_tokens=12, ignore_eos=True) for p in (src, out)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].acceptance_per_position == runs[1].acceptance_per_position
    with pytest.raises(SpecloomError, match="not empty"):
        export(t.path, {"method": "eagle3", "model": src}, out)
    with pytest.raises(SpecloomError, match="no speculators format"):
        export(t.path, {"method": "ngram"}, str(tmp_path / "ngram"))
    with pytest.raises(SpecloomError, match="a llama target; the speculators mtp format has Qwen3"):
        export(t.path, {"method": "mtp"}, str(tmp_path / "mtp"))
