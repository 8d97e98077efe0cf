"""The C kernels specloom builds on first use (models/kernels/*.c): compiled once per source, flags and compiler
into ~/.cache/specloom/kernels/, loaded with ctypes, checked on a small case before use.

    fn = load_kernel(state, "invariant_linear.c", "invariant_linear", argtypes, check)

`state` is the caller's dict: after the call it holds "fn" (the ctypes function) or "why" (the reason the kernel
is unavailable: no AVX2, no compiler, a failed build or check, or `SPECLOOM_INVARIANT_KERNEL=0`). An unavailable
kernel is never an error; the callers fall back to PyTorch's own ops. A cached shared object that no longer loads
(cut short, corrupt) is removed and built again once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile

import torch

KERNEL_DIR = os.path.join(os.path.dirname(__file__), "kernels")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC"]


def kernels_version() -> str:
    """12 hex digits of a hash of every kernel source: part of the keys of measurements taken with them (the
    kernel choice's probe, verify-cost curves), so that new kernels are measured again."""
    h = hashlib.sha1()
    for name in sorted(os.listdir(KERNEL_DIR)):
        if name.endswith(".c"):
            with open(os.path.join(KERNEL_DIR, name), "rb") as f:
                h.update(f.read())
    return h.hexdigest()[:12]


def compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return shutil.which(cc)
    return None


def build(cc: str, source: str) -> str:
    """The shared object of kernels/`source` (built now unless cached); raises RuntimeError on a failed build."""
    from ..tokenizer import cache_dir

    with open(os.path.join(KERNEL_DIR, source), "rb") as f:
        src = f.read()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    key = hashlib.sha1(src + " ".join(FLAGS + [version]).encode()).hexdigest()[:12]
    out_dir = os.path.join(cache_dir(), "kernels")
    path = os.path.join(out_dir, f"{os.path.splitext(source)[0]}-{key}.so")
    if os.path.isfile(path):
        return path
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, os.path.join(KERNEL_DIR, source), "-o", tmp], capture_output=True,
                           text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{os.path.basename(cc)} failed: {(r.stderr or r.stdout).strip()[:300]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _open(cc: str, source: str) -> ctypes.CDLL:
    path = build(cc, source)
    try:
        return ctypes.CDLL(path)
    except OSError as e:  # a cached object cut short or corrupt: named, moved aside, built again (once)
        logging.getLogger("specloom").warning("specloom: the cached kernel %s does not load (%s): moved aside to "
                                              "%s.bad, rebuilding", path, e, path)
        os.replace(path, path + ".bad")
        return ctypes.CDLL(build(cc, source))


def load_kernel(state: dict, source: str, symbol: str, argtypes: list, check, restype=ctypes.c_int):
    """Fill `state` with "fn" or "why" (once) and return the function or None. `check(fn)`: None when the
    kernel is right on a small case, else the reason it is not."""
    if state:
        return state.get("fn")
    why = None
    if os.environ.get("SPECLOOM_INVARIANT_KERNEL", "1") == "0":
        why = "disabled by SPECLOOM_INVARIANT_KERNEL=0"
    elif torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        why = f"this CPU has no AVX2 (PyTorch reports {torch.backends.cpu.get_cpu_capability()})"
    elif (cc := compiler()) is None:
        why = "no C compiler (cc, gcc or clang; or $CC) to build it"
    fn = None
    if why is None:
        try:
            fn = getattr(_open(cc, source), symbol)
            fn.restype = restype
            fn.argtypes = argtypes
            why = check(fn)
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as e:
            why = f"build failed: {e}"
    if why is None:
        state["fn"] = fn
    else:
        state["why"] = why
    return state.get("fn")
