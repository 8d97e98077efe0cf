"""GGUF loader: metadata -> HF-style config dict, tensors -> dequantized HF-convention state dict.

Dequantization uses the `gguf` package (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K, ...). Two
llama.cpp conventions are undone so that the result is exactly what HF transformers would load:
* for the Llama architecture, convert_hf_to_gguf permutes the rows of q and k for its interleaved RoPE; we apply
  the inverse permutation (Qwen2/Qwen3/Gemma-3 use NeoX RoPE in llama.cpp and are stored unpermuted);
* for Gemma, llama.cpp stores RMSNorm weights as 1 + w; we subtract 1 (HF stores w).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np
import torch
from tqdm import tqdm

from ..errors import SpecloomError

# GGUF `general.architecture` -> HF model_type
_ARCH_TO_MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}

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
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@functools.lru_cache(maxsize=2)
def _reader_cached(path: str, size: int, mtime_ns: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # the gguf package raises ValueError/struct errors/etc. on bad files
        raise SpecloomError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _reader(path: str):
    """One parsed reader per file and process: parsing a 262k-token vocabulary takes ~13 s here."""
    st = os.stat(path)
    return _reader_cached(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def _config_cache_path(path: str) -> str:
    from ..tokenizer import cache_dir, file_cache_key

    return os.path.join(cache_dir(), "gguf-config", file_cache_key(path) + ".json")


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(path: str) -> dict:
    """Read a GGUF header and return a HF-style config dict (keys as in `config.json`); cached on disk."""
    cached = _config_cache_path(path)
    if os.path.isfile(cached):
        with open(cached) as f:
            return json.load(f)
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
    if arch not in _ARCH_TO_MODEL_TYPE:
        raise SpecloomError(
            f"{os.path.basename(path)}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(_ARCH_TO_MODEL_TYPE)})"
        )

    def get(key, default=None):
        return _field(r, f"{arch}.{key}", default)

    n_tokens = len(r.fields["tokenizer.ggml.tokens"].data) if "tokenizer.ggml.tokens" in r.fields else None
    cfg = {
        "model_type": _ARCH_TO_MODEL_TYPE[arch],
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
    if arch == "gemma3":
        cfg["sliding_window"] = get("attention.sliding_window", 512)
        cfg["sliding_window_pattern"] = get("attention.sliding_window_pattern", 6)
        cfg["rope_local_base_freq"] = 10000.0
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "qwen2":
        cfg["attention_bias"] = True
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


def gguf_tensors(path: str, cfg: dict, progress: bool = True):
    """Yield (HF name, fp32 tensor) for every tensor of the GGUF file, dequantized."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    r = _reader(path)
    arch = _field(r, "general.architecture")
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for t in tqdm(r.tensors, desc="dequantizing GGUF", unit="tensor", disable=not progress, leave=False):
        name = t.name
        if name in _TENSOR_NAMES:
            hf = _TENSOR_NAMES[name]
        elif name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            base, kind = rest.rsplit(".", 1)
            if arch == "gemma3" and base == "ffn_norm":
                mapped = "pre_feedforward_layernorm"
            elif base == "ffn_norm":
                mapped = "post_attention_layernorm"
            elif base in _BLOCK_NAMES:
                mapped = _BLOCK_NAMES[base]
            else:
                raise SpecloomError(f"{os.path.basename(path)}: unknown GGUF tensor {name!r}")
            hf = f"model.layers.{idx}.{mapped}.{kind}"
        else:
            raise SpecloomError(f"{os.path.basename(path)}: unknown GGUF tensor {name!r}")
        try:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                arr = np.array(t.data, dtype=np.float32)  # a copy: the reader's memory map is read-only
            else:
                arr = dequantize(t.data, t.tensor_type)
            arr = arr.reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
        except (NotImplementedError, ValueError) as e:
            raise SpecloomError(f"{name}: cannot dequantize GGUF type {t.tensor_type.name}: {e}") from None
        if arch == "llama" and base_in(name, "attn_q"):
            arr = _unpermute(arr, n_head)
        elif arch == "llama" and base_in(name, "attn_k"):
            arr = _unpermute(arr, n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr - 1.0
        yield hf, torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))


def base_in(name: str, base: str) -> bool:
    parts = name.split(".")
    return len(parts) == 4 and parts[2] == base
