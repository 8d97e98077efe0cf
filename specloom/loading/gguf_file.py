"""GGUF loader: metadata -> HF-style config dict, tensors -> HF-convention names holding GGUF tensors.

`gguf_raw_tensors` names every tensor the HF way and wraps it as a `GGUFTensor`, still quantized; the `gguf`
weight format (`specloom.loading.formats`) dequantizes it with `dequantize_gguf` when the loader asks. Files are
parsed by `gguf_reader.GGUFFile` (fast metadata, memory-mapped tensors); dequantization uses the `gguf` package
(F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, ...). Two llama.cpp conventions are undone so that the result is exactly what HF transformers would load; which architecture has which is in its
family's record (`specloom.models.family.FamilySpec`):
* `gguf_permuted_qk_archs` (Llama): convert_hf_to_gguf permutes the rows of q and k for its interleaved RoPE; we
  apply the inverse permutation (Qwen2/Qwen3/Gemma-3 use NeoX RoPE in llama.cpp and are stored unpermuted);
* `norm_weight_offset` (Gemma: 1): llama.cpp stores RMSNorm weights as offset + w; we subtract it (HF stores w).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from ..errors import SpecloomError
from ..models.family import spec_for_gguf_arch, supported_gguf_archs
from .gguf_reader import GGUFFile, GGUFFormatError

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}  # + the family's `gguf_block_names` (what `ffn_norm` is, Gemma's sandwich norms)


@functools.lru_cache(maxsize=2)
def _reader_cached(path: str, size: int, mtime_ns: int) -> GGUFFile:
    try:
        return GGUFFile(path)
    except (GGUFFormatError, OSError, ValueError) as e:
        raise SpecloomError(f"{path}: not a readable GGUF file ({e})") from None


def release_pages(path: str) -> None:
    """Drop the file's pages from this process's resident set once its weights are loaded (they were copied,
    repacked or dequantised; a weight held as shipped on a host without the repacked path reads them again from
    the page cache when it runs)."""
    st = os.stat(path)
    r = _reader_cached(os.path.abspath(path), st.st_size, st.st_mtime_ns)
    r.release_pages()


def _reader(path: str) -> GGUFFile:
    """One parsed file per path and process (metadata parsed, tensors memory-mapped)."""
    st = os.stat(path)
    return _reader_cached(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def _config_cache_path(path: str) -> str:
    from ..tokenizer import cache_dir, file_cache_key

    return os.path.join(cache_dir(), "gguf-config", file_cache_key(path) + ".json")


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def gguf_config(path: str) -> dict:
    """Read a GGUF header and return a HF-style config dict (keys as in `config.json`); cached on disk."""
    cached = _config_cache_path(path)
    if os.path.isfile(cached):
        try:
            with open(cached) as f:
                cfg = json.load(f)
            if isinstance(cfg, dict) and cfg:
                return cfg
            raise ValueError("not a config object")
        except (OSError, ValueError) as e:  # cut short or corrupt: read the header again and rewrite it
            logging.getLogger("specloom").warning("GGUF config cache %s is unreadable (%s): rebuilding it", cached, e)
    cfg = _gguf_config(path)
    try:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = cached + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cfg, f)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache only costs time
    return cfg


def _gguf_config(path: str) -> dict:
    r = _reader(path)
    arch = _field(r, "general.architecture")
    spec = spec_for_gguf_arch(arch)
    if spec is None:
        raise SpecloomError(
            f"{os.path.basename(path)}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(supported_gguf_archs())})"
        )

    def get(key, default=None):
        return _field(r, f"{arch}.{key}", default)

    n_tokens = len(r.fields["tokenizer.ggml.tokens"]) if "tokenizer.ggml.tokens" in r.fields else None
    cfg = {
        "model_type": spec.gguf_archs[arch],
        "hidden_size": get("embedding_length"),
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": get("attention.head_count"),
        "num_key_value_heads": get("attention.head_count_kv"),
        "head_dim": get("attention.key_length"),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 4096),
        "vocab_size": get("vocab_size", n_tokens),
        "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in r.tensors),
    }
    if spec.gguf_config is not None:
        cfg.update(spec.gguf_config(arch, get, cfg))
    if any(t.name == "rope_freqs.weight" for t in r.tensors):
        raise SpecloomError(
            f"{os.path.basename(path)}: Llama-3.1-style rope_freqs in GGUF are not supported yet; "
            "load the model from its HF directory instead"
        )
    missing = [k for k, v in cfg.items() if v is None and k not in ("bos_token_id", "eos_token_id", "head_dim")]
    if missing:
        raise SpecloomError(f"{os.path.basename(path)}: GGUF metadata lacks {missing}")
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute(w, n_head)` on the rows of a q/k projection (or bias)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class GGUFTensor:
    """One GGUF tensor (yielded with its HF name), not yet dequantized; `fix` then undoes a llama.cpp
    convention."""

    name: str  # the GGUF name (`blk.3.attn_q.weight`)
    tensor: object  # a `gguf_reader.GGUFReaderTensor`: `.tensor_type`, `.data` (a memory map), `.shape`
    fix: Callable[[np.ndarray], np.ndarray] | None = None

    @property
    def type_name(self) -> str:
        return self.tensor.tensor_type.name


def gguf_raw_tensors(path: str, cfg: dict):
    """Yield (HF name, `GGUFTensor`) for every tensor of the GGUF file, without dequantizing anything."""
    r = _reader(path)
    arch = _field(r, "general.architecture")
    spec = spec_for_gguf_arch(arch)
    if spec is None:
        raise SpecloomError(f"{os.path.basename(path)}: GGUF architecture {arch!r} is not supported")
    block_names = {**_BLOCK_NAMES, **spec.gguf_block_names}
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    permuted = arch in spec.gguf_permuted_qk_archs
    offset = spec.norm_weight_offset
    for t in r.tensors:
        name = t.name
        base = None
        if name in _TENSOR_NAMES:
            hf = _TENSOR_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            base, kind = rest.rsplit(".", 1)
            if base not in block_names:
                raise SpecloomError(f"{os.path.basename(path)}: unknown GGUF tensor {name!r}")
            hf = f"model.layers.{idx}.{block_names[base]}.{kind}"
        else:
            raise SpecloomError(f"{os.path.basename(path)}: unknown GGUF tensor {name!r}")
        fix = None
        if permuted and base in heads:
            fix = functools.partial(_unpermute, n_head=heads[base])
        elif offset and name.endswith("norm.weight"):
            fix = _minus(offset)
        yield hf, GGUFTensor(name, t, fix)


def _minus(offset: float):
    def fix(arr: np.ndarray) -> np.ndarray:
        return arr - offset  # stays float32

    return fix


def dequantize_gguf(t: GGUFTensor) -> torch.Tensor:
    """A `GGUFTensor` as a fp32 torch tensor in HF's layout and convention."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    raw = t.tensor
    try:
        if raw.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            arr = np.array(raw.data, dtype=np.float32)  # a copy: the reader's memory map is read-only
        else:
            arr = dequantize(raw.data, raw.tensor_type)
        arr = arr.reshape(tuple(int(x) for x in reversed(raw.shape.tolist())))
    except (NotImplementedError, ValueError) as e:
        raise SpecloomError(f"{t.name}: cannot dequantize GGUF type {raw.tensor_type.name}: {e}") from None
    if t.fix is not None:
        arr = t.fix(arr)
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def gguf_blocks(t: GGUFTensor) -> tuple[torch.Tensor, int]:
    """A quantized 2-D `GGUFTensor` as shipped: (uint8 blocks (rows, bytes per row), weights per row), rows in
    HF's order (a row permutation such as the q/k unpermute moves whole rows of blocks)."""
    raw = t.tensor
    dims = [int(x) for x in raw.shape.tolist()]
    if len(dims) != 2:
        raise SpecloomError(f"{t.name}: a {len(dims)}-D GGUF tensor cannot be held as a linear's blocks")
    arr = np.asarray(raw.data)
    if arr.ndim != 2 or arr.shape[0] != dims[1]:
        raise SpecloomError(f"{t.name}: GGUF {raw.tensor_type.name} data of shape {list(arr.shape)} does not hold "
                            f"{dims[1]} rows of {dims[0]} weights (truncated or malformed)")
    if t.fix is not None:
        arr = np.ascontiguousarray(t.fix(arr))  # a row permutation: a copy
    if not arr.flags.writeable:  # a view of the file's pages, read only: the kernels only read it
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.from_numpy(arr), dims[0]
    return torch.from_numpy(arr), dims[0]


def gguf_dequantizable(type_name_or_type) -> bool:
    """Whether the installed `gguf` package can dequantize this GGML type."""
    from gguf import GGMLQuantizationType

    try:
        qtype = GGMLQuantizationType[type_name_or_type] if isinstance(type_name_or_type, str) \
            else GGMLQuantizationType(type_name_or_type)
    except (KeyError, ValueError):
        return False
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return True
    import gguf.quants

    traits = getattr(gguf.quants, "_type_traits", None)
    return traits is None or qtype in traits  # unknown package layout: let dequantization decide


def gguf_tensors(path: str, cfg: dict, progress: bool = True):
    """Yield (HF name, fp32 tensor) for every tensor of the GGUF file, dequantized."""
    raw = list(gguf_raw_tensors(path, cfg))
    for hf, t in tqdm(raw, desc="dequantizing GGUF", unit="tensor", disable=not progress, leave=False):
        yield hf, dequantize_gguf(t)
