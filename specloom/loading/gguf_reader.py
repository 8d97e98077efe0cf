"""A small, fast reader of GGUF files: metadata as plain Python values, tensors as memory-mapped numpy views.

The `gguf` package's `GGUFReader` builds a numpy view for every element of every metadata array; for a
262k-token vocabulary (Gemma-3) that is ~800k views and 13+ s before the first tensor is touched. This reader
walks the same layout (little-endian GGUF v2/v3: header, key/value pairs, tensor infos, aligned data) with
`struct` and `np.frombuffer`, in well under a second. Tensors look like the `gguf` reader's (`name`,
`tensor_type`, `shape` in GGUF order, `data` shaped as numpy dims -- bytes per row for quantized types --,
`n_elements`, `n_bytes`), so `gguf.quants.dequantize` takes their data unchanged.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class GGUFFormatError(ValueError):
    """The file does not follow the GGUF layout (the message says where)."""


@dataclass(frozen=True)
class GGUFReaderTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF order (innermost first), as the gguf package gives it
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """`fields`: key -> value (int, float, bool, str, or a list / numpy array for arrays); `tensors`: in file
    order."""

    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = path
        self.data = np.memmap(path, mode="r")
        self._buf = memoryview(self.data)
        self._pos = 0
        if bytes(self._take(4)) != MAGIC:
            raise GGUFFormatError("GGUF magic invalid (not a GGUF file)")
        (version,) = self._unpack("<I")
        if version not in (2, 3):
            hint = " (a big-endian file?)" if version & 0xFFFF == 0 else ""
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 or 3){hint}")
        self.version = version
        n_tensors, n_kv = self._unpack("<QQ")
        self.fields: dict[str, object] = {}
        for _ in range(n_kv):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.fields[key] = self._value(vtype, key)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            if n_dims > 8:
                raise GGUFFormatError(f"tensor {name!r}: {n_dims} dimensions")
            dims = self._unpack(f"<{n_dims}Q")
            ttype, offset = self._unpack("<IQ")
            infos.append((name, dims, ttype, offset))
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"invalid general.alignment {align!r}")
        start = -(-self._pos // align) * align
        self.tensors: list[GGUFReaderTensor] = []
        seen = set()
        for name, dims, ttype, offset in infos:
            if name in seen:
                raise GGUFFormatError(f"duplicated tensor {name!r}")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(ttype)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise GGUFFormatError(f"tensor {name!r}: unknown GGML type {ttype}") from None
            n_elems = int(np.prod(dims, dtype=np.int64)) if dims else 1
            n_bytes = n_elems * type_size // block
            at = start + offset
            if at + n_bytes > len(self.data):
                raise GGUFFormatError(f"tensor {name!r} runs past the end of the file (truncated?)")
            np_dims = tuple(int(d) for d in reversed(dims))
            plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                     "I32": np.int32, "I64": np.int64}.get(qtype.name)
            if plain is not None:
                arr = self.data[at:at + n_bytes].view(plain).reshape(np_dims)
            else:
                if np_dims and np_dims[-1] % block:
                    raise GGUFFormatError(f"tensor {name!r}: rows of {np_dims[-1]} are not whole {block}-blocks")
                byte_dims = (*np_dims[:-1], np_dims[-1] // block * type_size) if np_dims else (n_bytes,)
                arr = self.data[at:at + n_bytes].reshape(byte_dims)
            self.tensors.append(GGUFReaderTensor(name, qtype, np.array(dims, dtype=np.uint64), n_elems, n_bytes,
                                                 at, arr))

    def release_pages(self) -> None:
        """madvise(MADV_DONTNEED) over the mapping: its pages leave the resident set (read again on access)."""
        import mmap

        m = getattr(self.data, "_mmap", None)
        if m is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                m.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):
                pass

    # -- the layout --------------------------------------------------------------------------------------------

    def _take(self, n: int) -> memoryview:
        if self._pos + n > len(self._buf):
            raise GGUFFormatError(f"unexpected end of file at byte {self._pos} (truncated header?)")
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        return struct.unpack(fmt, self._take(size))

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return bytes(self._take(n)).decode("utf-8", errors="replace")

    def _value(self, vtype: int, key: str):
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<IQ")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype]).newbyteorder("<")
                return np.frombuffer(self._take(count * dt.itemsize), dtype=dt)
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype == _ARRAY:
                return [self._value(_ARRAY, key) for _ in range(count)]
            raise GGUFFormatError(f"metadata {key!r}: unknown array element type {etype}")
        raise GGUFFormatError(f"metadata {key!r}: unknown value type {vtype}")
