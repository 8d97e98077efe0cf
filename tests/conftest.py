"""Shared fixtures: tiny random HF models (the oracle) saved to disk and loaded back through specloom, and the
real pretrained checkpoints (SmolLM2-135M, Gemma-3-270M) loaded both by specloom and by HF transformers.

Everything is session-scoped: building a tiny model takes well under a second, but the real checkpoints take
15-45 s each to load, so they are loaded once per session and shared by every test that asks for them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch

from specloom.config import ModelConfig
from specloom.loading import load_target, resolve
from specloom.loading.weights import build_model, convert_hf_state_dict


@pytest.fixture(autouse=True)
def _quiet_host(monkeypatch):
    """Every test judges the host quiet while it times something (host/contention.py): whether another process
    shares the cores is this machine's state, not the code's (a suite run beside other work would otherwise
    cache nothing). The tests of that judgement set `BUSY_SHARE` back."""
    from specloom.host import contention

    monkeypatch.setattr(contention, "BUSY_SHARE", 2.0)  # a share of all CPUs never passes 1


VOCAB = 256
PAD, EOS, BOS, UNK = 0, 1, 2, 3
SEED = 1234

# Tiny families exercised against HF. "llama3" adds Llama-3.x frequency-dependent RoPE scaling with a small
# original context so that the scaled, smoothed and kept frequency bands all occur at head_dim 16.
TINY_FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "gemma3")
EXTRA_FAMILIES = ("llama_bias",)  # only checked for logits
SLIDING_WINDOW = 8


def tiny_hf_config(family: str):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6, pad_token_id=PAD, eos_token_id=EOS,
        bos_token_id=BOS,
    )
    if family == "llama":
        return LlamaConfig(**common, num_hidden_layers=3, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "llama3":
        return LlamaConfig(**common, num_hidden_layers=2, tie_word_embeddings=True, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "llama_bias":  # Llama with attention_bias: biases on q/k/v *and* o_proj
        return LlamaConfig(**common, num_hidden_layers=2, tie_word_embeddings=False, attention_bias=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":
        return Qwen2Config(**common, num_hidden_layers=3, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "qwen3":
        return Qwen3Config(**common, num_hidden_layers=3, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    if family == "gemma3":
        return Gemma3TextConfig(
            **common, num_hidden_layers=4, sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
            query_pre_attn_scalar=32, final_logit_softcapping=30.0,
        )
    raise ValueError(family)


def randomize_(model: torch.nn.Module, gemma: bool, seed: int = SEED) -> None:
    """Give every parameter a non-trivial value: activations of order 1, norms far from identity (Gemma's norm
    weights random around 0 so that its `1 + w` convention matters), random biases."""
    g = torch.Generator().manual_seed(seed)
    # A tied head reads the logits off the embeddings: large embeddings make every token predict itself, and
    # greedy continuations collapse to one repeated token. Small ones keep the continuations varied. Gemma
    # multiplies its embeddings by sqrt(hidden) before the first layer.
    embed_std = 0.1 if model.config.tie_word_embeddings else 1.0
    if gemma:
        embed_std /= model.config.hidden_size ** 0.5
    with torch.no_grad():
        for name, p in model.named_parameters():  # tied weights are listed once
            if name.endswith("norm.weight"):
                new = torch.randn(p.shape, generator=g) * 0.5 if gemma else torch.rand(p.shape, generator=g) + 0.5
                if gemma and name == "model.norm.weight":
                    new = (1 + new) * 10 - 1  # Gemma's small tied embeddings: scale the logits back up to O(1)
            elif name.endswith(".bias"):
                new = torch.randn(p.shape, generator=g) * 0.5
            elif "embed_tokens" in name:
                new = torch.randn(p.shape, generator=g) * embed_std
            else:
                new = torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5
            p.copy_(new)


def save_tiny_tokenizer(path: str) -> None:
    """A word-level tokenizer over exactly VOCAB tokens ("<pad>", "<eos>", "<bos>", "<unk>", "w4" ... )."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": PAD, "<eos>": EOS, "<bos>": BOS, "<unk>": UNK}
    vocab.update({f"w{i}": i for i in range(4, VOCAB)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>",
                                  unk_token="<unk>")
    tok.save_pretrained(path)


def model_from_hf(hf_model) -> "torch.nn.Module":
    """specloom model built straight from an in-memory HF model (no disk round trip)."""
    config = ModelConfig.from_hf(hf_model.config.to_dict())
    items = ((k, v.detach().clone()) for k, v in hf_model.state_dict().items())
    return build_model(config, convert_hf_state_dict(config, items, torch.float32))


@dataclass
class Tiny:
    family: str
    hf: torch.nn.Module  # the HF oracle, fp32, eval mode
    model: torch.nn.Module  # specloom's DecoderLM loaded from `path` by load_target
    tokenizer: object  # specloom Tokenizer
    path: str


def make_tiny(family: str, root: str) -> Tiny:
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(family)
    torch.manual_seed(SEED)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(hf, gemma=family == "gemma3")
    hf.eval().requires_grad_(False)
    path = os.path.join(root, family)
    hf.save_pretrained(path)
    save_tiny_tokenizer(path)
    model, tokenizer = load_target(path, "fp32", progress=False)
    return Tiny(family, hf, model, tokenizer, path)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """tiny(family) -> Tiny; built once per family per session."""
    root = str(tmp_path_factory.mktemp("tiny_models"))
    cache: dict[str, Tiny] = {}

    def get(family: str) -> Tiny:
        if family not in cache:
            cache[family] = make_tiny(family, root)
        return cache[family]

    return get


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """HF `generate` greedy continuation of exactly n tokens: plain argmax, EOS neither stops nor is masked.

    `generate` fills an EOS left unset in the passed config from the model's own generation config, and
    `min_new_tokens` would mask EOS out of the argmax, so the model's EOS is cleared for the call instead."""
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=PAD, num_beams=1)
    saved = hf_model.generation_config.eos_token_id
    hf_model.generation_config.eos_token_id = None
    try:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    generation_config=gc)
    finally:
        hf_model.generation_config.eos_token_id = saved
    return out[0, len(ids):].tolist()


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (tiny matrices run faster so, and far faster on a busy host)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# -- real checkpoints ---------------------------------------------------------------------------------------------

@dataclass
class Real:
    alias: str
    model: torch.nn.Module
    tokenizer: object
    hf: torch.nn.Module
    path: str


def load_real(alias: str) -> Real:
    from transformers import AutoModelForCausalLM

    from specloom.errors import SpecloomError

    try:
        path = resolve(alias).path
    except SpecloomError as e:  # the checkpoint's package is not installed
        pytest.skip(f"{alias} not available: {e}")
    model, tokenizer = load_target(alias, "fp32", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)
    hf.eval().requires_grad_(False)
    return Real(alias, model, tokenizer, hf, path)


@pytest.fixture(scope="session")
def smollm2() -> Real:
    return load_real("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3_270m() -> Real:
    return load_real("gemma3-270m")


def _sampling_tv(spec_engine, plain_engine, ids, n: int = 400, max_tokens: int = 4, top_k: int = 2,
                 rule: str = "rejection"):
    """Sample `n` continuations of `ids` (temperature 1, top-k 2) from both engines and return the total variation
    distance between the distributions of their first three tokens (8 outcomes; two plain runs differ by about
    0.06 at n = 400). With max_tokens 4 the second step verifies two drafted tokens at once, so the drafter's q
    and the residual at depths 1 and 2 shape tokens 2 and 3. Asserts the speculative engine really drafted (a
    sampling test must not silently run plain decoding). `rule`: the speculative engine's sampling rule
    (sampling.py; the plain engine samples by its generator, "rejection", either way)."""
    from collections import Counter

    def run(engine, base, rule):
        outs, drafted = Counter(), 0
        for s in range(n):
            r = engine.generate(prompt_token_ids=ids, max_tokens=max_tokens, temperature=1.0, top_k=top_k,
                                seed=base + s, sampling_rule=rule, ignore_eos=True)
            outs[tuple(r.token_ids[:3])] += 1
            drafted += r.num_draft_tokens
        return outs, drafted

    a, drafted = run(spec_engine, 0, rule)
    b, _ = run(plain_engine, 10_000, "rejection")
    assert drafted >= n, f"the drafter proposed only {drafted} tokens in {n} generations"
    return 0.5 * sum(abs(a[x] - b[x]) for x in set(a) | set(b)) / n


@pytest.fixture
def sampling_tv():
    return _sampling_tv


def near_target_scores(drafter, target, noise: float = 1.0, seed: int = 0) -> None:
    """Make a chain drafter built on EagleDrafter (eagle, mtp) score with the target's own next-token logits plus
    Gaussian noise: its q is close to, but not equal to, the target's p, so sampled drafts are often accepted and
    often rejected -- the regime where a wrong q or residual would show in a distribution test (a random drafter
    almost never proposes a token the target could pick, which hides such bugs)."""
    from specloom.models import DecoderLM  # noqa: F401  (target is a DecoderLM)

    g = torch.Generator().manual_seed(seed)
    state = {}
    orig_propose, orig_row = drafter.propose, drafter._rows

    def propose(ctxs):
        state["prefix"] = list(ctxs[0].tokens)
        return orig_propose(ctxs)

    def row(h, tokens, depth, ctxs, mask=None):
        state["prefix"].append(int(tokens[0][0]))
        return orig_row(h, tokens, depth, ctxs, mask)

    def logits(h, depth):
        ids = torch.tensor([state["prefix"]])
        kv = target.new_kv(len(state["prefix"]) + 1)
        out = target(ids, torch.arange(ids.shape[1])[None], kv, num_logits=1).logits[0, -1]
        return (out + noise * torch.randn(out.shape, generator=g))[None]

    drafter.propose, drafter._rows, drafter._logits = propose, row, logits


@pytest.fixture(scope="session")
def tiny_smol(tmp_path_factory):
    """A 2-layer random Llama over SmolLM2's tokenizer (saved as an HF directory) and loaded by specloom."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specloom.errors import SpecloomError
    from specloom.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_gguf(resolve("smollm2-135m").path)
    except SpecloomError as e:
        pytest.skip(f"smollm2-135m not available: {e}")
    path = str(tmp_path_factory.mktemp("tiny_smol"))  # the server tests share it
    config = LlamaConfig(vocab_size=len(tok.hf), hidden_size=32, intermediate_size=64, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=16, num_hidden_layers=2, max_position_embeddings=512,
                         bos_token_id=tok.hf.bos_token_id, eos_token_id=tok.hf.eos_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tok.hf.save_pretrained(path)
    model, tokenizer = load_target(path, "fp32", progress=False)
    return model, tokenizer, path
