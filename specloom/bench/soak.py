"""Soak and fault test (issue 14): a real `specloom serve` in a child process on 127.0.0.1, driven for N minutes at
concurrency C with greedy requests, random client disconnects and a sprinkling of malformed and poisoned requests
(bench/soak_requests.py), while its RSS (/proc/PID/status VmRSS) and /metrics are sampled.

    specloom bench-soak smollm2-135m --prompts ../shared/data/eval/spec_bench.jsonl --minutes 10 --concurrency 16 \\
        --speculative-config '{"method": "ngram"}' --json out/soak.json

First every distinct prompt is sent alone (concurrency 1) to the same server: its text and its own drafted /
accepted token counts (the /metrics deltas around it) are the reference. fp32 and greedy by default, so a batched
answer must equal its alone answer exactly. Checked and reported:

- no lost and no corrupted completion: every completed greedy response equals its alone text, and whatever an
  abandoned stream received is a prefix of it;
- no 5xx for a valid request (as its client saw it, and in the server's own /metrics error counters);
- every malformed or poisoned request answered with a 4xx and an error body;
- RSS after the warm-up (the first `warmup_fraction` of the soak) within 5 % of its level at the warm-up's end;
- acceptance at the end equal to the start: the alone pass repeated after the soak gives the same texts and the same
  tau (1 + accepted / drafts); and tau over the last half of the soak after its warm-up, divided by what the alone
  counts of the requests completed in that window predict, equals the same ratio over the first half (within 5 %:
  a request finishing as /metrics is sampled can land in the other window);
- the server still healthy (no traceback in its log; SIGTERM at the end drains and exits 0).

Every malformed and poisoned case is also sent once before the soak, so that each code path has run before the RSS
baseline. The summary, the checks and the table: bench/soak_report.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from ..errors import SpecloomError
from .serve_load import _free_port
from .soak_report import checks, print_table, summarize, tau
from .soak_requests import Requests



class ServeProcess:
    """`specloom serve MODEL` on 127.0.0.1 in a child process, its output in `log_path`; ready once /health is 200."""

    def __init__(self, model: str, serve_args: list[str], log_path: str, env: dict | None = None,
                 ready_timeout: float = 1800.0):
        self.port = _free_port()
        self.log_path = log_path
        cmd = [sys.executable, "-m", "specloom", "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
               *serve_args]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        t0 = time.monotonic()
        while self.health() != 200:
            if self.proc.poll() is not None:
                raise SpecloomError(f"specloom serve exited with status {self.proc.returncode}: {self.log_tail()}")
            if time.monotonic() - t0 > ready_timeout:
                self.proc.kill()
                raise SpecloomError(f"specloom serve was not ready after {ready_timeout:.0f} s: {self.log_tail()}")
            time.sleep(0.25)

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self) -> str:
        lines = self.log_text().strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def get(self, path: str) -> tuple[int | None, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return None, ""

    def health(self) -> int | None:
        return self.get("/health")[0]

    def rss_kib(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        return 0

    def metrics(self) -> dict:
        """The counters the soak reads from /metrics: drafts, accepted, aborted, and errors by status."""
        _, text = self.get("/metrics")
        out = {"drafts": 0.0, "accepted": 0.0, "aborted": 0.0, "steps": 0.0, "batch_sum": 0.0, "errors": {}}
        names = {"specloom:spec_decode_num_drafts_total": "drafts",
                 "specloom:spec_decode_num_accepted_tokens_total": "accepted",
                 "specloom:request_aborted_total": "aborted", "specloom:scheduler_steps_total": "steps",
                 "specloom:scheduler_batch_size_sum": "batch_sum"}
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            name = key.partition("{")[0]
            if name in names:
                out[names[name]] = float(value)
            elif name == "specloom:request_errors_total":
                status = re.search(r'status="(\d+)"', key)
                if status:
                    out["errors"][int(status.group(1))] = float(value)
        return out

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (drain), then the exit status (killed past `timeout`: -9)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                return -9
        return self.proc.returncode


def alone_pass(srv: ServeProcess, req: Requests) -> list[dict | None]:
    """Each prompt alone: its text, tokens and own drafted / accepted counts; None for a prompt the server refuses
    (e.g. longer than --max-model-len)."""
    import openai

    out = []
    for i, p in enumerate(req.prompts):
        m0 = srv.metrics()
        try:
            r = req.client.chat.completions.create(**req.greedy_body(i))
        except openai.APIStatusError as e:
            if 400 <= e.status_code < 500:
                out.append(None)
                continue
            raise SpecloomError(f"alone request {i} failed with {e.status_code}: {e}") from None
        m1 = srv.metrics()
        out.append({"text": r.choices[0].message.content or "", "tokens": r.usage.completion_tokens,
                    "drafts": m1["drafts"] - m0["drafts"], "accepted": m1["accepted"] - m0["accepted"]})
    return out


def _soak(req: Requests, srv: ServeProcess, mix: dict, seconds: float, concurrency: int, seed: int,
          sample_every: float) -> tuple[list[dict], list[dict]]:
    records, samples, lock = [], [], threading.Lock()
    t_start = time.monotonic()
    deadline = t_start + seconds
    kinds, weights = zip(*mix.items())
    stop = threading.Event()

    def worker(w: int):
        rng = random.Random(seed * 1000 + w)
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            t0 = time.monotonic() - t_start
            try:
                rec = req.bad(kind, rng) if kind in ("malformed", "poisoned") else getattr(req, kind)(rng)
            except Exception as e:  # a bug of the client side: counted, never silently dropped
                rec = {"kind": kind, "prompt": None, "status": None, "ok": False, "answered": False,
                       "completed": False, "problem": "client_exception", "error": repr(e)}
            rec["t0"], rec["t1"] = t0, time.monotonic() - t_start
            with lock:
                records.append(rec)

    def sample():
        try:
            rss = srv.rss_kib()
        except OSError:  # the server is gone: the checks say so
            rss = 0
        s = {"t": time.monotonic() - t_start, "rss_kib": rss, **srv.metrics()}
        with lock:
            s["sent"] = len(records)
        samples.append(s)
        return s

    def sampler():
        next_print = 60.0
        while not stop.wait(sample_every):
            s = sample()
            if s["t"] >= next_print:
                next_print += 60.0
                print(f"  t={s['t']:5.0f} s  {s['sent']} requests  RSS {s['rss_kib'] / 1024:.0f} MiB  "
                      f"tau {tau(s['drafts'], s['accepted']):.3f}", flush=True)

    sample()
    threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(concurrency)]
    watcher = threading.Thread(target=sampler, daemon=True)
    for t in threads + [watcher]:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    sample()
    return records, samples


def run_soak(model: str, prompts_path: str, speculative_config: str | None = '{"method": "ngram"}',
             minutes: float = 10.0, concurrency: int = 16, num_prompts: int = 32, max_tokens: int = 64,
             dtype: str = "fp32", max_model_len: int = 1024, speculation: str = "fixed",
             disconnect_fraction: float = 0.12, malformed_fraction: float = 0.05, poisoned_fraction: float = 0.03,
             warmup_fraction: float = 0.2, seed: int = 0, json_out: str | None = None,
             server_log: str | None = None, device: str | None = None, env: dict | None = None,
             command: str | None = None) -> dict:
    from .harness import read_prompts

    rest = 1.0 - disconnect_fraction - malformed_fraction - poisoned_fraction
    if min(disconnect_fraction, malformed_fraction, poisoned_fraction) < 0 or rest <= 0:
        raise SpecloomError("the disconnect, malformed and poisoned fractions must be >= 0 and sum to less than 1")
    if not 0 <= warmup_fraction < 1:
        raise SpecloomError(f"--warmup-fraction must be in [0, 1), got {warmup_fraction}")
    mix = {"valid": rest / 2, "stream": rest / 2, "disconnect": disconnect_fraction,
           "malformed": malformed_fraction, "poisoned": poisoned_fraction}
    prompts = [r["text"] for r in read_prompts(prompts_path)]
    random.Random(seed).shuffle(prompts)
    prompts = prompts[:num_prompts]
    serve_args = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--max-num-seqs", str(concurrency),
                  "--speculation", speculation]
    serve_args += ["--speculative-config", speculative_config] if speculative_config else []
    serve_args += ["--device", device] if device else []
    log_path = server_log or os.path.join(tempfile.mkdtemp(prefix="specloom-soak-"), "serve.log")
    print(f"starting specloom serve {model} {' '.join(serve_args)} (log: {log_path})", flush=True)
    srv = ServeProcess(model, serve_args, log_path, env)
    exit_code = None
    try:
        req = Requests(srv.port, model, prompts, [""] * len(prompts), max_tokens, max_model_len)
        t0 = time.monotonic()
        alone = alone_pass(srv, req)
        keep = [i for i, a in enumerate(alone) if a is not None]
        if not keep:
            raise SpecloomError("the server refused every prompt alone (longer than --max-model-len?)")
        req.prompts, alone = [prompts[i] for i in keep], [alone[i] for i in keep]
        req.alone = [a["text"] for a in alone]
        t_alone = tau(sum(a["drafts"] for a in alone), sum(a["accepted"] for a in alone))
        print(f"alone pass: {len(alone)} prompts ({len(prompts) - len(alone)} refused) in "
              f"{time.monotonic() - t0:.0f} s, tau {t_alone:.3f}", flush=True)
        # every malformed and poisoned case once before the soak: each code path (the 16 MiB a chunked upload may
        # take before its 413, say) has run before the warm-up ends and the RSS baseline is taken
        first = [{**req.send_bad(kind, name, data), "t0": 0.0, "t1": 0.0, "preflight": True}
                 for kind, cases in (("malformed", req.malformed), ("poisoned", req.poisoned)) for name, data in cases]
        seconds = 60.0 * minutes
        print(f"soak: {seconds:.0f} s at concurrency {concurrency}", flush=True)
        records, samples = _soak(req, srv, mix, seconds, concurrency, seed, max(1.0, seconds / 200))
        records = first + records
        alone_end = alone_pass(srv, req)
        health = srv.health()
    finally:
        exit_code = srv.stop()
    tracebacks = srv.log_text().count("Traceback")
    s = summarize(records, samples, alone, alone_end, warmup_fraction * seconds, seconds)
    s.update(command=command, model=model, speculative_config=speculative_config, dtype=dtype,
             concurrency=concurrency, max_tokens=max_tokens, max_model_len=max_model_len, speculation=speculation,
             prompts=len(alone), mix=mix, server_log=log_path, server_tracebacks=tracebacks,
             server_exit_code=exit_code, health_after=health,
             problems=[r for r in records if not r["ok"]][:50])
    s["checks"] = checks(s, alone, health, tracebacks, exit_code)
    s["passed"] = all(s["checks"].values())
    print_table(s)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(s, f, indent=1)
    return s
