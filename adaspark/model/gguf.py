"""Read a GGUF file: metadata and named tensors, still in their quantised blocks.

Parsing is the `gguf` package's (GGUFReader); this module adds the checks that turn a bad file
into one clear UserError line: missing, not GGUF, truncated, an architecture or a quantisation
type this engine cannot run.
"""

from __future__ import annotations

import mmap
import os
import sys
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, quants

from adaspark.errors import UserError
from adaspark.model.config import ARCHITECTURES
from adaspark.model.sources import check_gguf_file

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)

Q = GGMLQuantizationType
# Kept packed and multiplied by torch's int4 kernel (and, for Q8_0, held as int8 blocks).
PACKED_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q8_0})
# Dequantised once at load into dense bf16 / fp32 weights: they work, at dense speed.
DENSE_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q5_0, Q.Q5_1,
                         Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K})
SUPPORTED_TYPES = PACKED_TYPES | DENSE_TYPES
# Tensors below this size (norms, biases) are copied out of the mapping at read time: read in
# place later, each read maps the kernel's fault-around window of its neighbours (the embedded
# model's 61 norms mapped ~9 MiB of pages, ~2 MiB of them still resident at the load's peak).
SMALL_TENSOR_BYTES = 1 << 16


class _Reader(GGUFReader):
    """GGUFReader whose parts are plain ndarray views of its memmap (memmap slices carry a
    __dict__ each), and whose arrays are one part each instead of one or two per element: a
    vocabulary's tokens and merges were ~200k parts, whose peak (~80 MiB) and fragmented
    small-object arenas after (~35 MiB) outweighed the strings kept. An array field's parts are
    [element type, count, values]; `field_value` reads them (string arrays: `string_array`)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY or not self._get(orig_offs + 4, np.uint64)[0]:
            return super()._get_field_parts(orig_offs, raw_type)  # scalar, string, empty array
        raw_itype, alen = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        itype, count, start = GGUFValueType(int(raw_itype[0])), int(alen[0]), orig_offs + 12
        if itype == GGUFValueType.STRING:
            end = deque(_string_ends(self._plain, start, count, self._endian), maxlen=1).pop()
            values = self._get(start, np.uint8, end - start)
        elif itype in self.gguf_scalar_to_np:
            values = self._get(start, self.gguf_scalar_to_np[itype], count)
        else:  # an array of arrays (no model key holds one): gguf's own walk, which flattens
            return super()._get_field_parts(orig_offs, raw_type)
        return 12 + int(values.nbytes), [raw_itype, alen, values], [2], [GGUFValueType.ARRAY,
                                                                          itype]

    @property
    def _endian(self) -> str:
        """The byte order of the file's integers, as int.from_bytes names it."""
        swapped = {"little": "big", "big": "little"}[sys.byteorder]
        return sys.byteorder if self.byte_order == "I" else swapped


def _string_ends(buf, start: int, count: int, endian: str) -> Iterator[int]:
    """End offsets in `buf` (bytes-like) of `count` GGUF strings (a uint64 length, then the
    bytes) from `start`, one at a time (a 262k vocabulary's list of them would be ~10 MiB)."""
    offs, view = start, memoryview(buf)
    for _ in range(count):
        offs += 8 + int.from_bytes(view[offs:offs + 8], endian)
        yield offs


def string_array(field: ReaderField, endian: str) -> list[str]:
    """The strings of a compact string-array field (its values part: the raw bytes)."""
    values = field.data[0]
    raw, count = memoryview(field.parts[values]), int(field.parts[values - 1][0])
    out, offs = [], 0
    for end in _string_ends(raw, 0, count, endian):
        out.append(str(raw[offs + 8:end], encoding="utf-8"))
        offs = end
    return out


def field_value(field: ReaderField, endian: str) -> Any:
    """A field's value as ReaderField.contents() gives it, for _Reader's compact arrays too."""
    if field.types == [GGUFValueType.ARRAY, GGUFValueType.STRING]:
        return string_array(field, endian)
    return field.contents()


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows, cols); GGUF lists dimensions innermost first
    data: np.ndarray  # as stored: blocks of bytes for quantised types (memory-mapped, or a
    # copy below SMALL_TENSOR_BYTES)

    def dequantize(self) -> np.ndarray:
        """float32 values in `shape`, by the gguf package's own dequantiser (what HF uses)."""
        return quants.dequantize(self.data, self.qtype).astype(np.float32).reshape(self.shape)


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    mapped: np.memmap | None = None  # the file's mapping, which the tensors' data views

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def release_pages(self, names: Iterable[str] | None = None) -> None:
        """Drop the pages of the named tensors (None: the whole file) from this process's
        memory once they are copied elsewhere (packed): the mapping stays valid, and a later
        read faults them in again from the page cache."""
        mapping = getattr(self.mapped, "_mmap", None)  # numpy's mmap.mmap behind the memmap
        if mapping is None:
            return
        if names is None:
            mapping.madvise(mmap.MADV_DONTNEED)
            return
        base, size = self.mapped.ctypes.data, self.mapped.nbytes
        for name in names:
            data = self.tensors[name].data
            start, end = data.ctypes.data - base, data.ctypes.data - base + data.nbytes
            if 0 <= start and end <= size:  # within the mapping (not a reordered copy)
                start -= start % mmap.PAGESIZE  # madvise takes whole pages from a page start
                mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Metadata and tensors of a model GGUF, or a UserError naming what is wrong with it."""
    p = check_gguf_file(path)  # missing, not a file, bad magic
    try:
        reader = _Reader(p)
    except Exception as err:  # gguf raises bare ValueError/IndexError on a cut-off file
        raise UserError(f"GGUF file is truncated or corrupt: {p}") from err
    _check_complete(reader, p)
    metadata = {k: field_value(f, reader._endian) for k, f in reader.fields.items()}
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UserError(f"unsupported model architecture {arch!r} in {p.name} "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    tensors = {}
    for t in reader.tensors:
        if t.tensor_type not in SUPPORTED_TYPES:
            names = ", ".join(sorted(q.name for q in SUPPORTED_TYPES))
            raise UserError(f"unsupported quantisation type {t.tensor_type.name} of tensor "
                            f"{t.name} in {p.name} (supported: {names})")
        shape = tuple(int(d) for d in reversed(t.shape))
        data = t.data.copy() if t.data.nbytes < SMALL_TENSOR_BYTES else t.data
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type, shape, data)
    mapped = reader.data if isinstance(reader.data, np.memmap) else None
    f = GGUFFile(p, metadata, tensors, mapped)
    f.release_pages()  # the header's and the copied tensors' pages: nothing reads them again
    return f


def _check_complete(reader: GGUFReader, path: Path) -> None:
    """GGUFReader memory-maps lazily; a cut-off file must fail here, not mid-forward."""
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise UserError(f"GGUF file is truncated (tensor {t.name} runs past the end of "
                            f"the file): {path}")
