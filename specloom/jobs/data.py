"""Self-distillation data: the target answers prompts, through the batch-first step, and we store what drafters learn.

`specloom data --target smollm2-135m --prompts ../shared/data/train --magpie 20000 --out data/smollm2`

* Conversations ("jobs"): every prompt of the JSONL files (a `turns` list, first turn = the user message, or a
  `prompt` field; prompts longer than `--max-prompt-tokens` are skipped), plus `--magpie N` conversations whose user
  query the target writes itself (training/magpie.py: the chat template up to a user turn, a sampled query, filtered
  for degenerate ones and duplicates). A share `--sampled-fraction` of the answers is sampled (temperature drawn in
  `--temperature-range`, no top-p), the rest greedy; a share `--multi-turn-fraction` of conversations gets a
  second, Magpie-written user turn and a second answer. Files under an `eval/` directory are refused: benchmark
  prompts are never training data.
* Generation: the serving scheduler (continuous batching over `--rows` rows of one KV store, each row with its own
  sampling parameters and generator; a conversation's next stage is admitted as soon as a row frees up), without
  speculation. Jobs run in a seeded order that mixes the sources, so any prefix of a run is a fair sample.
* Stored, compactly, in `shard_NNNNN.safetensors` of ~`--shard-tokens` tokens: `tokens` (int32, conversations
  concatenated), `offsets` (int64, starts + one extra), `loss_mask` (uint8, 1 on the target's answer tokens),
  `job_ids` (int64). No hidden states: training recomputes them with the target (training/dataset.py). Reading
  stored bf16 states back is far faster per epoch (measured: ~100k vs ~200 tokens/s collated on one shared core), but
  they cost 4.6 KB per token (5M tokens: ~23 GB, beyond this machine's memory, where the loader holds every shard);
  tokens alone are 5 bytes per token (BENCHMARKS.md, "Self-distillation data").
* Resumable: shards are written atomically; a rerun skips the jobs already stored. `meta.json` records the target
  fingerprint, its behaviour on the probe (`target_probe`, behaviour.py; a rerun keeps the first run's and reports
  its distance to the target now) and the settings; a rerun with other settings or another target is refused.
  `progress.json` and `DATACARD.md` (sources, counts, length histogram, dedup rate, the command) are rewritten after
  every shard.
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..atomic import remove_stale, write_json, write_text
from ..errors import SpecloomError
from ..prompts import read_prompts
from ..training.magpie import ChatFrame, QueryFilter

QUERY_TOKENS = 128  # at most this many tokens for a Magpie-written user query
QUERY_TEMPERATURE, QUERY_TOP_P = 1.0, 1.0  # Magpie: the raw distribution
QUERY_ATTEMPTS = 4
ANSWER_TOP_P = 1.0  # sampled answers: temperature only (top-p sorts the vocabulary of every row at every step)
SORT_BLOCK = 256  # jobs are sorted by prompt length within blocks of this many  # a Magpie conversation whose query is dropped this many times is given up


@dataclass
class Job:
    """One conversation: its source, how its answers are decoded, and what it holds so far."""

    id: int
    source: str
    prompt: list[int] | None  # the templated first user turn; None: Magpie writes it
    temperature: float  # 0: greedy answers
    turns: int
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turn: int = 0
    attempts: int = 0
    queries: list[str] = field(default_factory=list)  # the normalised Magpie queries (dedup on resume)


class Generator:
    """Drives jobs through a BatchScheduler: query (Magpie) -> answer -> [query -> answer], then stored."""

    def __init__(self, engine, frame: ChatFrame | None, rows: int, max_new: int, seed: int, store, kv_dtype=None):
        from ..scheduler import BatchScheduler

        self.engine, self.frame, self.max_new, self.seed, self.store = engine, frame, max_new, seed, store
        self.tok = engine.tokenizer
        self.sched = BatchScheduler(engine, rows, mode="off", start=False, max_queue=1 << 30,
                                    kv_dtype=kv_dtype)
        self.sched.prefill_budget = 1 << 14  # nobody waits on a data run: refill freed rows at once
        self.rows = rows
        self.pending: list[Job] = []
        self.inflight = 0
        self.filter = QueryFilter()
        self.failed = Counter()
        self.deadline = None  # perf_counter time after which no new conversation starts

    def _submit(self, job: Job, ids: list[int], max_tokens: int, temperature: float, top_p: float, stage: str):
        from ..sampling import SamplingParams
        from ..scheduler import Sequence

        room = self.engine.max_model_len - len(ids)
        if room < 8:  # no room for another stage: keep what the conversation has
            self._finish(job)
            return
        seed = (self.seed * 1_000_003 + job.id * 97 + job.turn * 7 + job.attempts) % (2**63)
        params = SamplingParams(temperature=temperature, top_p=top_p if temperature else 1.0, seed=seed)
        seq = Sequence(ids, min(max_tokens, room), params)
        seq.on_done = lambda s: self._done(job, stage, s)
        self.inflight += 1
        self.sched.submit([seq])

    def _start(self, job: Job) -> None:
        if job.prompt is not None:
            job.ids, job.mask = list(job.prompt), [0] * len(job.prompt)
            self._answer(job)
        else:
            job.ids, job.mask = list(self.frame.pre_query), [0] * len(self.frame.pre_query)
            self._query(job)

    def _query(self, job: Job) -> None:
        self._submit(job, job.ids, QUERY_TOKENS, QUERY_TEMPERATURE, QUERY_TOP_P, "query")

    def _answer(self, job: Job) -> None:
        self._submit(job, job.ids, self.max_new, job.temperature, ANSWER_TOP_P, "answer")

    def _done(self, job: Job, stage: str, seq) -> None:
        self.inflight -= 1
        if seq.error is not None:
            self.failed[type(seq.error).__name__] += 1
            if job.turn > 0:
                self._finish(job)
            self._refill()
            return
        res = seq.result
        out = list(res.token_ids)
        if stage == "query":
            ended = res.finish_reason == "stop" and bool(out) and out[-1] in self.tok.eos_token_ids
            text = self.tok.decode(out).strip()
            if self.filter.check(text, len(out), ended):
                job.queries.append(self.filter.key(text))
                new = self.frame.join(job.ids, out, self.frame.to_answer)
                job.mask += [0] * (len(new) - len(job.mask))
                job.ids = new
                self._answer(job)
            else:
                job.attempts += 1
                if job.attempts < QUERY_ATTEMPTS:
                    self._query(job)
                elif job.turn > 0:
                    self._finish(job)  # keep the first turn
                else:
                    self.failed["query dropped"] += 1
        else:
            job.ids += out
            job.mask += [1] * len(out)
            job.turn += 1
            ended = res.finish_reason == "stop"
            if job.turn < job.turns and ended and self.frame is not None:
                job.attempts = 0
                new = self.frame.join(job.ids, [], self.frame.to_query)
                job.mask += [0] * (len(new) - len(job.ids))
                job.ids = new
                self._query(job)
            else:
                self._finish(job)
        self._refill()

    def _finish(self, job: Job) -> None:
        n = len(job.mask)
        while n and job.mask[n - 1] == 0:  # drop a trailing template piece nothing was answered after
            n -= 1
        if n:
            self.store.add(job, job.ids[:n], job.mask[:n])

    def _refill(self) -> None:
        if self.deadline is not None and time.perf_counter() > self.deadline and self.pending:
            print(f"specloom data: time is up: {len(self.pending)} conversations not started (a rerun resumes)",
                  file=sys.stderr, flush=True)
            self.pending = []  # the running ones finish and are stored
        while self.pending and self.inflight < 2 * self.rows:
            self._start(self.pending.pop())
        if not self.pending and self.inflight == 0:
            self.sched.close()

    def run(self, jobs: list[Job]) -> None:
        self.pending = list(reversed(jobs))
        self._refill()
        if self.inflight:
            self.sched.run()


class ShardStore:
    """Completed conversations, written as shards of ~`shard_tokens` tokens; progress, ETA and the data card."""

    def __init__(self, out_dir: str, shard_tokens: int, total_jobs: int, card: dict):
        self.out_dir, self.shard_tokens, self.total_jobs, self.card = out_dir, shard_tokens, total_jobs, card
        self.buf: list[tuple[Job, list[int], list[int]]] = []
        self.buf_tokens = 0
        self.next_shard = 0
        self.done_jobs: set[int] = set()
        self.stats = {"answer_tokens": 0, "tokens": 0, "conversations": 0, "per_source": {},
                      "answer_lengths": [], "turns": Counter()}
        self.queries: list[str] = []
        self.t0 = time.perf_counter()
        self.answer_this_run = 0
        self.gen = None  # the Generator (for the filter's counts in the card)
        self.vocab_size = 1 << 31  # the target's (set by the caller): ids fit uint16 below 65,536
        self._last_print = 0.0

    def load_existing(self) -> None:
        from ..training.shards import read_shard, shard_files, shard_index

        for fn in shard_files(self.out_dir):
            d, meta = read_shard(fn, ("tokens", "offsets", "loss_mask", "job_ids"))
            info = json.loads(meta.get("specloom", "{}"))
            self.next_shard = max(self.next_shard, shard_index(fn) + 1)
            off = d["offsets"].tolist()
            for j, (a, b) in enumerate(zip(off[:-1], off[1:])):
                self._count(info["sources"][j], info["turns"][j], d["loss_mask"][a:b].tolist(), b - a)
            self.done_jobs.update(d["job_ids"].tolist())
            self.queries += info.get("queries", [])

    def _count(self, source: str, turns: int, mask: list[int], n: int) -> None:
        s = self.stats
        a = sum(mask)
        s["answer_tokens"] += a
        s["tokens"] += n
        s["conversations"] += 1
        src = s["per_source"].setdefault(source, {"conversations": 0, "answer_tokens": 0})
        src["conversations"] += 1
        src["answer_tokens"] += a
        s["answer_lengths"].append(a)
        s["turns"][str(turns)] += 1

    def add(self, job: Job, ids: list[int], mask: list[int]) -> None:
        self.buf.append((job, ids, mask))
        self.buf_tokens += len(ids)
        self.answer_this_run += sum(mask)
        self._count(job.source, job.turn, mask, len(ids))
        self.done_jobs.add(job.id)
        if self.buf_tokens >= self.shard_tokens:
            self.flush()
        now = time.perf_counter()
        if now - self._last_print >= 10.0:
            self._last_print = now
            self.progress()

    def progress(self) -> None:
        el = time.perf_counter() - self.t0
        rate = self.answer_this_run / max(el, 1e-9)
        s = self.stats
        done = len(self.done_jobs)
        per_job = s["answer_tokens"] / max(s["conversations"], 1)
        eta = (self.total_jobs - done) * per_job / max(rate, 1e-9)
        print(f"specloom data: {done}/{self.total_jobs} conversations  {s['answer_tokens'] / 1e6:.2f}M answer tokens  "
              f"{rate:.0f} answer tok/s  {el:.0f}s  ETA {eta / 60:.0f} min", file=sys.stderr, flush=True)

    def flush(self) -> None:
        from ..training.shards import write_shard

        if not self.buf:
            return
        toks, masks, offs, jobs = [], [], [0], []
        info = {"sources": [], "turns": [], "queries": []}
        for job, ids, mask in self.buf:
            toks += ids
            masks += mask
            offs.append(len(toks))
            jobs.append(job.id)
            info["sources"].append(job.source)
            info["turns"].append(job.turn)
            info["queries"] += job.queries
        self.queries += info["queries"]
        tensors = {"tokens": torch.tensor(toks, dtype=torch.int32), "offsets": torch.tensor(offs, dtype=torch.int64),
                   "loss_mask": torch.tensor(masks, dtype=torch.uint8), "job_ids": torch.tensor(jobs, dtype=torch.int64)}
        write_shard(self.out_dir, self.next_shard, tensors, {"specloom": json.dumps(info)}, self.vocab_size)
        self.next_shard += 1
        self.buf, self.buf_tokens = [], 0
        self.write_card()

    def write_card(self) -> None:
        s = self.stats
        filt = self.gen.filter if self.gen is not None else None
        kept = filt.kept if filt else 0
        dropped = dict(filt.dropped) if filt else {}
        n_q = kept + sum(dropped.values())
        dups = dropped.get("duplicate", 0) + dropped.get("near duplicate", 0)
        lens = sorted(s["answer_lengths"])
        edges = [0, 16, 32, 64, 128, 192, 256, 384, 512, 1024, 1 << 30]
        hist = [sum(1 for x in lens if lo <= x < hi) for lo, hi in zip(edges, edges[1:])]
        el = time.perf_counter() - self.t0
        prog = {
            "conversations": s["conversations"], "tokens": s["tokens"], "answer_tokens": s["answer_tokens"],
            "per_source": s["per_source"], "turns": dict(s["turns"]),
            "answer_length_histogram": {f"{lo}-{hi - 1}" if hi < 1 << 30 else f"{lo}+": h
                                        for lo, hi, h in zip(edges, edges[1:], hist)},
            "answer_length_median": lens[len(lens) // 2] if lens else 0,
            "magpie_queries_this_run": {"sampled": n_q, "kept": kept, "dropped": dropped,
                                        "dedup_rate": round(dups / n_q, 4) if n_q else None},
            "failed_this_run": dict(self.gen.failed) if self.gen is not None else {},
            "answer_tokens_per_s_this_run": round(self.answer_this_run / max(el, 1e-9), 1),
            "seconds_this_run": round(el, 1),
        }
        write_json(os.path.join(self.out_dir, "progress.json"), prog, indent=1)
        c = self.card
        lines = [f"# Self-distillation data for {c['target']}", "",
                 f"Command: `{c['command']}`", "",
                 f"Target fingerprint: `{json.dumps(c['fingerprint'])}`", "",
                 f"**{s['answer_tokens']:,} answer tokens** in {s['conversations']:,} conversations "
                 f"({s['tokens']:,} tokens with prompts and templates); median answer {prog['answer_length_median']} "
                 f"tokens; turns {dict(s['turns'])}.", "",
                 f"Answers: {c['sampled_fraction']:.0%} sampled (temperature {c['temperature_range'][0]}–"
                 f"{c['temperature_range'][1]}, no top-p), the rest greedy; at most {c['max_new_tokens']} tokens "
                 f"per answer; {c['multi_turn_fraction']:.0%} of conversations asked for a second, Magpie-written "
                 "turn.", "", "| source | conversations | answer tokens |", "|---|---:|---:|"]
        for src, v in sorted(s["per_source"].items()):
            lines.append(f"| {src} | {v['conversations']:,} | {v['answer_tokens']:,} |")
        lines += ["", "Answer length histogram (tokens per conversation):", "", "| tokens | conversations |",
                  "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in prog["answer_length_histogram"].items()]
        if n_q:
            lines += ["", f"Magpie queries sampled this run: {n_q}, kept {kept}; dropped {dropped}; "
                      f"dedup rate (exact + same first 10 words) {prog['magpie_queries_this_run']['dedup_rate']:.1%}."]
        lines += ["", f"Throughput this run: {prog['answer_tokens_per_s_this_run']} answer tokens/s over "
                  f"{el / 60:.1f} min. Prompts under `eval/` are refused; the eval set is never trained on.", ""]
        write_text(os.path.join(self.out_dir, "DATACARD.md"), "\n".join(lines))


def make_jobs(prompts: list[tuple[str, list[int]]], magpie: int, sampled_fraction: float, multi_turn: float,
              temperature_range: tuple[float, float], seed: int, chat: bool) -> list[Job]:
    """Every conversation of the run, in a seeded order that mixes the sources; ids are stable across reruns."""
    rng = random.Random(seed)
    specs = [(src, ids) for src, ids in prompts] + [("magpie", None)] * magpie
    jobs = []
    for i, (src, ids) in enumerate(specs):
        sampled = rng.random() < sampled_fraction
        t = round(rng.uniform(*temperature_range), 2) if sampled else 0.0
        turns = 2 if chat and rng.random() < multi_turn else 1
        jobs.append(Job(i, src, ids, t, turns))
    rng.shuffle(jobs)
    # within blocks, shortest prompt first: rows decoded together then have similar lengths, and the padded
    # attention of a step (every row reads as many slots as the longest) wastes little
    key = lambda j: len(j.prompt) if j.prompt is not None else 0  # noqa: E731
    return [j for i in range(0, len(jobs), SORT_BLOCK) for j in sorted(jobs[i:i + SORT_BLOCK], key=key)]


def build_dataset(
    target: str,
    prompt_paths: list[str],
    out_dir: str,
    max_new_tokens: int = 256,
    rows: int = 64,
    max_prompt_tokens: int = 640,
    limit: int | None = None,
    magpie: int = 0,
    sampled_fraction: float = 0.3,
    multi_turn_fraction: float = 0.2,
    temperature_range: tuple[float, float] = (0.7, 1.0),
    shard_tokens: int = 200_000,
    seed: int = 0,
    dtype: str = "bf16",
    kv_dtype: str | None = "bf16",
    device: str | None = "cpu",
    command: str | None = None,
    max_minutes: float | None = None,
) -> dict:
    from ..behaviour import check_behaviour, record_probe
    from ..engine import Engine
    from ..fingerprint import fingerprint
    from ..loading import load_target

    if not 0.0 <= sampled_fraction <= 1.0 or not 0.0 <= multi_turn_fraction <= 1.0:
        raise SpecloomError("--sampled-fraction and --multi-turn-fraction must lie in [0, 1]")
    lo, hi = temperature_range
    if not 0.0 < lo <= hi:
        raise SpecloomError(f"--temperature-range needs 0 < low <= high, got {lo} {hi}")
    if not prompt_paths and not magpie:
        raise SpecloomError("give --prompts and/or --magpie N")
    texts = ([(r["source"], r["text"]) for r in read_prompts(prompt_paths, refuse_eval=True)]
             if prompt_paths else [])
    model, tok = load_target(target, dtype, device=device)
    chat = tok.has_chat_template
    encoded, skipped = [], 0
    for src, text in texts:
        ids = tok.encode_chat([{"role": "user", "content": text}]) if chat else tok.encode(text)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        encoded.append((src, ids))
    if limit:
        encoded = encoded[:limit]
    frame = ChatFrame(tok) if (magpie or (multi_turn_fraction and chat)) and chat else None
    if magpie and frame is None:
        raise SpecloomError("--magpie needs a model with a chat template")
    jobs = make_jobs(encoded, magpie, sampled_fraction, multi_turn_fraction if frame else 0.0, temperature_range,
                     seed, frame is not None)
    settings = {"max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "magpie": magpie,
                "num_prompts": len(encoded), "sampled_fraction": sampled_fraction,
                "multi_turn_fraction": multi_turn_fraction, "temperature_range": list(temperature_range), "seed": seed, "kv_dtype": kv_dtype,
                "prompt_files": list(prompt_paths), "format": 2}
    meta = {"target": target, "fingerprint": fingerprint(model, tok), "capture": [], "hidden_size":
            model.config.hidden_size, "dtype": dtype, **settings}
    os.makedirs(out_dir, exist_ok=True)
    meta_path = os.path.join(out_dir, "meta.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as f:
            old = json.load(f)
        diff = [k for k in settings if k != "prompt_files" and old.get(k) != settings[k]]
        if old.get("fingerprint", {}) != meta["fingerprint"]:
            raise SpecloomError(f"{out_dir} holds data made with another target ({old.get('target')}); "
                                "use a new --out directory")
        if diff:
            raise SpecloomError(f"{out_dir} holds data made with other settings "
                                f"({', '.join(f'{k}: {old.get(k)} there, {settings[k]} now' for k in diff)}); "
                                "use a new --out directory or the same settings")
        if old.get("target_probe"):  # the data there was made with the recorded target: keep its recording
            meta["target_probe"] = old["target_probe"]
            check_behaviour(old["target_probe"], model, out_dir, tok, subject="the data there")
    if "target_probe" not in meta:
        meta["target_probe"] = record_probe(model, tok)
    write_json(meta_path, meta, indent=1)
    remove_stale(out_dir)  # a killed run's half-written shard, if any
    card = {"target": target, "fingerprint": meta["fingerprint"], "command": command or "specloom data", **settings}
    store = ShardStore(out_dir, shard_tokens, len(jobs), card)
    store.vocab_size = model.config.vocab_size
    store.load_existing()
    todo = [j for j in jobs if j.id not in store.done_jobs]
    # the longest conversation: prompt + answers + Magpie queries + template pieces
    turns = 2 if frame is not None and multi_turn_fraction else 1
    longest = max([len(ids) for _, ids in encoded] + [len(frame.pre_query) if frame else 1])
    max_len = min(longest + turns * (max_new_tokens + QUERY_TOKENS + 16) + 16, model.config.max_position)
    engine = Engine(model, tok, None, max_model_len=max_len)
    print(f"specloom data: {len(jobs)} conversations ({len(encoded)} prompts, {skipped} longer than "
          f"{max_prompt_tokens} tokens skipped; {magpie} Magpie), {len(jobs) - len(todo)} stored already; "
          f"{rows} rows of {max_len} tokens", file=sys.stderr, flush=True)
    from ..loading import parse_dtype

    gen = Generator(engine, frame, rows, max_new_tokens, seed, store,
                    kv_dtype=None if kv_dtype in (None, "auto") else parse_dtype(kv_dtype))
    store.gen = gen
    if max_minutes:
        gen.deadline = time.perf_counter() + 60 * max_minutes
    for q in store.queries:  # duplicates of queries stored by an earlier run are dropped too
        gen.filter.remember(q)
    import signal

    def stop(signum, frame):  # SIGTERM as Ctrl-C: keep what is finished
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    interrupted = False
    try:
        gen.run(todo)
    except KeyboardInterrupt:  # finished conversations are kept; the ones in flight are generated on resume
        interrupted = True
        print("\nspecloom data: interrupted; writing the finished conversations (rerun the same command to resume)",
              file=sys.stderr, flush=True)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
    store.flush()
    store.write_card()
    store.progress()
    if interrupted:
        raise KeyboardInterrupt
    return meta
