"""Incremental detokenization that is exact however many tokens arrive per step.

A speculative step can emit several tokens at once, and a token can end in the middle of a UTF-8 character (byte-
level BPE) or carry a word-leading space that only renders correctly with its left context (SentencePiece). The
detokenizer therefore decodes a short window of already-emitted tokens together with the new ones and emits only
the text that the window did not already produce, holding back text that still ends in an incomplete character
(U+FFFD). Invariant (tested for every way of cutting the token stream): the concatenated deltas equal
`tokenizer.decode(all_ids)`, because every delta is the difference between decodes of growing suffixes of the
same sequence, and `finish()` flushes what was held back.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, context: int = 6):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.context = context
        self.ids: list[int] = []
        self.prefix = 0  # window start: tokens before it are fully rendered and never re-decoded
        self.read = 0  # tokens whose text has been emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=self.skip)

    def push(self, ids: Sequence[int]) -> str:
        """Add the tokens of one step; return the new stable text (possibly empty)."""
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT) or not after.startswith(before):
            return ""  # an incomplete character (or a window that re-renders): wait for more tokens
        delta = after[len(before):]
        self.read = len(self.ids)
        self.prefix = max(self.prefix, self.read - self.context)
        self.text += delta
        return delta

    def finish(self) -> str:
        """Flush text still held back (e.g. a sequence cut inside a character); the total then equals
        `decode(all ids)`."""
        full = self._decode(self.ids)
        if not full.startswith(self.text):  # cannot happen for prefix-stable tokenizers; never lose text
            return ""
        delta = full[len(self.text):]
        self.text = full
        self.read = len(self.ids)
        return delta
