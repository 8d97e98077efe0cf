"""`llama.cpp-draft`: llama.cpp's own draft-model speculation, its `llama-speculative-simple` example program built
from the llama.cpp source tree vendored in the llama-cpp-python 0.3.36 sdist (scripts/build_llama_speculative.sh;
llama-cpp-python itself exposes only a Python draft-model interface, no draft-model speculation of its own).

One process per request: target and draft GGUF (`-m`, `-md`, `--spec-type draft-simple`), greedy (`--temp 0 --top-k 1`), as many threads as
torch uses for both models (`-t/-tb/-td`), llama.cpp's default draft depth (3) unless `--baseline-draft-tokens K`.
The program tokenizes its prompt itself, so it gets the detokenized chat-templated prompt (special tokens as text,
which it parses back: the report says whether its count matches specloom's ids). Timing is the program's own
`encoded ... in S s` + `decoded N tokens in S s` (prefill included, model loading excluded) over its own count N
(its last step may draft past max_tokens: tokens/s counts all it made); its generated text is parsed from stdout
(after the echoed prompt), cut to max_tokens, and compared as text with specloom plain's output. tau =
n_predict / (n_predict - n_accept): every decode pass yields its accepted draft tokens plus one.

The program is found at $SPECLOOM_LLAMA_SPECULATIVE, else `llama-speculative-simple` on PATH, else where the build
script puts it (~/.cache/specloom/llama.cpp/bin/).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time

from ...errors import SpecloomError
from . import Peer, PeerRun, register
from .llamacpp import gguf_path

TOOL = "llama-speculative-simple"
BUILD_HINT = ("build it with `bash scripts/build_llama_speculative.sh` (cmake, from the llama-cpp-python 0.3.36 "
              "source; a few minutes) or point SPECLOOM_LLAMA_SPECULATIVE at a built llama-speculative-simple")


def find_tool() -> str | None:
    env = os.environ.get("SPECLOOM_LLAMA_SPECULATIVE")
    if env:
        return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
    on_path = shutil.which(TOOL)
    if on_path:
        return on_path
    from ...tokenizer import cache_dir

    built = os.path.join(cache_dir(), "llama.cpp", "bin", TOOL)
    return built if os.path.isfile(built) and os.access(built, os.X_OK) else None


_ENC = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DEC = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_KV = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")


def parse_timing(stderr: str) -> dict:
    """The counters and timings llama-speculative-simple prints at its end (stderr)."""
    enc, dec = _ENC.search(stderr), _DEC.search(stderr)
    if not (enc and dec):
        raise SpecloomError(f"{TOOL}: no timing in its output (last lines: {stderr.strip()[-400:]!r})")
    out = {k: int(v) for k, v in _KV.findall(stderr)}
    out.update(n_input=int(enc.group(1)), encode_seconds=float(enc.group(2)), decoded=int(dec.group(1)),
               decode_seconds=float(dec.group(2)))
    return out


def generated_text(stdout: str, prompt_echo: str) -> str | None:
    """The program prints "\\n\\n", the prompt's pieces, the generated pieces (not the end-of-generation token),
    then "\\n\\n" twice (after the loop and at the end); None when the echo is not the prompt we sent."""
    head, tail = "\n\n" + prompt_echo, "\n\n\n\n"
    if not stdout.startswith(head) or not stdout.endswith(tail) or len(stdout) < len(head) + len(tail):
        return None
    return stdout[len(head):-len(tail)]


def _need_draft(draft_model):
    if not draft_model:
        raise SpecloomError("--baseline llama.cpp-draft needs a draft model: --baseline-draft MODEL, or a "
                            "candidate with a draft_model speculative config ('{\"model\": \"...\"}')")


def _need_tool() -> str:
    tool = find_tool()
    if tool is None:
        raise SpecloomError(f"--baseline llama.cpp-draft needs llama.cpp's {TOOL} program: {BUILD_HINT}")
    return tool


@register("llama.cpp-draft")
class LlamaCppDraft(Peer):
    @classmethod
    def preflight(cls, model, draft_model):
        _need_draft(draft_model)
        _need_tool()
        gguf_path(model, cls.name)
        gguf_path(draft_model, cls.name)

    def __init__(self, ctx):
        super().__init__(ctx)
        _need_draft(ctx.draft_model)
        self.tool = _need_tool()
        self.target = gguf_path(ctx.model, self.name)
        self.draft = gguf_path(ctx.draft_model, self.name)
        self.tokenizer = ctx.engine.tokenizer
        self.last: dict = {}

    @property
    def label(self) -> str:
        return f"{self.name} (GGUF, {self.ctx.threads} threads)"

    def settings(self) -> dict:
        return {"program": self.tool, "gguf": self.target, "draft_gguf": self.draft, "threads": self.ctx.threads,
                "draft_tokens": self.ctx.draft_tokens if self.ctx.draft_tokens is not None
                else self.last.get("n_draft", "llama.cpp default")}

    def command(self, prompt: str, max_tokens: int) -> list[str]:
        t = str(self.ctx.threads)
        cmd = [self.tool, "-m", self.target, "-md", self.draft, "--spec-type", "draft-simple", "-p", prompt,
               # the program stops once it has *more* than -n tokens (its last step may draft past it)
               "-n", str(max(0, max_tokens - 1)), "-c", str(self.ctx.n_ctx), "-b", str(max(512, self.ctx.n_ctx)),
               "-t", t, "-tb", t, "-td", t, "--temp", "0", "--top-k", "1", "--seed", "0"]
        if self.ctx.draft_tokens is not None:
            cmd += ["--spec-draft-n-max", str(self.ctx.draft_tokens)]
        return cmd

    def run(self, ids, max_tokens):
        prompt = self.tokenizer.decode(ids, skip_special_tokens=False)
        t0 = time.perf_counter()
        try:
            p = subprocess.run(self.command(prompt, max_tokens), capture_output=True, timeout=1800,
                               stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise SpecloomError(f"{TOOL} did not finish within 30 minutes") from None
        wall = time.perf_counter() - t0
        out, err = p.stdout.decode("utf-8", "replace"), p.stderr.decode("utf-8", "replace")
        if p.returncode != 0:
            raise SpecloomError(f"{TOOL} failed (exit {p.returncode}): {err.strip()[-600:]}")
        timing = parse_timing(err)
        self.last = timing
        text = generated_text(out, prompt)
        n = timing.get("n_predict", timing["decoded"])
        tokens = self.tokenizer.encode(text, special=True) if text is not None else []
        if len(tokens) > max_tokens:  # its last step went past max_tokens: compare the first max_tokens
            tokens = tokens[:max_tokens]
            text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        passes = n - timing.get("n_accept", 0)  # decode passes: each yields its accepted draft tokens + 1
        return PeerRun(tokens, timing["encode_seconds"] + timing["decode_seconds"], passes, prefill_pass=False,
                       drafted=timing.get("n_drafted"), accepted=timing.get("n_accept"),
                       prompt_tokens=timing["n_input"], text=text, wall_seconds=wall, counted_tokens=n)
