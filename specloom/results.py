"""What a finished request returns, and the counters behind it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .tree import DraftTree


def add_per_position(acc: list[int], xs: list[int] | None) -> None:
    """acc[i] += xs[i], growing acc as needed (per-position counts summed over drafts or requests)."""
    for i, x in enumerate(xs or []):
        if i == len(acc):
            acc.append(0)
        acc[i] += x


def count_draft(proposed_at: list[int], accepted_at: list[int], depth: int, accepted: int, n: int = 1) -> None:
    """Count one draft `depth` tokens deep whose first `accepted` were accepted: `n` added at positions
    0..depth-1 of `proposed_at` and 0..accepted-1 of `accepted_at` (both grown to `depth`); n=-1 takes it back."""
    add_per_position(proposed_at, [n] * depth)
    add_per_position(accepted_at, [n] * accepted + [0] * (depth - accepted))


def acceptance_rates(accepted: list[int], proposed: list[int], reached_only: bool = False) -> list[float]:
    """alpha_k = drafts whose k-th token was accepted / drafts that proposed a k-th token; 0.0 where none did,
    or (`reached_only`) such positions left out."""
    return [a / p if p else 0.0 for a, p in zip(accepted, proposed) if p or not reached_only]


def mean_accepted_length(num_tokens: int, num_passes: int, num_requests: int = 1) -> float:
    """tau = tokens per verification step; each request's prefill pass and the token it yields are excluded."""
    steps = num_passes - num_requests
    return (num_tokens - num_requests) / steps if steps > 0 else 1.0


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length" | "abort"
    num_target_passes: int
    mean_accepted_length: float  # tau: tokens per verification step (the prefill's first token excluded)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_position: list[int] = field(default_factory=list)  # drafts that proposed a k-th token
    accepted_per_position: list[int] = field(default_factory=list)  # ... whose k-th token was accepted
    prefill_seconds: float = 0.0
    total_seconds: float = 0.0
    draft_seconds: float = 0.0  # time in the drafter (prefill, propose, on_verified), part of total_seconds
    logprobs: list | None = None  # per token (logprob, [(alternative id, logprob), ...]) when asked
    speculation: dict | None = None  # Engine.generate: mode, steps, mean chosen depth, steps that drafted

    @property
    def acceptance_per_position(self) -> list[float]:
        return acceptance_rates(self.accepted_per_position, self.proposed_per_position)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second, prefill included (as a user feels it)."""
        return len(self.token_ids) / self.total_seconds if self.total_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first per second after the prefill (the first token comes out of the prefill)."""
        t = self.total_seconds - self.prefill_seconds
        return (len(self.token_ids) - 1) / t if t > 0 and len(self.token_ids) > 1 else 0.0

    def to_dict(self) -> dict:
        d = asdict(self)
        d["tokens_per_second"] = self.tokens_per_second
        d["decode_tokens_per_second"] = self.decode_tokens_per_second
        d["acceptance_per_position"] = self.acceptance_per_position
        d["num_prompt_tokens"] = len(self.prompt_token_ids)
        d["num_generated_tokens"] = len(self.token_ids)
        return d


class StopChecker:
    """Finds stop strings in the generated text; returns the text cut before the first one."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]

    def check(self, ids: list[int]) -> str | None:
        if not self.stop:
            return None
        text = self.tokenizer.decode(ids)
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else None


class Stats:
    """Per-request counters. `passes` counts every target pass that yields tokens, the prefill included (it
    yields the first token). tau (mean accepted length) counts verification steps only, as vLLM and Spec-Bench
    do: tokens emitted by verification steps / verification steps = 1 + accepted / steps; 1.0 when plain."""

    def __init__(self):
        self.passes = 1
        self.drafted = 0
        self.accepted = 0
        self.proposed_at: list[int] = []
        self.accepted_at: list[int] = []

    def record(self, tree: DraftTree, num_accepted: int) -> None:
        self.passes += 1
        if len(tree) == 1:
            return
        self.drafted += len(tree) - 1
        self.accepted += num_accepted
        count_draft(self.proposed_at, self.accepted_at, tree.max_depth, num_accepted)
