"""`specloom data` shards on disk: written compact, read in either form.

A shard holds `tokens`, `offsets` (conversation starts + one extra), `loss_mask` (1 on the target's answer tokens)
and `job_ids`, with a JSON metadata string. Written as `shard_NNNNN.safetensors.xz`: token ids as uint16 when the
vocabulary fits (int32 otherwise), the safetensors bytes compressed with LZMA -- about 0.9 bytes per token on
SmolLM2 self-distillation data (the loss mask is runs, the offsets few), against 5 uncompressed, so a 5M-token
dataset fits in the repository (`datasets/`). Shards of the first format (`shard_NNNNN.safetensors`, int32
tokens, possibly with hidden states) are read as before.
"""

from __future__ import annotations

import glob
import lzma
import os

import torch

from ..atomic import replacing
from ..errors import SpecloomError

SUFFIX = ".safetensors.xz"


def shard_files(directory: str) -> list[str]:
    """The shards of a data directory, in shard order (either form)."""
    files = glob.glob(os.path.join(directory, "shard_*.safetensors")) + glob.glob(os.path.join(directory,
                                                                                               f"shard_*{SUFFIX}"))
    return sorted(files, key=lambda f: os.path.basename(f).split(".")[0])


def shard_index(path: str) -> int:
    return int(os.path.basename(path)[6:11])


def write_shard(directory: str, index: int, tensors: dict, metadata: dict[str, str], vocab_size: int) -> str:
    """Write shard `index` compact and atomically; return its path."""
    from safetensors.torch import save

    tensors = dict(tensors)
    if vocab_size <= 1 << 16:
        tensors["tokens"] = tensors["tokens"].to(torch.int32).to(torch.uint16)
    path = os.path.join(directory, f"shard_{index:05d}{SUFFIX}")
    data = lzma.compress(save(tensors, metadata=metadata), preset=6)
    with replacing(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
    return path


def read_shard(path: str, keys: tuple[str, ...]) -> tuple[dict, dict]:
    """({key: tensor}, metadata) of one shard; token ids come back as int32 whatever they were stored as."""
    try:
        if path.endswith(SUFFIX):
            from safetensors.torch import load

            with open(path, "rb") as f:
                raw = lzma.decompress(f.read())
            tensors = load(raw)
            meta = _metadata(raw)
            d = {k: tensors[k] for k in keys}
        else:
            from safetensors import safe_open

            with safe_open(path, framework="pt") as f:
                d = {k: f.get_tensor(k) for k in keys}
                meta = f.metadata() or {}
    except Exception as e:  # cut short, corrupt, not a shard
        raise SpecloomError(f"{path}: not a readable specloom data shard ({e})") from None
    if "tokens" in d and d["tokens"].dtype != torch.int32:
        d["tokens"] = d["tokens"].to(torch.int32)
    return d, meta


def _metadata(raw: bytes) -> dict:
    """The `__metadata__` of safetensors bytes (the header is 8 bytes of length, then JSON)."""
    import json

    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]).get("__metadata__") or {}
