"""The tensor table of a GGUF file, read without its metadata: names, ggml types, shapes and where the bytes are.

    gguf_tensors(path)            {name: GGUFTensor}, in file order
    tensor_blocks(path, tensor)   its bytes as uint8 [rows, row bytes] (a read-only memory map of the file)

Why not gguf.GGUFReader: it builds a numpy view for every metadata string, and a tokenizer's vocabulary and merges
are ~150k strings: 6 s to open SmolLM2's file, where skipping them takes a few hundredths. Format: GGUF v2/v3
(github.com/ggml-org/ggml/blob/master/docs/gguf.md), little-endian.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runner.errors import ModelError

_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # value type → bytes
_STRING, _ARRAY = 8, 9
_ALIGNMENT_KEY = "general.alignment"


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's number
    shape: tuple[int, ...]  # torch order: [rows, columns] for a matrix (the file lists the columns first)
    offset: int  # from the start of the file
    n_bytes: int

    @property
    def type_name(self) -> str:
        import gguf

        return gguf.GGMLQuantizationType(self.ggml_type).name


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.data, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        size = self.take("Q")
        self.at += size
        return self.data[self.at - size:self.at].decode("utf-8", "replace")

    def value(self, kind: int):
        """A metadata value: scalars and strings returned, arrays skipped (None)."""
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("IQ")
            if item in _SCALARS:
                self.at += _SCALARS[item] * count
            else:
                for _ in range(count):
                    self.value(item)
            return None
        size = _SCALARS[kind]
        self.at += size
        return int.from_bytes(self.data[self.at - size:self.at], "little")  # only general.alignment is read


def gguf_tensors(path: Path) -> dict[str, GGUFTensor]:
    """The file's tensors; ModelError for a file that is not GGUF v2/v3."""
    import gguf

    with path.open("rb") as handle:
        head = handle.read(24)
        if len(head) < 24 or head[:4] != b"GGUF" or struct.unpack_from("<I", head, 4)[0] not in (2, 3):
            raise ModelError(f"{path} is not a GGUF v2/v3 file")
        size = 1 << 20
        while True:  # read enough of the file's start to hold the metadata and the tensor table
            handle.seek(0)
            data = handle.read(size)
            try:
                return _parse(data, gguf.GGML_QUANT_SIZES)
            except struct.error:
                if len(data) < size:
                    raise ModelError(f"{path}: its GGUF header is cut short") from None
                size *= 4


def _parse(data: bytes, quant_sizes: dict) -> dict[str, GGUFTensor]:
    cursor = _Cursor(data)
    cursor.at = 8
    n_tensors, n_values = cursor.take("QQ")
    alignment = 32
    for _ in range(n_values):
        key = cursor.string()
        value = cursor.value(cursor.take("I"))
        if key == _ALIGNMENT_KEY:
            alignment = int(value)
    table = []
    for _ in range(n_tensors):
        name = cursor.string()
        dims = cursor.take("I")
        shape = tuple(reversed([cursor.take("Q") for _ in range(dims)]))
        ggml_type, offset = cursor.take("IQ")
        block_elems, block_bytes = quant_sizes[ggml_type]
        table.append((name, ggml_type, shape, offset, math.prod(shape) // block_elems * block_bytes))
    start = (cursor.at + alignment - 1) // alignment * alignment
    return {name: GGUFTensor(name, kind, shape, start + offset, n_bytes)
            for name, kind, shape, offset, n_bytes in table}


def tensor_blocks(path: Path, tensor: GGUFTensor) -> np.ndarray:
    """The tensor's bytes, uint8 [rows, row bytes] (a vector: [1, bytes]), mapped read-only from the file."""
    rows = math.prod(tensor.shape[:-1]) if len(tensor.shape) > 1 else 1
    return np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(rows, tensor.n_bytes // rows))
