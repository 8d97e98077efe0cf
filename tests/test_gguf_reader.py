"""specloom's own GGUF reader against the `gguf` package's on a file written by `gguf.GGUFWriter`: the same
metadata values and the same tensor views; truncated and foreign files get one clear message."""

from __future__ import annotations

import numpy as np
import pytest

from specloom.errors import SpecloomError
from specloom.loading.gguf_file import _reader_cached
from specloom.loading.gguf_reader import GGUFFile, GGUFFormatError


def _write(path: str) -> None:
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_string("test.name", "tiny")
    w.add_float32("test.eps", 1e-5)
    w.add_bool("test.flag", True)
    w.add_int64("test.big", -(2 ** 40))
    w.add_array("test.words", ["a", "bc", "", "dé"])
    w.add_array("test.scores", [0.5, -1.0, 2.25])
    w.add_array("test.ids", [1, 2, 3])
    rng = np.random.default_rng(0)
    w.add_tensor("a.weight", rng.standard_normal((3, 32), dtype=np.float32))
    w.add_tensor("b.weight", rng.standard_normal((4, 64)).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((2, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("c.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_same_fields_and_tensors_as_the_gguf_package(tmp_path):
    from gguf import GGUFReader

    path = str(tmp_path / "t.gguf")
    _write(path)
    ours, ref = GGUFFile(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        mine = ours.fields[key]
        mine = mine.tolist() if isinstance(mine, np.ndarray) else mine
        want = field.contents()
        assert mine == pytest.approx(want) if isinstance(want, (float, list)) and key != "test.words" else mine == want, key
    assert ours.fields["test.words"] == ["a", "bc", "", "dé"]
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors] == ["a.weight", "b.weight", "c.weight"]
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and a.n_bytes == b.n_bytes, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name


def test_truncated_and_foreign_files_are_refused_clearly(tmp_path):
    path = tmp_path / "t.gguf"
    _write(str(path))
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(GGUFFormatError, match="'c.weight' runs past the end of the file"):
        GGUFFile(str(tmp_path / "cut.gguf"))
    (tmp_path / "head.gguf").write_bytes(data[:40])
    with pytest.raises(SpecloomError, match="head.gguf: not a readable GGUF file .*unexpected end of file"):
        _reader_cached(str(tmp_path / "head.gguf"), 40, 0)
    (tmp_path / "text.gguf").write_bytes(b"hello world, not a model" * 4)
    with pytest.raises(SpecloomError, match="GGUF magic invalid"):
        _reader_cached(str(tmp_path / "text.gguf"), 96, 0)
