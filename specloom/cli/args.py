"""Argument types and option groups shared by the commands."""

from __future__ import annotations

import argparse

from ..training.options import positive_int  # noqa: F401  (one copy: the kinds' train options use it)


def seconds(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not 0 <= t < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value}")
    return t


def device_option(p: argparse.ArgumentParser) -> None:
    # checked in main() (loading.parse_device), so that a bad name is one SpecloomError line, not argparse usage
    p.add_argument("--device", default=None, metavar="{cpu,cuda,cuda:N}",
                   help="where the target and its drafter run (default: cuda when PyTorch sees a GPU, else cpu)")


KV_CACHE_DTYPES = "auto,fp32,bf16,fp16,fp8_e4m3,fp8_e5m2,int8"  # kv_quant.CHOICES (checked in main())


def kv_cache_dtype_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", default="auto", metavar=f"{{{KV_CACHE_DTYPES}}}",
                   help="the target's KV cache type (vLLM's name; --kv-dtype is an alias). auto: fp32 on CPU (faster "
                        "there for attention over few queries), the model's dtype elsewhere; fp8_e4m3, fp8_e5m2 and "
                        "int8 store codes with one fp32 scale per token and head. The drafter's own KV: "
                        "\"kv_cache_dtype\" in --speculative-config")


def common_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="alias (smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b), "
                   "a .gguf file or a HF model directory")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weights and KV dtype (default bf16)")
    kv_cache_dtype_option(p)
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM-style JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    p.add_argument("--max-tokens", type=positive_int, default=128, help="tokens to generate (default 128)")
    p.add_argument("--speculation", default="auto", choices=["auto", "fixed", "off"],
                   help="draft depth per step: auto (default: from this host's verify-cost curve and the request's "
                        "acceptance; plain decoding where the drafter cannot pay), fixed (the drafter's own depth), "
                        "off")
    p.add_argument("--linear-kernel", default="auto",
                   choices=["auto", "ggml", "onednn", "invariant", "native", "fp32", "int8"],
                   help="the target's linear kernel: auto (default: measured once per host by whole decode steps and "
                        "verification passes, among ggml -- a GGUF's 4/8-bit blocks as shipped -- and the kernels "
                        "that run its weights dequantised to bf16); ggml keeps the blocks, any other name "
                        "dequantises; fp32 and int8 change a bf16 model's numerics (opt-in)")
    device_option(p)
