"""llama.cpp through llama-cpp-python (the optional extra: `pip install 'specloom[llama]'`) on the same GGUF file:
`llama.cpp` (plain greedy decoding) and `llama.cpp-lookup` (its prompt-lookup drafter,
`LlamaPromptLookupDecoding(max_ngram_size, num_pred_tokens)`, verified by the target in one batch per step).

Both are fed specloom's token ids (the chat-templated prompt), decode greedily (`temp=0`: llama.cpp's greedy
sampler), stop at specloom's EOS set or at max_tokens, run with as many threads as torch uses (prompt and
generation) and with flash attention on, as llama.cpp's own programs run on a CPU (`-fa auto`). The KV cache is cleared before every request (llama-cpp-python would otherwise reuse a cached common
prefix, which the other engines do not). Target passes are counted per `eval` call (one batch: the prompt, then
one verification per step), so the lookup peer's tau follows specloom's definition (the prefill pass left out).
"""

from __future__ import annotations

import time

from ...errors import SpecloomError
from ...loading import resolve
from . import Peer, PeerRun, register

INSTALL_HINT = ("bash scripts/install_llama_cpp.sh  (llama-cpp-python 0.3.36 built from source for this CPU's "
                "instruction sets, without ggml's AMX path: a few minutes)")


def import_llama_cpp(baseline: str):
    """The llama_cpp module, or one clear SpecloomError naming the extra to install."""
    try:
        import llama_cpp
    except ImportError as e:
        if e.name not in (None, "llama_cpp"):  # installed, but one of its own dependencies is missing
            raise SpecloomError(f"--baseline {baseline}: llama-cpp-python is installed but cannot be imported "
                                f"(no module {e.name!r}): {INSTALL_HINT}") from None
        raise SpecloomError(f"--baseline {baseline} needs llama-cpp-python, which is not installed: "
                            f"{INSTALL_HINT}") from None
    return llama_cpp


def gguf_path(model: str, baseline: str) -> str:
    source = resolve(model)
    if source.kind != "gguf":
        raise SpecloomError(f"--baseline {baseline} runs llama.cpp on a GGUF file; {model} is an HF directory "
                            f"({source.path}): bench a .gguf file or an alias")
    return source.path


def check_runs(path: str, baseline: str, timeout: float = 300.0) -> None:
    """Load the GGUF and evaluate two tokens with llama-cpp-python in a child process: a build that dies on this
    host (e.g. SIGILL in ggml's AMX repacking, seen on an AMX Xeon with the default native build) is named in one
    line instead of killing the benchmark."""
    import signal
    import subprocess
    import sys

    code = ("import sys, llama_cpp; m = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=64, n_batch=64, "
            "verbose=False); m.eval([1, 2]); m.close()")
    try:
        p = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SpecloomError(f"--baseline {baseline}: llama-cpp-python did not load {path} within "
                            f"{timeout:.0f} s") from None
    if p.returncode < 0:
        name = signal.Signals(-p.returncode).name
        raise SpecloomError(f"--baseline {baseline}: llama-cpp-python dies on this host with {name} (its build "
                            f"uses instructions this CPU does not run, e.g. ggml's AMX path); rebuild it: "
                            f"{INSTALL_HINT}")
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no message"])[-1]
        raise SpecloomError(f"--baseline {baseline}: llama-cpp-python could not run {path}: {last}")


class _LlamaPeer(Peer):
    lookup = False

    def __init__(self, ctx):
        super().__init__(ctx)
        llama_cpp = import_llama_cpp(self.name)
        self.path = gguf_path(ctx.model, self.name)
        kwargs = {}
        if self.lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            self.drafter = _CountingDraft(LlamaPromptLookupDecoding(max_ngram_size=ctx.lookup_ngram,
                                                                    num_pred_tokens=ctx.lookup_tokens))
            kwargs["draft_model"] = self.drafter
            # with a draft model llama-cpp-python keeps every position's logits, but sizes that buffer by the
            # `logits_all` argument (n_batch rows when False): a prompt longer than n_batch then fails in `eval`
            kwargs["logits_all"] = True
        # flash_attn: llama.cpp's own programs default to `-fa auto`, on for the CPU backend (llama-cpp-python
        # defaults to off); the same attention kernel as llama.cpp-draft, so the llama.cpp rows compare like with like
        self.llm = llama_cpp.Llama(model_path=self.path, n_ctx=ctx.n_ctx, n_batch=min(512, ctx.n_ctx),
                                   n_threads=ctx.threads, n_threads_batch=ctx.threads, flash_attn=True,
                                   verbose=False, **kwargs)
        self.eos = ctx.eos_token_ids
        self.evals = 0
        inner = self.llm.eval

        def counted(tokens):
            self.evals += 1
            return inner(tokens)

        self.llm.eval = counted  # one call = one batch through the target (the prompt, or one verification)

    @classmethod
    def preflight(cls, model, draft_model):
        import_llama_cpp(cls.name)
        check_runs(gguf_path(model, cls.name), cls.name)

    @property
    def label(self) -> str:
        return f"{self.name} (GGUF, {self.ctx.threads} threads)"

    def settings(self) -> dict:
        import llama_cpp

        out = {"gguf": self.path, "threads": self.ctx.threads, "flash_attn": True,
               "llama_cpp_python": llama_cpp.__version__}
        if self.lookup:
            out.update(num_pred_tokens=self.ctx.lookup_tokens, max_ngram_size=self.ctx.lookup_ngram)
        return out

    def run(self, ids, max_tokens):
        llm = self.llm
        out: list[int] = []
        evals0 = self.evals
        drafted0 = self.drafter.drafted if self.lookup else 0
        t0 = time.perf_counter()
        llm.reset()  # no prefix reuse across requests: a full prefill, like the other engines
        if max_tokens > 0:
            for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
                out.append(int(tok))
                if tok in self.eos or len(out) >= max_tokens:
                    break
        seconds = time.perf_counter() - t0
        passes = self.evals - evals0
        if self.lookup:
            # every pass after the prefill yields its accepted draft tokens plus one; a step cut by max_tokens or
            # EOS counts what it emitted
            return PeerRun(out, seconds, passes, self.drafter.drafted - drafted0, max(0, len(out) - passes))
        return PeerRun(out, seconds, passes, 0, 0)

    def close(self) -> None:
        try:
            self.llm.close()
        except Exception:  # noqa: BLE001 - best effort at the end of a run
            pass


class _CountingDraft:
    """Wraps a llama-cpp-python draft model and counts the tokens it proposes."""

    def __init__(self, inner):
        self.inner, self.drafted = inner, 0

    def __call__(self, input_ids, /, **kwargs):
        d = self.inner(input_ids, **kwargs)
        self.drafted += len(d)
        return d


@register("llama.cpp")
class LlamaCppPlain(_LlamaPeer):
    pass


@register("llama.cpp-lookup")
class LlamaCppLookup(_LlamaPeer):
    lookup = True
