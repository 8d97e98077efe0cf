"""Prompt lookup (n-gram) drafting: find the latest earlier occurrence of the sequence's last n tokens
(n from `prompt_lookup_max` down to `prompt_lookup_min`) and propose the k tokens that followed it.
No model, no distribution: the verifier treats each draft as a one-hot q. Keys as in vLLM."""

from __future__ import annotations

import numpy as np

from ...errors import SpecloomError
from ...tree import DraftTree
from ..base import DraftContext, Drafter, int_key, register

DEFAULT_K = 4
DEFAULT_MIN, DEFAULT_MAX = 1, 4


@register("ngram", {"prompt_lookup_min": int_key(1, 64), "prompt_lookup_max": int_key(1, 64)},
          no_export='n-gram speculation has no weights (vLLM: "method": "ngram")')
class NgramDrafter(Drafter):
    idle_free = True  # the history array is grown from the tokens when it next drafts

    def __init__(self, k: int = DEFAULT_K, lookup_min: int = DEFAULT_MIN, lookup_max: int = DEFAULT_MAX):
        if not 1 <= lookup_min <= lookup_max:
            raise SpecloomError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lookup_min} and {lookup_max}"
            )
        self.k, self.lookup_min, self.lookup_max = k, lookup_min, lookup_max

    @classmethod
    def create(cls, spec, target, tokenizer) -> "NgramDrafter":
        hi = spec.prompt_lookup_max or max(spec.prompt_lookup_min or 0, DEFAULT_MAX)
        lo = spec.prompt_lookup_min or min(DEFAULT_MIN, hi)
        return cls(spec.num_speculative_tokens or DEFAULT_K, lo, hi)

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    def new_state(self) -> dict:
        return {"arr": np.zeros(0, dtype=np.int64)}  # the row's tokens as an array, grown as it grows

    @staticmethod
    def _history(state: dict, tokens: list[int]) -> np.ndarray:
        arr = state["arr"]
        n = len(arr)
        if n > len(tokens) or (n and arr[-1] != tokens[n - 1]):
            n = 0  # a new sequence
        if n < len(tokens):
            arr = state["arr"] = np.concatenate([arr[:n], np.asarray(tokens[n:], dtype=np.int64)])
        return arr

    def lookup(self, tokens: list[int], k: int, state: dict | None = None) -> list[int]:
        arr = self._history(self.new_state() if state is None else state, tokens)
        L = len(arr)
        for n in range(min(self.lookup_max, L - 1), self.lookup_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # earlier n-grams (not the suffix)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # the latest match
                return arr[start:start + k].tolist()
        return []

    def propose_one(self, ctx: DraftContext) -> DraftTree:
        return DraftTree.chain(ctx.tokens[-1], self.lookup(ctx.tokens, ctx.k, ctx.state) if ctx.k > 0 else [])
