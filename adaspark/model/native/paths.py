"""Where the native forward's source and builds live, and how each build is compiled."""

from __future__ import annotations

import hashlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "module.cpp"  # one translation unit: it includes the headers beside it
BUILD_DIR = HERE / "_build"
ISA_FLAGS = {
    # AMX intrinsics compile into the avx512 build; kernels.h runs them only where cpuid and the
    # OS allow (nothing else in the build may use them, so the build still runs without AMX)
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mfma", "-mf16c",
               "-mamx-tile", "-mamx-int8"],
    # AVX-VNNI: the avx2 build's code with 256-bit vpdpbusd (Intel client cores from Alder Lake)
    "avxvnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
}
PREFERENCE = ("avx512", "avxvnni", "avx2")  # best first


def module_name(isa: str) -> str:
    return f"adaspark_native_{isa}"


def sources() -> list[Path]:
    return [SOURCE, *sorted(HERE.glob("*.h"))]


def source_hash() -> str:
    """Of every source file, so that a build older than any of them is refused."""
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
