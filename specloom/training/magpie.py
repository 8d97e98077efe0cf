"""Prompts that look like chat, written by the target itself (the Magpie recipe, Xu et al. 2024).

Feed the chat template up to the start of a user turn and let the model sample what a user would write; keep the
queries that are not degenerate and not duplicates, then have the model answer them. The same trick after an
answer gives a follow-up turn, so conversations can be multi-turn.

`ChatFrame` cuts the model's own chat template into its pieces (what comes before the first user message, between a
user message and the answer, between an answer and the next user message), so nothing here assumes one template.
`QueryFilter` decides which sampled queries to keep and counts why the others were dropped.
"""

from __future__ import annotations

import re
from collections import Counter

from ..errors import SpecloomError

_MARKS = ("\x00", "\x01", "\x02")


class ChatFrame:
    """Token ids of a chat template's fixed pieces: `pre_query` (system prompt + user header), `to_answer`
    (end of a user turn + assistant header) and `to_query` (end of an answer + user header)."""

    def __init__(self, tokenizer):
        hf = tokenizer.hf
        if not tokenizer.has_chat_template:
            raise SpecloomError("Magpie prompts need a chat template; this model has none (drop --magpie)")
        msgs = [{"role": "user", "content": _MARKS[0]}, {"role": "assistant", "content": _MARKS[1]},
                {"role": "user", "content": _MARKS[2]}]
        text = hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        parts = re.split("[\x00\x01\x02]", text)
        if len(parts) != 4:
            raise SpecloomError("cannot split this model's chat template into user and assistant turns")
        enc = lambda s: list(hf(s, add_special_tokens=False)["input_ids"])  # noqa: E731
        self.pre_query = enc(parts[0])
        self.to_answer = enc(parts[1])
        self.to_query = enc(parts[2])
        self.eos = tokenizer.eos_token_ids

    def join(self, ids: list[int], generated: list[int], piece: list[int]) -> list[int]:
        """ids + generated + piece, where a generated end-of-turn token stands for the same token at the start of
        the template piece (it is not repeated)."""
        out = ids + generated
        if generated and generated[-1] in self.eos and piece and piece[0] == generated[-1]:
            return out + piece[1:]
        return out + piece


def _normal(text: str) -> str:
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


class QueryFilter:
    """Keep a sampled query if it ended on its own, has a sensible length, is mostly words, does not repeat itself
    and is neither the same as nor starts like (first `prefix_words` words) a query kept before."""

    def __init__(self, min_words: int = 3, max_tokens: int = 160, prefix_words: int = 10):
        self.min_words, self.max_tokens, self.prefix_words = min_words, max_tokens, prefix_words
        self.seen: set[str] = set()
        self.prefixes: set[str] = set()
        self.dropped: Counter = Counter()
        self.kept = 0

    def key(self, text: str) -> str:
        return _normal(text)

    def remember(self, key: str) -> None:
        self.seen.add(key)
        self.prefixes.add(" ".join(key.split()[:self.prefix_words]))

    def reason(self, text: str, n_tokens: int, ended: bool) -> str | None:
        """Why the query is dropped, or None to keep it."""
        if not ended:
            return "unfinished"
        if n_tokens > self.max_tokens:
            return "too long"
        words = text.split()
        if len(words) < self.min_words:
            return "too short"
        if "<|" in text or "|>" in text or text.lower().startswith(("assistant", "user", "system")):
            return "template text"
        letters = sum(c.isalpha() or c.isspace() for c in text)
        if letters < 0.6 * len(text):
            return "not words"
        low = [w.lower() for w in words]
        if len(low) >= 10 and len(set(low)) < 0.4 * len(low):
            return "repetitive"
        tri = Counter(zip(low, low[1:], low[2:]))
        if tri and tri.most_common(1)[0][1] > 3:
            return "repetitive"
        key = self.key(text)
        if key in self.seen:
            return "duplicate"
        if " ".join(key.split()[:self.prefix_words]) in self.prefixes:
            return "near duplicate"
        return None

    def check(self, text: str, n_tokens: int, ended: bool) -> bool:
        why = self.reason(text, n_tokens, ended)
        if why is None:
            self.remember(self.key(text))
            self.kept += 1
            return True
        self.dropped[why] += 1
        return False
