"""Serving benchmark: throughput and per-request latency vs concurrency, speculation off / fixed / load-aware.

One engine and one server on 127.0.0.1 in this process, its scheduler in the main thread (as `specloom serve`
runs it); the speculation mode is switched between runs. The official `openai` client streams chat completions
from `c` concurrent client threads. Levels and modes are interleaved (for each concurrency, every mode in rotating
order) so that machine drift hits all modes alike. Greedy decoding, so every mode must produce the same texts
(checked and reported).

    specloom bench-serve smollm2-135m --speculative-config '{"method": "ngram"}' --concurrency 1 2 4 8 16 \\
        --prompts ../shared/data/eval/spec_bench.jsonl --json out/serve.json --plot docs/serve.png
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import sys
import threading
import time

from ..errors import SpecloomError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A Server behind uvicorn on 127.0.0.1 in a thread (its scheduler runs wherever the caller runs it); used by
    `bench-serve` and the server tests. `close()` stops HTTP and the scheduler."""

    def __init__(self, server, **limits):
        import uvicorn

        from ..serving.app import build_app
        from ..serving.http_limits import config

        self.server = server
        self.port = _free_port()
        self.uv = uvicorn.Server(config(build_app(server), host="127.0.0.1", port=self.port, log_level="warning",
                                        **limits))
        self.thread = threading.Thread(target=self.uv.run, daemon=True)
        self.thread.start()
        for _ in range(400):
            if self.uv.started:
                break
            time.sleep(0.05)

    def close(self):
        self.uv.should_exit = True
        self.thread.join(timeout=10)
        self.server.close()


def _one(client, model, prompt, max_tokens):
    t0 = time.perf_counter()
    first, text, usage = None, [], None
    for ch in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=max_tokens, temperature=0, stream=True,
                                             stream_options={"include_usage": True}):
        if ch.choices and ch.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
            text.append(ch.choices[0].delta.content)
        if ch.usage:
            usage = ch.usage
    return {"latency": time.perf_counter() - t0, "ttft": first, "text": "".join(text),
            "tokens": usage.completion_tokens if usage else 0}


def _level(live, model, prompts, c, max_tokens):
    import openai

    client = openai.OpenAI(base_url=f"http://127.0.0.1:{live.port}/v1", api_key="x", max_retries=0, timeout=600)
    jobs = list(enumerate(prompts))
    out: dict[int, dict] = {}
    lock = threading.Lock()
    m = live.server.metrics
    steps0, depth0, batch0 = m.steps, m.depth_sum, m.batch_sum

    def worker():
        while True:
            with lock:
                if not jobs:
                    return
                i, p = jobs.pop(0)
            try:
                r = _one(client, model, p, max_tokens)
            except Exception as e:  # reported by the level
                r = e
            with lock:
                out[i] = r

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    rs = [out[i] for i in range(len(prompts))]
    bad = [r for r in rs if isinstance(r, Exception)]
    if bad:
        raise SpecloomError(f"{len(bad)} of {len(rs)} requests failed; the first: {bad[0]}")
    tokens = sum(r["tokens"] for r in rs)
    steps = m.steps - steps0
    return {
        "requests": len(rs), "tokens": tokens, "seconds": wall, "tokens_per_second": tokens / wall,
        "latency_mean": statistics.mean(r["latency"] for r in rs),
        "latency_p50": statistics.median(r["latency"] for r in rs),
        "ttft_mean": statistics.mean(r["ttft"] or 0.0 for r in rs),
        "per_request_tokens_per_second": statistics.mean(r["tokens"] / r["latency"] for r in rs),
        "mean_depth": (m.depth_sum - depth0) / steps if steps else 0.0,
        "mean_batch": (m.batch_sum - batch0) / steps if steps else 0.0,
        "texts": [r["text"] for r in rs],
    }


def run_serve_bench(model: str, speculative_config, concurrency: list[int], modes: list[str], prompts_path: str,
                    max_tokens: int = 64, dtype: str = "bf16", requests_per_level: int = 8,
                    max_model_len: int = 1024, json_out: str | None = None, plot: str | None = None,
                    device: str | None = "cpu", kv_dtype=None) -> dict:
    from ..engine import load
    from ..serving.api import Server
    from ..cost import batch_cost_cached
    from .harness import kernel_report, print_host, read_prompts

    prompts = [r["text"] for r in read_prompts(prompts_path)]
    random.Random(0).shuffle(prompts)  # every level gets a mix of categories (Spec-Bench files are sorted by one)
    engine = load(model, speculative_config, dtype=dtype, max_model_len=max_model_len, device=device,
                  kv_dtype=kv_dtype)
    host = print_host(engine.model, file=sys.stdout)
    fits = [p for p in prompts if len(engine.encode(p, chat=True)) + max_tokens <= max_model_len]
    print(f"{len(fits)} of {len(prompts)} prompts fit --max-model-len {max_model_len} with {max_tokens} new tokens",
          flush=True)
    prompts = fits
    if engine.drafter is None and set(modes) - {"off"}:
        raise SpecloomError("modes fixed and load_aware need --speculative-config")
    rows = max(concurrency)
    print(f"measuring / loading the batch verify-cost curve for {rows} rows ...", flush=True)
    cost = batch_cost_cached(engine.model, rows)
    print("c(n, T) relative to one decode step: " + ", ".join(
        f"{n}x{t}={cost(n, t):.2f}" for n in cost.rows for t in (1, 3, 5)), flush=True)
    server = Server(engine, model, max_num_seqs=rows, speculation="fixed" if engine.drafter else "off", cost=cost,
                    max_queue=4 * rows, kv_dtype=engine.kv_dtype, start=False)
    live = LiveServer(server)
    report: dict = {"model": model, "speculative_config": speculative_config, "dtype": dtype, "max_tokens": max_tokens,
                    "concurrency": concurrency, "modes": modes, "host": host,
                    "linear_kernel": kernel_report(engine.model), "levels": {}}
    errors: list[BaseException] = []

    def drive():
        try:
            _drive(live, model, prompts, concurrency, modes, max_tokens, requests_per_level, report)
        except BaseException as e:  # reported after the scheduler stops
            errors.append(e)
        finally:
            live.close()

    threading.Thread(target=drive, daemon=True).start()
    server.scheduler.run()  # model work in the main thread; returns when `drive` closes the server
    if errors:
        raise errors[0]
    for level in report["levels"].values():
        for r in level.values():
            r.pop("texts", None)
    _print_table(report)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=1)
    if plot:
        plot_serve(report, plot)
    return report


def _drive(live, model, prompts, concurrency, modes, max_tokens, requests_per_level, report) -> None:
    policy = live.server.scheduler.policy
    policy.mode = "fixed" if "fixed" in modes else modes[0]
    _level(live, model, prompts[:1], 1, 8)  # warm-up
    start = 0
    for li, c in enumerate(concurrency):
        n = max(requests_per_level, 2 * c)
        ps = [prompts[(start + i) % len(prompts)] for i in range(n)]
        start += n
        level = {}
        # warm-up on this level's prompts (2 tokens each): the first pass at a new prompt length builds oneDNN
        # kernels for that shape, which would otherwise be charged to whichever mode runs first
        _level(live, model, ps, c, 2)
        order = modes[li % len(modes):] + modes[:li % len(modes)]
        for m in order:
            policy.mode = m
            r = _level(live, model, ps, c, max_tokens)
            level[m] = r
            print(f"c={c:2d} {m:10s} {r['tokens_per_second']:7.1f} tok/s  latency {r['latency_mean']:.2f} s  "
                  f"ttft {r['ttft_mean']:.2f} s  depth {r['mean_depth']:.2f}  batch {r['mean_batch']:.1f}", flush=True)
        base = level.get("off")
        for m, r in level.items():
            r["identical_to_off"] = None if base is None else sum(a == b for a, b in zip(r["texts"], base["texts"]))
            r["speedup_vs_off"] = None if base is None else r["tokens_per_second"] / base["tokens_per_second"]
        report["levels"][str(c)] = level


def _print_table(report: dict) -> None:
    modes = report["modes"]
    print("\n| concurrency | " + " | ".join(f"{m} tok/s (x off) | {m} latency s" for m in modes) + " |")
    print("|---|" + "---|---|" * len(modes))
    for c, level in report["levels"].items():
        cells = []
        for m in modes:
            r = level[m]
            x = f" ({r['speedup_vs_off']:.2f}x)" if r.get("speedup_vs_off") else ""
            cells += [f"{r['tokens_per_second']:.1f}{x}", f"{r['latency_mean']:.2f}"]
        print(f"| {c} | " + " | ".join(cells) + " |")


def plot_serve(report: dict, out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecloomError("plotting needs matplotlib: pip install matplotlib") from None
    cs = [int(c) for c in report["levels"]]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    colors = {"off": "tab:blue", "fixed": "tab:orange", "load_aware": "tab:green"}
    for m in report["modes"]:
        rows = [report["levels"][str(c)][m] for c in cs]
        style = {"marker": "o", "label": m, "color": colors.get(m)}
        axes[0].plot(cs, [r["tokens_per_second"] for r in rows], **style)
        axes[1].plot(cs, [r["latency_mean"] for r in rows], **style)
        if m != "off" and rows[0].get("speedup_vs_off"):
            axes[2].plot(cs, [r["speedup_vs_off"] for r in rows], **style)
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].axhline(0.95, color="grey", lw=0.8, ls=":")
    for ax, title in zip(axes, ("throughput (tokens/s)", "mean request latency (s)", "throughput vs off (x)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.legend()
    fig.suptitle(f"{report['model']} {report['dtype']}, {report['speculative_config']}, {report['max_tokens']} tokens",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
