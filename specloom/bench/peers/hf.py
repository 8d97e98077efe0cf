"""HF transformers `generate` on the same checkpoint and device as the candidate: fp32 on the CPU (HF's default
there), the candidate's dtype on a GPU (bf16 by default, as vLLM and HF users run it there): `hf` (plain greedy),
`hf-assisted` (assisted generation with a draft model: `assistant_model=`) and `hf-lookup` (prompt lookup:
`prompt_lookup_num_tokens=`).

The draft model of `hf-assisted` is `--baseline-draft MODEL`, else the candidate's own `draft_model` speculative
config's model; HF's assisted-generation defaults apply (20 draft tokens a step with the assistant's confidence
threshold 0.4 stopping it early) unless `--baseline-draft-tokens K` fixes the step at K. Target passes are counted
with a forward hook; for hf-assisted and hf-lookup tau is generated tokens per target forward (HF verifies the
prompt together with the first draft: there is no separate prefill pass to leave out).
"""

from __future__ import annotations

import os
import time

import torch

from ...errors import SpecloomError
from ...loading import resolve
from . import Peer, PeerRun, register


def _transformers(model: str | None = None):
    """transformers, and accelerate when the model is a GGUF file (HF loads a GGUF only with it): one clear
    SpecloomError naming what to install otherwise."""
    import importlib.util

    try:
        import transformers
    except ImportError:
        raise SpecloomError("the hf baselines need transformers: pip install transformers accelerate") from None
    if model is not None and importlib.util.find_spec("accelerate") is None and resolve(model).kind == "gguf":
        raise SpecloomError("the hf baselines load the GGUF file through HF transformers, which needs accelerate "
                            "for that: pip install accelerate")
    return transformers


def load_hf(model: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
    """An HF causal LM (fp32 unless told) from an alias, a .gguf (dequantised by transformers) or an HF
    directory, on `device`."""
    AutoModelForCausalLM = _transformers(model).AutoModelForCausalLM
    source = resolve(model)
    if source.kind == "gguf":
        folder, fname = os.path.dirname(source.path) or ".", os.path.basename(source.path)
        m = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    else:
        m = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
    return m.to(device=device, dtype=dtype).eval().requires_grad_(False)


_GPU_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def hf_placement(ctx) -> tuple[torch.device, torch.dtype]:
    """Where and in what the HF peers run: the candidate's device; fp32 on the CPU, the candidate's dtype on a GPU."""
    dev = torch.device(getattr(ctx.engine, "device", "cpu")) if ctx.engine is not None else torch.device("cpu")
    if dev.type == "cpu":
        return dev, torch.float32
    return dev, _GPU_DTYPES.get(ctx.dtype, torch.bfloat16)


def shared_hf(ctx) -> object:
    """One HF copy of the target for all the hf peers of a run."""
    if "hf_target" not in ctx.shared:
        ctx.shared["hf_target"] = load_hf(ctx.model, *hf_placement(ctx))
    return ctx.shared["hf_target"]


class _PassCounter:
    def __init__(self, module):
        self.n = 0
        module.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.n += 1


class _HFPeer(Peer):
    @classmethod
    def preflight(cls, model, draft_model):
        _transformers(model)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model = shared_hf(ctx)
        if not hasattr(self.model, "_specloom_passes"):
            self.model._specloom_passes = _PassCounter(self.model)
        self.passes = self.model._specloom_passes
        self.eos = sorted(ctx.eos_token_ids)

    @property
    def label(self) -> str:
        dev, dt = hf_placement(self.ctx)
        name = {v: k for k, v in _GPU_DTYPES.items()}[dt]
        return f"{self.name} ({name}" + ("" if dev.type == "cpu" else f", {dev}") + ")"

    def generate_kwargs(self) -> dict:
        return {}

    @torch.inference_mode()
    def run(self, ids, max_tokens):
        dev = self.model.device
        x = torch.tensor([ids], device=dev)
        before = self.passes.n
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = self.model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else None, **self.generate_kwargs(),
        )
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        return PeerRun(out[0, len(ids):].tolist(), seconds, self.passes.n - before,
                       prefill_pass=not self.generate_kwargs())


@register("hf")
class HFPlain(_HFPeer):
    pass


_NEED_DRAFT = ("--baseline hf-assisted needs a draft model: --baseline-draft MODEL, or a candidate with a "
               "draft_model speculative config ('{\"model\": \"...\"}')")


@register("hf-assisted")
class HFAssisted(_HFPeer):
    @classmethod
    def preflight(cls, model, draft_model):
        _transformers(model)
        if not draft_model:
            raise SpecloomError(_NEED_DRAFT)
        resolve(draft_model)

    def __init__(self, ctx):
        if not ctx.draft_model:
            raise SpecloomError(_NEED_DRAFT)
        super().__init__(ctx)
        self.assistant = load_hf(ctx.draft_model, *hf_placement(ctx))
        vt, vd = self.model.config.get_text_config().vocab_size, self.assistant.config.get_text_config().vocab_size
        if vt != vd:
            raise SpecloomError(f"--baseline hf-assisted: the draft model {ctx.draft_model} has another vocabulary "
                                f"({vd} tokens, the target {vt}); HF assisted generation needs the same tokenizer")
        gc = self.assistant.generation_config
        if ctx.draft_tokens is not None:
            gc.num_assistant_tokens = ctx.draft_tokens
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0  # a fixed K: no early stop on low confidence

    def settings(self) -> dict:
        gc = self.assistant.generation_config
        try:  # what HF applies to a key left unset
            defaults = type(gc)._get_default_generation_params()
        except AttributeError:
            defaults = {}
        keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
        return {"draft_model": self.ctx.draft_model,
                **{k: getattr(gc, k, None) if getattr(gc, k, None) is not None else defaults.get(k) for k in keys}}

    def generate_kwargs(self) -> dict:
        return {"assistant_model": self.assistant}


@register("hf-lookup")
class HFLookup(_HFPeer):
    def settings(self) -> dict:
        return {"prompt_lookup_num_tokens": self.ctx.lookup_tokens, "max_matching_ngram_size": self.ctx.lookup_ngram}

    def generate_kwargs(self) -> dict:
        return {"prompt_lookup_num_tokens": self.ctx.lookup_tokens, "max_matching_ngram_size": self.ctx.lookup_ngram}
