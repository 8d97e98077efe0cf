"""Suffix decoding (SuffixDecoding, Oliaro et al., arXiv 2411.04975; vLLM's `method: "suffix"`, from Arctic
Inference): no model, no weights. Each sequence keeps a suffix trie over its prompt and its output so far
(updated as tokens are emitted, O(max depth) per token); the drafter keeps one more, shared by all sequences of
the engine, over the responses of earlier finished requests (serving), at most `max_cached_requests` of them
(the oldest is dropped first; 0 turns the cache off).

Each step the longest suffixes of the context (up to the trie depth) are matched in both tries and a draft *tree*
is grown from the match, best-first by empirical probability (the product of count(child) / count of the
parent's continuations along the path); nodes below `min_token_prob` are dropped and a match of length m yields
at most `max_spec_factor * m` tokens. The better-scoring tree (sum of its node probabilities) of the two tries
wins, the request's own on a tie. Drafts are one-hot (no distribution), so verification stays exact.

Keys (vLLM's names and defaults):

* `suffix_decoding_max_tree_depth` (24, 1 … 256): depth of the tries; bounds match length + draft depth.
* `suffix_decoding_max_cached_requests` (10000, 0 … 10^6): responses kept in the global trie (0: none).
* `suffix_decoding_max_spec_factor` (1.0, 0 … 64): at most factor × match length tokens per draft.
* `suffix_decoding_min_token_prob` (0.1, 0 … 1): drop draft nodes whose path probability is below it.
* `num_speculative_tokens` (8 here; vLLM defaults to the tree depth, 24): the most drafted nodes per step and
  the deepest draft. 8 keeps a CPU verification pass cheap; raise it for very repetitive work.

The global cache is filled by the serving scheduler as it retires a finished request (`on_finished`);
`Engine.generate` calls stand alone and do not fill it (so benchmarks that repeat a prompt measure the request's
own repetition, not a cached copy of its answer); `add_response(tokens)` fills it by hand. The cache lives in
host memory, outside the KV memory plan: about 120-180 bytes per cached token (measured), so the default 10000
responses of 500 tokens can take up to ~1 GB; lower `suffix_decoding_max_cached_requests` on small machines.
Caching a response costs O(depth) per token in the scheduler thread when the request finishes (and as much again
for the one it evicts).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from ...errors import SpecloomError
from ...tree import DraftTree
from ..base import DraftContext, Drafter, float_key, int_key, register
from .trie import SuffixTrie, speculate

DEFAULT_K = 8
DEFAULT_DEPTH = 24
DEFAULT_CACHED = 10000
DEFAULT_FACTOR = 1.0
DEFAULT_MIN_PROB = 0.1


class SuffixState:
    """One sequence's trie over its prompt and output so far (the writer holds the tokens it has seen)."""

    __slots__ = ("trie", "writer")

    def __init__(self, max_depth: int):
        self.trie = SuffixTrie(max_depth)
        self.writer = self.trie.writer()


@register("suffix", {
    "suffix_decoding_max_tree_depth": int_key(1, 256),
    "suffix_decoding_max_cached_requests": int_key(0, 10 ** 6),
    "suffix_decoding_max_spec_factor": float_key(0, 64),
    "suffix_decoding_min_token_prob": float_key(0, 1),
}, no_export='suffix decoding has no weights (vLLM: "method": "suffix")')
class SuffixDrafter(Drafter):
    idle_free = True  # the row's trie takes the tokens added since it last drafted (`_sync`)

    def __init__(self, k: int = DEFAULT_K, max_tree_depth: int = DEFAULT_DEPTH,
                 max_cached_requests: int = DEFAULT_CACHED, max_spec_factor: float = DEFAULT_FACTOR,
                 min_token_prob: float = DEFAULT_MIN_PROB):
        if k < 1 or max_tree_depth < 1 or max_cached_requests < 0 or max_spec_factor < 0 \
                or not 0 <= min_token_prob <= 1:
            raise SpecloomError(
                f"bad suffix decoding settings: num_speculative_tokens {k}, max tree depth {max_tree_depth}, "
                f"max cached requests {max_cached_requests}, spec factor {max_spec_factor}, "
                f"min token prob {min_token_prob}")
        self.k, self.max_tree_depth = k, max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor, self.min_token_prob = max_spec_factor, min_token_prob
        self.num_nodes = k  # a tree of at most k drafted nodes (the load-aware policy shrinks it with the depth)
        self._global = SuffixTrie(max_tree_depth)
        self._cached: OrderedDict[int, list[int]] = OrderedDict()  # id -> the token list held by the trie
        self._next_id = 0
        self._lock = threading.Lock()  # the scheduler thread fills the cache; any thread may draft

    @classmethod
    def create(cls, spec, target, tokenizer) -> "SuffixDrafter":
        return cls.from_keys(spec, spec.num_speculative_tokens)

    @classmethod
    def from_keys(cls, spec, k: int | None) -> "SuffixDrafter":
        """A suffix drafter of depth `k` (None: the default) with `spec`'s `suffix_decoding_*` keys."""
        def pick(v, default):
            return default if v is None else v

        return cls(pick(k, DEFAULT_K),
                   pick(spec.suffix_decoding_max_tree_depth, DEFAULT_DEPTH),
                   pick(spec.suffix_decoding_max_cached_requests, DEFAULT_CACHED),
                   pick(spec.suffix_decoding_max_spec_factor, DEFAULT_FACTOR),
                   pick(spec.suffix_decoding_min_token_prob, DEFAULT_MIN_PROB))

    @property
    def num_speculative_tokens(self) -> int:
        return self.k

    # -- per sequence ----------------------------------------------------------------------------------------
    def new_state(self) -> SuffixState:
        return SuffixState(self.max_tree_depth)

    def _sync(self, state: SuffixState | None, tokens: list[int]) -> SuffixState:
        """The state holding exactly `tokens`: only the tokens added since the last call are inserted."""
        seq = state.writer.seq if state is not None else []
        n = len(seq)
        if state is None or n > len(tokens) or (n and seq[-1] != tokens[n - 1]):  # a new sequence: start over
            state, n = self.new_state(), 0
        if n < len(tokens):
            state.trie.append(state.writer, tokens[n:])
        return state

    def propose_one(self, ctx: DraftContext) -> DraftTree:
        root = ctx.tokens[-1]
        state = ctx.state = self._sync(ctx.state, ctx.tokens)
        if ctx.k <= 0:
            return DraftTree([root], [-1])
        max_nodes = self.k if ctx.max_nodes is None else min(self.k, ctx.max_nodes)
        args = (max_nodes, ctx.k, self.max_spec_factor, self.min_token_prob)
        # the request's own trie: the current suffixes are its writer's active positions (no walk needed)
        act = state.writer.active
        best = speculate(state.trie, [(m, act[m]) for m in range(1, len(act))], *args)
        if self._cached:
            context = ctx.tokens[-(self.max_tree_depth - 1):] if self.max_tree_depth > 1 else []
            with self._lock:
                best = speculate(self._global, self._global.matches(context), *args, best=best)
        if best is None:
            return DraftTree([root], [-1])
        return DraftTree([root, *best.tokens], [-1, *best.parents], score=best.score)

    # -- across requests -------------------------------------------------------------------------------------
    def on_finished(self, ctx: DraftContext) -> None:
        self.add_response(ctx.tokens[ctx.num_prompt_tokens:])

    def add_response(self, tokens) -> None:
        """Cache one response in the global trie, dropping the oldest beyond `max_cached_requests`."""
        tokens = [int(t) for t in tokens]
        if self.max_cached_requests == 0 or not tokens:
            return
        with self._lock:
            self._cached[self._next_id] = self._global.add(tokens)
            self._next_id += 1
            while len(self._cached) > self.max_cached_requests:
                _, old = self._cached.popitem(last=False)
                self._global.remove(old)

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)

    def clear_cache(self) -> None:
        with self._lock:
            self._global = SuffixTrie(self.max_tree_depth)
            self._cached.clear()
