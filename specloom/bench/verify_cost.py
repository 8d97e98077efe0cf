"""The verify-cost curve v(n): time of one target pass over n new tokens (a draft tree of n nodes) relative to a
single-token decode step, measured on this machine at a given context length, cached per model and dtype.

Speculation pays when tau(n) / (v(n) + drafting cost) > 1; tree size and depth are chosen from this curve
(`scripts/tune_tree.py`), and later the serving scheduler reads it to pick depth per batch size.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time

import torch

from ..tokenizer import cache_dir, file_cache_key

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_tag(device: torch.device) -> str:
    """Cache-name suffix for measurements taken on `device`: empty on the CPU (names as before), else e.g.
    `-cuda-NVIDIA_H200`, so a curve measured on one device is never reused on another."""
    if device.type != "cuda":
        return ""
    return "-cuda-" + "".join(ch if ch.isalnum() else "_" for ch in torch.cuda.get_device_name(device))


@torch.inference_mode()
def measure_verify_cost(model, sizes=SIZES, context: int = 256, repeats: int = 7) -> dict[int, float]:
    """Median seconds of one forward pass over n tree nodes after `context` cached tokens (causal tree)."""
    kv = model.new_kv(context + max(sizes) + 1)
    dev = model.device
    prompt = torch.randint(0, model.config.vocab_size, (1, context), device=dev)
    model(prompt, torch.arange(context, device=dev)[None], kv, num_logits=1)
    kv.commit()
    out = {}
    for n in sizes:
        x = torch.randint(0, model.config.vocab_size, (1, n), device=dev)
        pos = torch.arange(context, context + n, device=dev)[None]
        mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril() if n > 1 else None
        times = []
        for _ in range(repeats + 1):
            sync(dev)
            t = time.perf_counter()
            model(x, pos, kv, attn_mask=mask)
            sync(dev)  # CUDA runs asynchronously: time the kernels, not their launch
            kv.truncate(context)
            times.append(time.perf_counter() - t)
        out[n] = statistics.median(times[1:])
    return out


def host_tag(model) -> str:
    """Cache-name part for measurements that depend on the host and on the model's linear kernel:
    `-h<host key>-<kernel tag>` (host.py, bench/kernel_probe.py)."""
    from ..host import host_key

    choice = getattr(model, "kernel_choice", None)
    return f"-h{host_key()}-{choice.tag if choice is not None else 'default'}"


def model_cache_key(model) -> str | None:
    """A cache key for the model's file (GGUF) or HF directory (its config.json and weight files); None for a
    model built in memory."""
    src = getattr(model, "source", None)
    if src is None:
        return None
    if os.path.isfile(src.path):
        return file_cache_key(src.path)
    if os.path.isdir(src.path):
        files = sorted(f for f in os.listdir(src.path) if f == "config.json" or f.endswith((".safetensors", ".bin")))
        if "config.json" in files:
            keys = "".join(file_cache_key(os.path.join(src.path, f)) for f in files)
            return hashlib.sha1(keys.encode()).hexdigest()[:16]
    return None


def verify_cost_curve(model, refresh: bool = False) -> dict[int, float]:
    """v(n) = t(n) / t(1), cached in ~/.cache/specloom/verify_cost/ per model file, dtype, host (CPU, threads,
    torch) and linear kernel."""
    key = model_cache_key(model)
    path = None
    if key:
        dt = str(model.dtype).replace("torch.", "")
        name = f"{key}-{dt}-t{torch.get_num_threads()}{host_tag(model)}{device_tag(model.device)}.json"
        path = os.path.join(cache_dir(), "verify_cost", name)
        if not refresh and os.path.isfile(path):
            try:
                with open(path) as f:
                    return {int(k): float(v) for k, v in json.load(f)["relative"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                pass  # unreadable (cut short, corrupt): measured again below and rewritten
    secs = measure_verify_cost(model)
    rel = {n: s / secs[1] for n, s in secs.items()}
    if path:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"seconds": secs, "relative": rel}, f, indent=1)
    return rel


def interpolate(curve: dict[int, float], n: int) -> float:
    xs = sorted(curve)
    if n <= xs[0]:
        return curve[xs[0]]
    for a, b in zip(xs, xs[1:]):
        if a <= n <= b:
            return curve[a] + (curve[b] - curve[a]) * (n - a) / (b - a)
    return curve[xs[-1]] * n / xs[-1]
