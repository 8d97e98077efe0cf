"""A target's behavioural fingerprint: what it predicts on a small fixed probe, recorded with every drafter
checkpoint and dataset, and a distance between that recording and the target actually loaded.

The structural fingerprint (fingerprint.py) hashes shapes, vocabulary, embedding and head; a fine-tune that
leaves those alone, or a re-quantization (which keeps embeddings dense), passes it unseen. This one looks at the
target's output instead:

* **The probe**: `fingerprint_probe.txt`, packaged with specloom -- 219 SmolLM2 tokens of prose, a plain
  chat exchange, Python and arithmetic -- tokenized by the target's own tokenizer (no chat template, no special
  tokens). A tokenizer that cannot spell it (more than half unknown tokens: toy word-level tokenizers) gets the
  text's UTF-8 bytes modulo its vocabulary size instead. The token ids are part of the recording, so the distance
  never depends on the tokenizer or on the probe text of the specloom version that reads it.
* **Recording** (`record_probe`): one teacher-forced forward pass over the probe, in fp32 (a target held in
  another dtype is reloaded in fp32 from its source for it, or copied to fp32; failing both, its own dtype is used
  and named), keeping at each position t the top-k (k = 8) next-token ids and their log-probabilities, and the
  log of the probability mass left outside them.
* **Format**: a JSON object, `target_probe`, next to `target_fingerprint` in the `specloom` block of a drafter's
  config.json (and in a dataset's meta.json), so it travels with every copy of the config (quantize, overlays
  built into a target checkpoint). Arrays are little-endian, base64: `input_ids` int32 (T), `topk_ids` int32
  (T, k), `topk_logprobs` fp16 (T, k), `rest_logprob` fp16 (T). About 16 KB for T = 219, k = 8.
* **Distance** (`behavioural_distance`): one forward pass of the actual target over the recorded `input_ids`
  (no gradient, a fresh KV store, the target's own dtype and kernels). At each position t let S_t be the recorded
  top-k ids and p_t the recorded distribution coarse-grained to k + 1 outcomes -- each id of S_t, and "any other
  token" -- (exp of the stored log-probabilities, renormalised over the k + 1 outcomes to absorb fp16 rounding),
  and q_t the actual target's full-vocabulary softmax coarse-grained the same way (its probabilities at S_t, and
  one minus their sum). Then

      KL_t = sum_{o in S_t + {rest}} p_t(o) * (log p_t(o) - log q_t(o))
      kl_mean = mean_t KL_t          (nats; 0 for the same model; a lower bound on the mean full-vocabulary KL)
      top1_agreement = mean_t [argmax_v q_t(v) == recorded top-1 id]
      topk_overlap = mean_t |S_t  intersect  actual top-k| / k

  `kl_max` (the worst position) and `positions` come with them. Mass that moves out of the recorded top-k shows
  through the "rest" outcome, which a KL renormalised over S_t alone would miss.
* **Thresholds** (`KL_WARN`, `TOP1_WARN`): chosen from measurements on SmolLM2-135M (BENCHMARKS.md, "Behavioural
  fingerprint"): the same checkpoint in bf16 against its fp32 recording must stay quiet.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import logging
import os
import time
import warnings
import weakref

import numpy as np
import torch

log = logging.getLogger("specloom")

PROBE_FILE = os.path.join(os.path.dirname(__file__), "fingerprint_probe.txt")
VERSION = 1
TOP_K = 8
# Measured on SmolLM2-135M (Q4_1 GGUF) against its own fp32 recording, 219 positions (BENCHMARKS.md, "Behavioural
# fingerprint"): loaded in fp32 KL 7e-8 / top-1 100 %; in bf16 KL 0.0008 / top-1 97.3 %; re-exported as FP8 (RTN,
# 128x128 blocks) 0.014 / 93-94 %; as NVFP4 0.18 / 75-76 %. The limits keep bf16 quiet with a wide margin (60x in
# KL), report FP8 in the log line only, and warn for NVFP4.
KL_WARN = 0.05
TOP1_WARN = 0.90


def probe_text() -> str:
    with open(PROBE_FILE, encoding="utf-8") as f:
        return f.read()


def probe_ids(tokenizer, vocab_size: int, max_len: int = 4096) -> list[int]:
    """The probe as token ids of this tokenizer (bytes modulo the vocabulary when it cannot spell the text)."""
    text = probe_text()
    ids: list[int] = []
    if tokenizer is not None:
        ids = tokenizer.encode(text, special=False)
        unk = getattr(tokenizer.hf, "unk_token_id", None)
        if unk is not None and sum(i == unk for i in ids) * 2 > len(ids):
            ids = []
    if not ids or max(ids) >= vocab_size:
        ids = [b % vocab_size for b in text.encode("utf-8")][:320]
    return ids[:max_len]


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes()).decode("ascii")


def _unb64(s: str, dtype, shape) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(s), dtype=np.dtype(dtype).newbyteorder("<"))
    return a.astype(np.dtype(dtype)).reshape(shape)


@torch.inference_mode()
def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """(T, V) fp32 next-token log-probabilities of one teacher-forced pass over `ids`."""
    T = len(ids)
    dev = model.device
    kv = model.new_kv(T)
    tokens = torch.tensor([ids], dtype=torch.long, device=dev)
    out = model(tokens, torch.arange(T, device=dev)[None], kv)
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def _split(logp: torch.Tensor, top_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log-probabilities at `top_ids` (T, k) and log of the mass outside them (T,)."""
    top = logp.gather(1, top_ids)
    rest = logp.scatter(1, top_ids, float("-inf")).logsumexp(1)
    return top, rest


def _fp32_twin(model):
    """(an fp32 copy of `model`, how it was made) -- the model itself when it is fp32 already."""
    if model.dtype == torch.float32:
        return model, "float32"
    source = getattr(model, "source", None)
    if source is not None:
        try:
            from .loading import load_target

            twin, _ = load_target(source.path, "fp32", progress=False, pack=False, device=model.device)
            return twin, "float32 (reloaded)"
        except Exception as e:  # noqa: BLE001 -- out of memory, a source moved away: fall back below
            log.info("specloom: behavioural probe: fp32 reload of %s failed (%s)", source.path, e)
    try:
        return copy.deepcopy(model).float(), "float32 (copied from %s)" % str(model.dtype).replace("torch.", "")
    except Exception as e:  # noqa: BLE001 -- packed kernels that cannot be cast
        log.info("specloom: behavioural probe: no fp32 copy (%s); recording in %s", e, model.dtype)
        return model, str(model.dtype).replace("torch.", "")


def record_probe(model, tokenizer, k: int = TOP_K) -> dict:
    """The `target_probe` recording of `model` (see the module docstring for the format)."""
    ids = probe_ids(tokenizer, model.config.vocab_size, model.config.max_position)
    twin, how = _fp32_twin(model)
    try:
        logp = _logprobs(twin, ids)
    except Exception as e:  # noqa: BLE001 -- a copy whose kernels did not take the cast
        if twin is model:
            raise
        log.info("specloom: behavioural probe: the fp32 copy failed (%s); recording in %s", e, model.dtype)
        how = str(model.dtype).replace("torch.", "")
        logp = _logprobs(model, ids)
    del twin
    top, top_ids = logp.topk(k, dim=1)
    _, rest = _split(logp, top_ids)
    return {
        "version": VERSION,
        "probe_sha": hashlib.sha1(probe_text().encode("utf-8")).hexdigest()[:16],
        "k": k,
        "positions": len(ids),
        "dtype": how,
        "input_ids": _b64(np.asarray(ids, dtype=np.int32)),
        "topk_ids": _b64(top_ids.cpu().numpy().astype(np.int32)),
        "topk_logprobs": _b64(top.cpu().numpy().astype(np.float16)),
        "rest_logprob": _b64(rest.cpu().numpy().astype(np.float16)),
    }


def decode_probe(recorded: dict) -> dict:
    """The arrays of a recording as tensors: input_ids (T,), topk_ids (T, k), topk_logprobs (T, k) fp32,
    rest_logprob (T,) fp32. Raises ValueError on a malformed recording."""
    try:
        T, k = int(recorded["positions"]), int(recorded["k"])
        return {
            "input_ids": torch.from_numpy(_unb64(recorded["input_ids"], np.int32, (T,)).astype(np.int64)),
            "topk_ids": torch.from_numpy(_unb64(recorded["topk_ids"], np.int32, (T, k)).astype(np.int64)),
            "topk_logprobs": torch.from_numpy(_unb64(recorded["topk_logprobs"], np.float16, (T, k)).astype(np.float32)),
            "rest_logprob": torch.from_numpy(_unb64(recorded["rest_logprob"], np.float16, (T,)).astype(np.float32)),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed target_probe recording ({type(e).__name__}: {e})") from None


def behavioural_distance(model, tokenizer, recorded: dict) -> dict:
    """How far `model` has moved from the target `recorded` was made on: {"kl_mean", "kl_max", "top1_agreement",
    "topk_overlap", "positions", "seconds", "exceeds", "recorded_dtype"} (definitions: the module docstring;
    `exceeds` is whether KL_WARN or TOP1_WARN is crossed). One forward pass of `model` over the recorded probe ids.
    `tokenizer` is not needed (the ids are recorded) and may be None. Raises ValueError on a malformed recording
    or one whose ids do not fit this model's vocabulary."""
    t0 = time.perf_counter()
    rec = decode_probe(recorded)
    ids, top_ids = rec["input_ids"], rec["topk_ids"]
    V = model.config.vocab_size
    if len(ids) == 0 or int(ids.max()) >= V or int(top_ids.max()) >= V:
        raise ValueError(f"the recorded probe's token ids do not fit this target's vocabulary ({V})")
    logp = _logprobs(model, ids.tolist()).cpu()
    q_top, q_rest = _split(logp, top_ids)
    p = torch.cat([rec["topk_logprobs"], rec["rest_logprob"][:, None]], 1)
    p = p - p.logsumexp(1, keepdim=True)  # fp16 rounding: renormalise over the k + 1 outcomes
    q = torch.cat([q_top, q_rest[:, None]], 1)
    q = q - q.logsumexp(1, keepdim=True)  # exact already, up to fp32 rounding over the vocabulary
    p, q = p.double(), q.double()
    kl = (p.exp() * (p - q)).nan_to_num(0.0).sum(1).clamp_min(0.0).float()  # (T,); 0 * (-inf - x) counts 0
    k = top_ids.shape[1]
    actual_top = logp.topk(k, dim=1).indices
    overlap = (actual_top[:, :, None] == top_ids[:, None, :]).any(2).float().sum(1) / k
    kl_mean = float(kl.mean())
    top1 = float((logp.argmax(1) == top_ids[:, 0]).float().mean())
    return {
        "kl_mean": kl_mean,
        "kl_max": float(kl.max()),
        "top1_agreement": top1,
        "topk_overlap": float(overlap.mean()),
        "positions": int(len(ids)),
        "recorded_dtype": recorded.get("dtype"),
        "exceeds": kl_mean > KL_WARN or top1 < TOP1_WARN,
        "seconds": round(time.perf_counter() - t0, 3),
    }


_MEMO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _weights_key(model) -> int:
    """Changes when any parameter or buffer of `model` is replaced or modified in place (storage, version
    counter), so a memoised distance is never reused for edited weights."""
    def version(t):
        try:
            return t._version
        except RuntimeError:  # an inference tensor keeps no version counter: never memoised
            return object()

    return hash(tuple((t.data_ptr(), version(t), t.dtype) for t in (*model.parameters(), *model.buffers())))


def memoised_distance(model, tokenizer, recorded: dict) -> dict:
    """`behavioural_distance`, computed once per target and recording in a process (again when the target's
    weights change): the drafter load's check, `specloom doctor` and the server's start-up check share one pass."""
    key = (hashlib.sha1(json.dumps(recorded, sort_keys=True).encode()).hexdigest(), _weights_key(model))
    memo = _MEMO.setdefault(model, {})
    d = memo.get(key)
    if d is None:
        d = behavioural_distance(model, tokenizer, recorded)
        memo.clear()
        memo[key] = d
    return d


def check_behaviour(recorded: dict | None, model, where: str, tokenizer=None,
                    subject: str = "this drafter") -> dict | None:
    """On drafter (or dataset) load: the distance to `recorded` as a log line, and a warning beyond the thresholds
    naming `subject`. Silent and None without a recording (checkpoints older than the probe) or with
    SPECLOOM_BEHAVIOUR_CHECK=0. A distance is computed once per target and recording in a process (a server or
    benchmark loading several drafters pays one pass each), again when the target's weights change."""
    if not recorded or os.environ.get("SPECLOOM_BEHAVIOUR_CHECK", "1") == "0":
        return None
    try:
        d = memoised_distance(model, tokenizer, recorded)
    except ValueError as e:
        log.info("specloom: %s: behavioural fingerprint not compared (%s)", where, e)
        return None
    line = (f"{where}: target behaviour vs the recorded target: KL {d['kl_mean']:.4f} nats, top-1 agreement "
            f"{d['top1_agreement']:.1%}, top-k overlap {d['topk_overlap']:.1%} "
            f"({d['positions']} probe positions, {d['seconds']:.2f}s)")
    log.info("specloom: %s", line)
    if d["exceeds"]:
        msg = (f"{where}: the target behaves differently from the one {subject} was made with (on the probe: KL "
               f"{d['kl_mean']:.3f} nats, limit {KL_WARN}; top-1 agreement {d['top1_agreement']:.1%}, limit "
               f"{TOP1_WARN:.0%}) -- a fine-tune or another quantization?; output stays exact but acceptance may "
               "be low")
        warnings.warn(msg, stacklevel=3)
        log.warning("specloom: warning: %s", msg)
    return d
