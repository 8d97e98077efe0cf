"""HF transformers `generate` on the same checkpoint, as a benchmark baseline (fp32, HF's default on CPU)."""

from __future__ import annotations

import os
import time

import torch

from ..errors import SpecloomError
from ..loading import resolve


class HFBaseline:
    name = "hf"

    def __init__(self, model: str, eos_token_ids):
        try:
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise SpecloomError("--baseline hf needs transformers: pip install transformers accelerate") from None
        source = resolve(model)
        if source.kind == "gguf":
            folder, fname = os.path.dirname(source.path) or ".", os.path.basename(source.path)
            self.model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32)
        self.model.eval()
        self.eos = sorted(eos_token_ids)

    @torch.inference_mode()
    def run(self, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
        """Greedy continuation of `ids`; returns (new token ids, seconds including prefill)."""
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        out = self.model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_tokens, do_sample=False,
            eos_token_id=self.eos, pad_token_id=self.eos[0] if self.eos else None,
        )
        seconds = time.perf_counter() - t0
        return out[0, len(ids):].tolist(), seconds
