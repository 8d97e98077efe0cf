"""Tokenizer and chat template, from a HF directory or from GGUF metadata.

A thin wrapper over a HF fast tokenizer. GGUF tokenizers are converted once by transformers and cached under
`$XDG_CACHE_HOME/specloom/tokenizers/` (the conversion of a 262k-token vocabulary takes ~20 s).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence

from .errors import SpecloomError

# End-of-turn tokens of common chat templates: generation stops on them as on EOS.
_END_OF_TURN = ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|endoftext|>", "<|end|>")


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "specloom")


def file_cache_key(path: str) -> str:
    """A key that changes when the file does (path, size, modification time)."""
    st = os.stat(path)
    return hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        vocab = hf_tokenizer.get_vocab()
        if self.has_chat_template:
            eos.update(vocab[t] for t in _END_OF_TURN if t in vocab and t in (hf_tokenizer.chat_template or ""))
        self.eos_token_ids = frozenset(eos)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can cover: the longest vocabulary string (a byte-level token has
        a character per byte, SentencePiece's ▁ stands for one space). A prefix of L characters that already
        takes more than n + max_token_chars tokens means the whole text takes more than n."""
        return max(1, max(map(len, self.hf.get_vocab()), default=1))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, special: bool = True) -> list[int]:
        """`text` with the tokenizer's BOS (if it adds one). `special=False`: special-token strings in the text
        (e.g. "<|im_end|>") are ordinary text, not the special tokens."""
        return list(self.hf(text, add_special_tokens=True, split_special_tokens=not special)["input_ids"])

    def encode_chat(self, messages: list[dict], special_in_content: bool = False, **template_kwargs) -> list[int]:
        """The chat template applied to `messages` with the generation prompt; `template_kwargs` (e.g.
        `tools=[...]`) go to the template as they are. The template's own markers are special tokens; special-token
        strings inside the messages or the template arguments are plain text (so content cannot forge a turn),
        unless `special_in_content`."""
        if not self.has_chat_template:
            raise SpecloomError("this model has no chat template: use a raw prompt (drop --chat)")
        if not special_in_content:
            from .chat_plain import encode_chat_plain

            plain = encode_chat_plain(self.hf, messages, template_kwargs)
            if plain is not None:
                return plain
        ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **template_kwargs)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @classmethod
    def from_dir(cls, path: str, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(path), eos_token_ids)
        except (OSError, ValueError) as e:
            raise SpecloomError(f"{path}: cannot load the tokenizer ({e})") from None

    @classmethod
    def from_gguf(cls, path: str, eos_token_ids: Sequence[int] = ()) -> "Tokenizer":
        from transformers import AutoTokenizer

        cached = os.path.join(cache_dir(), "tokenizers", file_cache_key(path))
        log = logging.getLogger("specloom")
        if os.path.isdir(cached):
            try:
                return cls(AutoTokenizer.from_pretrained(cached), eos_token_ids)
            except Exception as e:  # a cache folder cut short or corrupted: converted again below
                log.warning("tokenizer cache %s is unreadable (%s): converting the GGUF tokenizer again", cached,
                            str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
                shutil.rmtree(cached, ignore_errors=True)
        log.info("converting the GGUF tokenizer (once; cached in %s)", cached)
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path))
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cached))
        try:
            hf.save_pretrained(tmp)
            os.replace(tmp, cached)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race, or the cache is read-only
        return cls(hf, eos_token_ids)
