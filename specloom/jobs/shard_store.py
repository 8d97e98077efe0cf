"""Where `specloom data` keeps what it generates: completed conversations written as compact shards
(training/shards.py) of ~`shard_tokens` tokens, resumable (the shards already written name the jobs done), with
progress, an ETA and the data card (DATACARD.md, progress.json) rewritten after every shard; `Job`, the
conversation record both sides share."""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..atomic import write_json, write_text


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
