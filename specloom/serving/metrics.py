"""Prometheus metrics for `/metrics`, with vLLM's names where one exists (`vllm:` -> `specloom:`).

Counters: requests (by finish reason), requests aborted by their client, error responses (by status), prompt and generation tokens, speculative drafts, draft tokens, accepted
tokens, accepted tokens per draft position (`position` label); histograms: end-to-end request latency and time to
first token; gauges from the scheduler: running and waiting requests, KV pool usage (rows and slots), the draft
depth chosen at the last step; counters of scheduler steps, batch sizes and chosen depths (mean depth per step =
spec_decode_depth_sum / scheduler_steps_total: how load-aware speculation reacts to load); with a drafter, the
live acceptance monitor's gauges (serving/monitor.py): the rolling acceptance rate over the last drafted steps,
overall and per draft position, its start-up figure, and whether the drafter is judged degraded (0/1). Plain
text exposition format 0.0.4, no client library needed.
"""

from __future__ import annotations

import threading

from ..results import add_per_position

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Histogram:
    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.n = 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.n += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        sep = "," if labels else ""
        out = [f'{name}_bucket{{{labels}{sep}le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}')
        out.append(f"{name}_sum{{{labels}}} {self.sum}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


class Metrics:
    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.lock = threading.Lock()
        self.requests: dict[str, int] = {}
        self.aborted = 0  # requests whose client went away before they finished
        self.errors: dict[int, int] = {}  # error responses by HTTP status
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_at: list[int] = []
        self.latency = _Histogram()
        self.ttft = _Histogram()
        self.scheduler = None
        self.steps = 0
        self.depth_sum = 0  # sum over steps of the mean chosen draft depth per sequence
        self.batch_sum = 0
        self.last_depths: list[int] = []

    def bind(self, scheduler) -> None:
        self.scheduler = scheduler

    def step(self, batch_size: int, depths: list[int]) -> None:
        """One scheduler step: how many sequences ran and the draft depth chosen for each."""
        with self.lock:
            self.steps += 1
            self.batch_sum += batch_size
            self.depth_sum += sum(depths) / max(1, len(depths))
            self.last_depths = list(depths)

    def abort(self) -> None:
        with self.lock:
            self.aborted += 1

    def error(self, status: int) -> None:
        with self.lock:
            self.errors[status] = self.errors.get(status, 0) + 1

    def record(self, result, seconds: float, ttft: float | None) -> None:
        """One finished generation (an Engine GenerationResult)."""
        with self.lock:
            reason = result.finish_reason
            self.requests[reason] = self.requests.get(reason, 0) + 1
            self.prompt_tokens += len(result.prompt_token_ids)
            self.generation_tokens += len(result.token_ids)
            self.drafts += result.proposed_per_position[0] if result.proposed_per_position else 0
            self.draft_tokens += result.num_draft_tokens
            self.accepted += result.num_accepted_tokens
            add_per_position(self.accepted_at, result.accepted_per_position)
            self.latency.observe(seconds)
            if ttft is not None:
                self.ttft.observe(ttft)

    def render(self) -> str:
        L = self.labels
        with self.lock:
            out = ["# TYPE specloom:request_success_total counter"]
            out += [f'specloom:request_success_total{{{L},finished_reason="{r}"}} {n}' for r, n in
                    sorted(self.requests.items())]
            out.append("# TYPE specloom:request_errors_total counter")
            out += [f'specloom:request_errors_total{{{L},status="{c}"}} {n}' for c, n in sorted(self.errors.items())]
            for name, v in (("request_aborted_total", self.aborted),
                            ("prompt_tokens_total", self.prompt_tokens),
                            ("generation_tokens_total", self.generation_tokens),
                            ("spec_decode_num_drafts_total", self.drafts),
                            ("spec_decode_num_draft_tokens_total", self.draft_tokens),
                            ("spec_decode_num_accepted_tokens_total", self.accepted)):
                out += [f"# TYPE specloom:{name} counter", f"specloom:{name}{{{L}}} {v}"]
            out.append("# TYPE specloom:spec_decode_num_accepted_tokens_per_pos counter")
            out += [f'specloom:spec_decode_num_accepted_tokens_per_pos{{{L},position="{i}"}} {a}'
                    for i, a in enumerate(self.accepted_at)]
            sch = self.scheduler
            if sch is not None:
                pool = sch.pool
                used = sum(pool.lengths) / (pool.rows * pool.max_len)  # a free row holds 0
                for name, v in (("num_requests_running", sch.num_running), ("num_requests_waiting", sch.num_waiting),
                                ("kv_cache_usage_perc", round(used, 6)),
                                ("kv_cache_rows_used", pool.active), ("kv_cache_rows_total", pool.rows),
                                ("spec_decode_depth_last_max", max(self.last_depths, default=0))):
                    out += [f"# TYPE specloom:{name} gauge", f"specloom:{name}{{{L}}} {v}"]
            mon = getattr(sch, "monitor", None) if sch is not None else None
            if mon is not None and sch.drafter is not None:
                out += _monitor_lines(mon.snapshot(), L)
            for name, v in (("scheduler_steps_total", self.steps),
                            ("scheduler_batch_size_sum", self.batch_sum),
                            ("spec_decode_depth_sum", round(self.depth_sum, 6))):
                out += [f"# TYPE specloom:{name} counter", f"specloom:{name}{{{L}}} {v}"]
            out.append("# TYPE specloom:e2e_request_latency_seconds histogram")
            out += self.latency.lines("specloom:e2e_request_latency_seconds", L)
            out.append("# TYPE specloom:time_to_first_token_seconds histogram")
            out += self.ttft.lines("specloom:time_to_first_token_seconds", L)
        return "\n".join(out) + "\n"


def _monitor_lines(snap: dict, L: str) -> list[str]:
    """The acceptance monitor's gauges: rolling acceptance (NaN before the first drafted step), per position
    (0-based, as spec_decode_num_accepted_tokens_per_pos), the start-up figure (when known), degraded 0/1."""
    def num(v):
        return "NaN" if v is None else round(v, 6)

    out = ["# TYPE specloom:spec_decode_acceptance_rate gauge",
           f"specloom:spec_decode_acceptance_rate{{{L}}} {num(snap['acceptance_rate'])}",
           "# TYPE specloom:spec_decode_acceptance_rate_per_pos gauge"]
    out += [f'specloom:spec_decode_acceptance_rate_per_pos{{{L},position="{i}"}} {num(v)}'
            for i, v in enumerate(snap["per_position"])]
    if snap["expected_acceptance_rate"] is not None:
        out += ["# TYPE specloom:spec_decode_acceptance_rate_expected gauge",
                f"specloom:spec_decode_acceptance_rate_expected{{{L}}} {num(snap['expected_acceptance_rate'])}"]
    out += ["# TYPE specloom:spec_decode_degraded gauge",
            f"specloom:spec_decode_degraded{{{L}}} {int(snap['degraded'])}"]
    return out
