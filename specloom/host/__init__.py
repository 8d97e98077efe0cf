"""This host's compute capability: recorded in every benchmark report and part of every per-host cache key.

Hosts of our kind differ in what makes speculation pay. On a CPU whose oneDNN runs bf16 (AVX512-BF16 / AMX) a
bf16 pass over 9 tokens costs about 1.2 single-token passes; on an AVX2-only CPU the same pass costs about 9
(each bf16 matmul grows with its rows), so drafters that pay on the first lose on the second. Kernel choice
(`host/kernel_choice.py`), verify-cost curves (`cost.py`) and the depth
policy therefore read measurements taken on this host, cached under a key from `host_key()`.

    host_info()   -> {"cpu": ..., "cpu_flags": [...], "mkldnn_bf16": ..., "threads": ..., "torch": ...}
    host_line()   -> one line for a report's header
    host_key()    -> a short hash of what the measurements depend on (CPU model and flags, oneDNN bf16,
                     threads, torch version)

May import: errors and the standard library (and models/ for the kernel choice); nothing above the models.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import platform

import torch

# CPU flags that decide which matmul kernels exist (Linux /proc/cpuinfo names)
FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:  # not Linux
        pass
    return model or platform.processor() or platform.machine(), frozenset(flags)


def mkldnn_bf16() -> bool:
    """Whether oneDNN runs bf16 matmuls natively here (the packed bf16 path; see models/cpu_packing.py)."""
    from ..models import cpu_packing

    return cpu_packing.onednn_bf16_supported()


def host_kind(info: dict | None = None) -> str:
    """"bf16" for a CPU whose oneDNN runs bf16 (multi-token bf16 passes are nearly free), else "no-bf16"."""
    info = info or host_info()
    return "bf16" if info["mkldnn_bf16"] else "no-bf16"


def host_info(device: torch.device | str | None = None) -> dict:
    """The host's CPU capability and software, as reports record it."""
    model, flags = _cpuinfo()
    info = {
        "cpu": model,
        "cpu_flags": [f for f in FLAGS if f in flags],
        "isa": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": bool(mkldnn_bf16()),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    info["kind"] = host_kind(info)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(dev)
    return info


def host_line(info: dict | None = None) -> str:
    """`host: <cpu> [flags] | oneDNN bf16: yes | 2 threads | torch 2.13.0` (+ GPU)."""
    info = info or host_info()
    flags = " ".join(info["cpu_flags"]) or "no AVX2"
    gpu = f" | GPU {info['gpu']}" if info.get("gpu") else ""
    return (f"host: {info['cpu']} [{flags}; {info['isa']}] | oneDNN bf16: {'yes' if info['mkldnn_bf16'] else 'no'} "
            f"| {info['threads']} threads | torch {info['torch']}{gpu}")


def host_key() -> str:
    """12 hex digits naming what cached measurements depend on; a different CPU, flag set, oneDNN bf16 support,
    thread count or torch version gives a different key (so a cache copied between hosts is never reused)."""
    info = host_info()
    parts = {k: info[k] for k in ("cpu", "cpu_flags", "isa", "mkldnn_bf16", "threads", "torch")}
    return hashlib.sha1(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def last_level_cache_bytes() -> int:
    """This CPU's last-level cache (Linux sysfs; 32 MiB where it cannot be read)."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip().upper()
            sizes.append(int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text))
        except (OSError, ValueError, IndexError):
            continue
    return max(sizes, default=32 << 20)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
