"""Read a GGUF file: metadata and named tensors, still in their quantised blocks.

Parsing is the `gguf` package's (GGUFReader); this module adds the checks that turn a bad file
into one clear UserError line: missing, not GGUF, truncated, an architecture or a quantisation
type this engine cannot run.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants

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


class _Reader(GGUFReader):
    """GGUFReader whose parts are plain ndarray views of its memmap: memmap slices carry a
    __dict__ each, and a vocabulary's metadata is ~100k parts (a peak of ~140 MiB, and
    fragmented small-object arenas after)."""

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # torch order (rows, cols); GGUF lists dimensions innermost first
    data: np.ndarray  # as stored: blocks of bytes for quantised types (memory-mapped)

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
    metadata = {k: f.contents() for k, f in reader.fields.items()}
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
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type, shape, t.data)
    mapped = reader.data if isinstance(reader.data, np.memmap) else None
    return GGUFFile(p, metadata, tensors, mapped)


def _check_complete(reader: GGUFReader, path: Path) -> None:
    """GGUFReader memory-maps lazily; a cut-off file must fail here, not mid-forward."""
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise UserError(f"GGUF file is truncated (tensor {t.name} runs past the end of "
                            f"the file): {path}")
