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

from ..atomic import remove_stale, write_json
from ..errors import SpecloomError
from ..prompts import read_prompts
from ..training.magpie import ChatFrame, QueryFilter
from .shard_store import Job, ShardStore

QUERY_TOKENS = 128  # at most this many tokens for a Magpie-written user query
QUERY_TEMPERATURE, QUERY_TOP_P = 1.0, 1.0  # Magpie: the raw distribution
QUERY_ATTEMPTS = 4
ANSWER_TOP_P = 1.0  # sampled answers: temperature only (top-p sorts the vocabulary of every row at every step)
SORT_BLOCK = 256  # jobs are sorted by prompt length within blocks of this many  # a Magpie conversation whose query is dropped this many times is given up


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
        # a larger --magpie only appends conversations: the ids, temperatures and turns of the stored ones are drawn
        # first from the same seed (make_jobs), so the data there stays a prefix of the grown run
        grows = isinstance(old.get("magpie"), int) and magpie > old["magpie"]
        diff = [k for k in settings if k != "prompt_files" and old.get(k) != settings[k]
                and not (k == "magpie" and grows)]
        if old.get("fingerprint", {}) != meta["fingerprint"]:
            raise SpecloomError(f"{out_dir} holds data made with another target ({old.get('target')}); "
                                "use a new --out directory")
        if diff:
            raise SpecloomError(f"{out_dir} holds data made with other settings "
                                f"({', '.join(f'{k}: {old.get(k)} there, {settings[k]} now' for k in diff)}); "
                                "use a new --out directory or the same settings")
        if grows:
            print(f"specloom data: growing the Magpie conversations from {old['magpie']} to {magpie}; the stored "
                  "ones are kept", file=sys.stderr, flush=True)
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
