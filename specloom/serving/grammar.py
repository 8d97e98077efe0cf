"""Grammar-constrained decoding (forced tool calls, structured output) that stays exact under speculation.

A thin layer over llguidance (`LLMatcher`: an Earley parser over a lexer, compiled for one tokenizer; JSON
schemas, Lark grammars with `%json{...}` inside, regexes). One `Constraint` holds one request's grammar state:

    constraint.mask_row(logits)          # the prefill's first token
    constraint.advance([first])
    tree = constraint.prune(tree)        # each step: drop drafts the grammar rejects (with their subtrees)
    constraint.mask(tree, logits)        # row i: -inf on every token forbidden after the path root..i
    result = verify(tree, logits, ...)
    constraint.advance(result.tokens)    # only what was emitted

Why this is exact: verification reads row i of the logits as the target's distribution after root..i, so masking
row i with the grammar state after that same path makes the verified distribution the constrained target's own,
whatever the drafter proposed. Pruning is only a saving: a draft the grammar rejects has p = 0 at its parent and
can never be accepted (and dropping a candidate is exact for multi-draft sampling too: each remaining sibling's
q is still the distribution it was drawn from). The matcher advances only in `advance`, over emitted tokens;
`prune` and `mask` probe the tree by a depth-first walk of consume / rollback and leave the state as they found
it. EOS is never consumed by the matcher: it is allowed exactly when the grammar may end, and after an emitted
(or drafted) EOS only EOS is allowed.

Compiled grammars are cached per (tokenizer, vocabulary size, spec) and each request gets a cheap deep copy.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SpecloomError
from ..tokenizer import Tokenizer
from ..tree import DraftTree

# JSON as OpenAI-style clients expect it, and no free whitespace: a small model left free to emit whitespace
# between tokens can loop on newlines forever. Strings may still contain anything.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256  # compiled grammars kept per tokenizer


class GrammarError(SpecloomError, ValueError):
    """The grammar or schema does not compile, or the output cannot continue under it; the message is the
    grammar library's first line (never its parser-state dump)."""


DEAD_END = ("the grammar allows no next token here: the schema or grammar cannot be completed (for example a "
            "required property whose $ref refers only to itself)")


def _brief(message: str) -> str:
    """The grammar library's message without the parser state and grammar it appends."""
    head = message.split("<state>", 1)[0].strip()
    return head.splitlines()[0] if head else "the grammar library refused it"


@dataclass(frozen=True)
class GrammarSpec:
    """What to constrain to, hashable (the compile cache key). Build with the class methods.

    kind: "json_schema" (source = the schema as JSON text), "lark" (a Lark grammar; `%json{...}` embeds a JSON
    schema, see `lark_json`) or "regex". `lenient`: JSON schema keywords llguidance does not implement are
    ignored instead of refused (then the output may not satisfy them)."""

    kind: str
    source: str
    lenient: bool = False

    @classmethod
    def json_schema(cls, schema: dict | bool, lenient: bool = False) -> GrammarSpec:
        return cls("json_schema", json.dumps(schema, ensure_ascii=False), lenient)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def lark(cls, text: str) -> GrammarSpec:
        return cls("lark", text)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    def to_llguidance(self) -> str:
        """The grammar in llguidance's serialized form (raises GrammarError for a source that is not JSON)."""
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            opts = dict(JSON_OPTIONS, lenient=True) if self.lenient else JSON_OPTIONS
            try:
                schema = json.loads(self.source)
                if isinstance(schema, bool):
                    schema = {} if schema else {"not": {}}
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON schema must be an object")
                return LLMatcher.grammar_from_json_schema(schema, defaults=opts)
            except (ValueError, TypeError) as e:
                raise GrammarError(str(e)) from None
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(self.source)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        raise GrammarError(f"unknown grammar kind {self.kind!r}")

    def check(self) -> None:
        """Raise GrammarError with the library's message when the grammar does not compile (no tokenizer needed)."""
        error = _validate(self.to_llguidance(), None)
        if error:
            raise GrammarError(error)


def lark_json(schema: dict, lenient: bool = False) -> str:
    """`%json{...}` for a Lark rule: the schema with our JSON options (a schema's own "x-guidance" wins)."""
    opts = dict(JSON_OPTIONS, lenient=True) if lenient else dict(JSON_OPTIONS)
    opts.update(schema.get("x-guidance") or {})
    return "%json " + json.dumps({**schema, "x-guidance": opts}, ensure_ascii=False)


def lark_literal(text: str) -> str:
    """A Lark string literal matching `text` exactly."""
    return json.dumps(text, ensure_ascii=False)


def _validate(grammar: str, lltok) -> str:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    return messages[0] if is_error else ""


# -- compile cache --------------------------------------------------------------------------------------------

class _Compiled:
    """One tokenizer (at one logits width) in llguidance's form, and its compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        import llguidance.hf

        n = len(tokenizer.hf)
        self.vocab_size = vocab_size  # the logits' width
        self.tokenizer_size = n  # ids >= this are never allowed
        self.eos = sorted(t for t in tokenizer.eos_token_ids if t < min(n, vocab_size))
        if not self.eos:
            raise GrammarError("constrained generation needs an end-of-sequence token in the tokenizer")
        try:
            self.lltok = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=max(n, vocab_size), eos_token=self.eos)
        except ValueError as e:  # not a fast tokenizer, or a decoder llguidance does not know (word-level)
            raise GrammarError(f"this tokenizer does not support constrained generation: {e}") from None
        self.grammars: OrderedDict[GrammarSpec, object] = OrderedDict()
        self.lock = threading.Lock()

    def matcher(self, spec: GrammarSpec):
        from llguidance import LLMatcher

        with self.lock:
            m = self.grammars.get(spec)
            if m is not None:
                self.grammars.move_to_end(spec)
                return m.deep_copy()
        grammar = spec.to_llguidance()
        error = _validate(grammar, self.lltok)
        if error:
            raise GrammarError(error)
        m = LLMatcher(self.lltok, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(_brief(m.get_error()))
        with self.lock:
            self.grammars[spec] = m
            while len(self.grammars) > _CACHE_SIZE:
                self.grammars.popitem(last=False)
        return m.deep_copy()


_compiled: weakref.WeakKeyDictionary[Tokenizer, dict[int, _Compiled]] = weakref.WeakKeyDictionary()
_compiled_lock = threading.Lock()


def _compiled_for(tokenizer: Tokenizer, vocab_size: int) -> _Compiled:
    with _compiled_lock:
        per = _compiled.setdefault(tokenizer, {})
        c = per.get(vocab_size)
        if c is None:
            c = per[vocab_size] = _Compiled(tokenizer, vocab_size)
        return c


def compile_constraint(spec: GrammarSpec, tokenizer: Tokenizer, vocab_size: int) -> Constraint:
    """A fresh Constraint for one request. `vocab_size` is the width of the model's logits (it may exceed the
    tokenizer's length: those extra ids are always forbidden). Raises GrammarError when the grammar does not
    compile. The tokenizer conversion (~0.4 s for 49k tokens) and each grammar compile are cached."""
    c = _compiled_for(tokenizer, vocab_size)
    return Constraint(c.matcher(spec), c)


# -- the per-request state ------------------------------------------------------------------------------------

def _bit_positions(words: np.ndarray, which: np.ndarray, value: int) -> np.ndarray:
    """Ids whose bit equals `value` (0 or 1) within the words `which` of a uint32 bitmask (bit j of word i is
    id 32 i + j)."""
    bits = np.unpackbits(words[which].astype("<u4").view(np.uint8).reshape(-1, 4), axis=-1, bitorder="little")
    return (which[:, None] * 32 + np.arange(32))[bits == value]


class Constraint:
    """One request's grammar state. Only `advance` changes it."""

    def __init__(self, matcher, compiled: _Compiled):
        self._m = matcher
        self._c = compiled
        self._eos_set = frozenset(compiled.eos)
        self._words = (compiled.lltok.vocab_size + 31) // 32
        eos = np.array(compiled.eos, dtype=np.int64)
        self._eos_bits = np.zeros(self._words, dtype=np.uint32)  # the EOS ids as a bitmask
        np.bitwise_or.at(self._eos_bits, eos >> 5, (np.uint32(1) << (eos & 31).astype(np.uint32)))
        self._ended = False  # an EOS was emitted
        self._cached: tuple[DraftTree, np.ndarray] | None = None  # prune's rows, reused by mask
        # the matcher's error state is sticky (a rollback does not clear it): a drafted dead end probed by `_walk`
        # is undone by replaying the emitted tokens on a copy of the start state
        self._start = matcher.deep_copy()
        self._emitted: list[int] = []

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """The grammar has reached an end state that allows nothing but EOS."""
        return self._ended or self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """The output so far is complete (EOS allowed now)."""
        return self._ended or self._m.is_accepting()

    def advance(self, tokens: list[int]) -> None:
        """Consume emitted tokens (accepted drafts plus the bonus / recovered token). An EOS is allowed only when
        the grammar may end; after it only EOS."""
        self._cached = None
        for t in tokens:
            t = int(t)
            if t in self._eos_set:
                if not self.accepting:
                    raise GrammarError(f"end of sequence emitted before the grammar was complete (token {t})")
                self._ended = True
                continue
            if self._ended:
                raise GrammarError(f"token {t} emitted after the end of sequence")
            if not self._m.consume_token(t):
                raise GrammarError(f"token {t} violates the grammar: {_brief(self._m.get_error())}")
            self._emitted.append(t)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces from here (llguidance's fast-forward tokens: the forced bytes,
        tokenized canonically; a JSON key, a closing brace, a tool-call envelope). The step drafts them for free;
        they are drafts like any other (the masked target verifies them), so a tokenization the target would
        not choose costs one wider pass, never exactness. None after an EOS."""
        if self._ended or limit <= 0 or self._m.is_stopped():
            return []
        try:
            return [int(t) for t in self._m.compute_ff_tokens()[:limit]]
        except Exception:  # a matcher in an error state: nothing forced (mask / advance report it)
            return []

    def _replay(self, path: list[int]) -> None:
        """A fresh matcher at the state after the emitted tokens and then `path` (drafted tokens)."""
        m = self._start.deep_copy()
        for t in self._emitted + path:
            if not m.consume_token(t):
                raise GrammarError(f"token {t} refused on replay: {_brief(m.get_error())}")
        self._m = m

    # -- masks ----------------------------------------------------------------------------------------------
    def _fill(self, out: np.ndarray, ended: bool) -> None:
        """out (W,) uint32 <- the tokens allowed after the current matcher state (`ended`: after an EOS, where
        only EOS is). EOS is allowed exactly when the grammar may end (llguidance agrees; made explicit here, for
        every id of the tokenizer's EOS set)."""
        if ended:
            out[:] = self._eos_bits
            return
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        if self._m.is_accepting():
            out |= self._eos_bits
        else:
            out &= ~self._eos_bits

    @staticmethod
    def _allows(row: np.ndarray, token: int) -> bool:
        return (token >> 5) < row.shape[0] and bool((int(row[token >> 5]) >> (token & 31)) & 1)

    def _walk(self, tree: DraftTree) -> tuple[list[bool], np.ndarray]:
        """Depth-first over the tree with consume / rollback: (alive per node, (N, W) uint32 bitmask per node).
        A node is alive when its whole path is grammatical and the grammar allows some token after it (a draft
        into a dead end is cut like an ungrammatical one; should the target itself choose that token, the next
        step's root finds no allowed token). The row of a dead node allows EOS only; it is never read
        (verification cannot reach a node whose token has p = 0 at its parent, nor a pruned one). Raises
        GrammarError (DEAD_END) when nothing is allowed at the root: the request cannot be completed."""
        n = len(tree)
        rows = np.empty((n, self._words), dtype=np.uint32)
        rows[:] = self._eos_bits
        alive = [False] * n
        alive[0] = True
        vocab = min(self._c.tokenizer_size, self._c.vocab_size)
        tokens, path = tree.tokens, []  # path: the drafted tokens consumed to reach the node visited

        def visit(node: int, ended: bool) -> bool:
            """Fill the node's row and walk its children; False when the grammar allows no token after it."""
            row = rows[node]
            self._fill(row, ended)
            if not row.any():
                return False
            for c in tree.children(node):
                t = tokens[c]
                if not 0 <= t < vocab or not self._allows(row, t):
                    continue
                if ended or t in self._eos_set:  # EOS is not consumed: after it, only EOS
                    alive[c] = visit(c, True)
                    continue
                if not self._m.consume_token(t):  # cannot happen: the mask allowed it
                    raise GrammarError(f"token {t} allowed by the mask but refused: {_brief(self._m.get_error())}")
                path.append(t)
                try:
                    alive[c] = visit(c, False)  # a draft into a dead end is cut: verification never reaches it
                finally:
                    path.pop()
                    self._m.rollback(1)
                if self._m.is_error():  # the dead end's mask left the matcher in its (sticky) error state
                    self._replay(path)
            return True

        if not visit(0, self._ended):
            raise GrammarError(DEAD_END)
        return alive, rows

    def _apply(self, rows: np.ndarray, logits: torch.Tensor) -> None:
        """logits (N, V) in place: -inf where the row's bit is clear; ids beyond the tokenizer always -inf.

        Per row, whichever list is shorter is written: the allowed ids (the row is filled with -inf and they are
        put back) or the forbidden ones. Grammar rows are nearly always one or the other (structure: a few
        tokens; inside a string: nearly all), and a dense masked_fill over (N, V) costs ms on a CPU."""
        v = logits.shape[-1]
        n = min(v, self._c.tokenizer_size, 32 * self._words)
        few_rows, few_r, few_i, many_r, many_i = [], [], [], [], []
        for r in range(rows.shape[0]):
            w = rows[r]
            some = np.flatnonzero(w)  # words holding an allowed id
            holes = np.flatnonzero(w != 0xFFFFFFFF)  # words holding a forbidden id
            if len(some) <= len(holes):
                idx = _bit_positions(w, some, 1)
                idx = idx[idx < n]
                few_rows.append(r)
                few_r.append(np.full(len(idx), r))
                few_i.append(idx)
            else:
                idx = _bit_positions(w, holes, 0)
                idx = idx[idx < n]
                many_r.append(np.full(len(idx), r))
                many_i.append(idx)
        dev = logits.device
        if few_rows:
            rr = torch.from_numpy(np.concatenate(few_r)).to(dev)
            ii = torch.from_numpy(np.concatenate(few_i)).to(dev)
            kept = logits[rr, ii]
            logits[torch.tensor(few_rows, device=dev)] = float("-inf")
            logits[rr, ii] = kept
        if many_r:
            rr = torch.from_numpy(np.concatenate(many_r)).to(dev)
            ii = torch.from_numpy(np.concatenate(many_i)).to(dev)
            logits[rr, ii] = float("-inf")
        if n < v:
            logits[:, n:] = float("-inf")

    def mask_row(self, logits: torch.Tensor) -> None:
        """(V,) in place: the current state's mask (the prefill's first token)."""
        row = np.empty((1, self._words), dtype=np.uint32)
        self._fill(row[0], self._ended)
        if not row.any():
            raise GrammarError(DEAD_END)
        self._apply(row, logits.view(1, -1))

    def mask(self, tree: DraftTree, logits: torch.Tensor) -> None:
        """(N, V) in place: row i gets -inf on every token forbidden after the path root..i (row 0: now)."""
        if logits.shape[0] != len(tree):
            raise ValueError(f"{logits.shape[0]} rows of logits for a tree of {len(tree)} nodes")
        if self._cached is not None and self._cached[0] is tree:
            rows = self._cached[1]
        else:
            rows = self._walk(tree)[1]
        self._cached = None
        self._apply(rows, logits)

    def prune(self, tree: DraftTree) -> DraftTree:
        """Drop drafted nodes whose token the grammar rejects after root..parent, with their subtrees. Nodes
        keep their order (siblings are tried in order); draft_probs keeps the rows of the kept nodes. Returns
        `tree` itself when nothing is dropped. The matcher state is unchanged."""
        alive, rows = self._walk(tree)
        if all(alive):
            out = tree
        else:
            keep = [i for i, a in enumerate(alive) if a]
            new = {old: i for i, old in enumerate(keep)}
            probs = tree.draft_probs[keep] if tree.draft_probs is not None else None
            out = DraftTree([tree.tokens[i] for i in keep], [-1] + [new[tree.parents[i]] for i in keep[1:]], probs)
            rows = rows[keep]
        self._cached = (out, rows)
        return out
