"""A GGUF file's metadata and tensor table, read in milliseconds.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array: the
default model's vocabulary and merges (about 100,000 strings) took it 7 s of every
worker's start. This reads the same file format (GGUF v2 and v3, little-endian) from
one memory map with `struct`: metadata values become Python values (string arrays are
sliced, and decoded only when asked for), and each tensor is a view of the map with
the dtype and shape `GGUFReader` gives it (block-quantized and BF16 tensors as bytes,
[rows, bytes per row]), so the dequantizers take either. The `gguf` package still
names the tensor types and their block sizes.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# GGUFValueType: code -> struct format of a scalar (8: string, 9: array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
            12: "d"}  # fmt: skip
_STRING, _ARRAY, _FLOAT32 = 8, 9, 6
_PLAIN_DTYPES = {
    GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


class GGUFFormatError(ValueError):
    """Not a GGUF file this reader understands (the message says why)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: the fastest-varying dimension first
    data: np.ndarray  # a view of the file (see the module docstring for its shape)


class GGUFFile:
    """An open GGUF file: `fields` (metadata key -> value), `tensors` (file order)."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFFormatError(f"{path} is too short to be a GGUF file")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        if bytes(buf[:4]) != _MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version & 0xFFFF == 0:
            raise GGUFFormatError(f"{path} is a big-endian GGUF; convert it first")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
        self._buf, self._pos = buf, 24
        self._raw: dict[str, tuple[int, Any]] = {}  # key -> (value type, raw value)
        for _ in range(n_kv):
            key = self._string().decode("utf-8")
            vtype = self._u32()
            self._raw[key] = (vtype, self._read(vtype))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        align = int(self.field("general.alignment", 32))
        start = -(-self._pos // align) * align
        data = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self._tensor(data, start, *info) for info in infos]
        del self._buf  # the views below keep the map alive

    # -- metadata --------------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        """A metadata value as Python (str, int, float, bool, or a list of them)."""
        found = self._raw.get(key)
        if found is None:
            return default
        vtype, raw = found
        if vtype == _ARRAY:
            item_type, items = raw
            if item_type == _STRING:
                return [b.decode("utf-8") for b in items]
            return items
        if vtype == _STRING:
            return raw.decode("utf-8")
        if vtype == _FLOAT32:
            # stored as float32: the decimal the converter wrote (1e-05, not 9.99...e-06)
            return float(str(np.float32(raw)))
        return raw

    def __contains__(self, key: str) -> bool:
        return key in self._raw

    # -- parsing ---------------------------------------------------------------------------

    def _u32(self) -> int:
        (v,) = struct.unpack_from("<I", self._buf, self._pos)
        self._pos += 4
        return int(v)

    def _u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self._buf, self._pos)
        self._pos += 8
        return int(v)

    def _string(self) -> bytes:
        n = self._u64()
        start = self._pos
        self._pos += n
        if self._pos > len(self._buf):
            raise GGUFFormatError("a string runs past the end of the file")
        return bytes(self._buf[start : self._pos])

    def _read(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            item_type, count = self._u32(), self._u64()
            if item_type == _STRING:
                return item_type, [self._string() for _ in range(count)]
            fmt = _SCALARS.get(item_type)
            if fmt is None:
                raise GGUFFormatError(f"an array of value type {item_type} is not read")
            size = struct.calcsize(fmt)
            items = np.frombuffer(self._buf, f"<{fmt}", count, self._pos).tolist()
            self._pos += size * count
            return item_type, items
        fmt = _SCALARS.get(vtype)
        if fmt is None:
            raise GGUFFormatError(f"metadata value type {vtype} is unknown")
        (v,) = struct.unpack_from("<" + fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return v

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string().decode("utf-8")
        dims = tuple(self._u64() for _ in range(self._u32()))
        return name, dims, self._u32(), self._u64()

    @staticmethod
    def _tensor(
        data: np.ndarray, start: int, name: str, dims: tuple[int, ...], code: int, offset: int
    ) -> GGUFTensor:
        try:
            kind = GGMLQuantizationType(code)
        except ValueError:
            raise GGUFFormatError(f"tensor {name} has unknown type {code}") from None
        n = int(np.prod(dims)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[kind]
        shape = tuple(reversed(dims))
        nbytes = n * type_size // block
        begin = start + offset
        if begin + nbytes > data.size:
            raise GGUFFormatError(f"tensor {name} runs past the end of the file")
        raw = data[begin : begin + nbytes]
        plain = _PLAIN_DTYPES.get(kind)
        if plain is not None:
            view = raw.view(plain).reshape(shape)
        else:  # block-quantized or BF16: bytes, [..., bytes per row]
            view = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
        return GGUFTensor(name, kind, dims, view)
