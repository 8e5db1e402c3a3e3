"""What /proc/cpuinfo says about this CPU: its name and instruction-set flags. One reader for
the kernel table's cache key, the native build's choice and the benchmarks' reports."""

from __future__ import annotations

from pathlib import Path


def read() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(text: str, key: str) -> str | None:
    for line in text.splitlines():
        if line.startswith(key):
            return line.split(":", 1)[1].strip()
    return None


def flags(text: str | None = None) -> set[str]:
    """The first CPU's flags (text: /proc/cpuinfo's content; None reads it)."""
    found = _field(read() if text is None else text, "flags")
    return set(found.split()) if found else set()


def name(text: str | None = None) -> str:
    return _field(read() if text is None else text, "model name") or "unknown CPU"
