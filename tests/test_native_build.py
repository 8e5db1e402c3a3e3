"""The native build's setup (model/native/build.py): every instruction set is built, only those
this CPU runs are imported, and a build that dies fails alone.

A tiny extension stands in for module.cpp (which takes a minute to compile): one whose import
raises SIGILL, as an AVX-512 build's import does on a CPU without AVX-512.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from adaspark.model.native import build

TINY = r"""
#include <Python.h>
#include <signal.h>
#define INIT_(name) PyInit_##name
#define INIT(name) INIT_(name)
static struct PyModuleDef tiny = {PyModuleDef_HEAD_INIT, "tiny", NULL, -1, NULL};
PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) {
#ifdef DIE_ON_IMPORT
    raise(SIGILL);
#endif
    return PyModule_Create(&tiny);
}
"""
FLAGS = {"exotic": ["-DDIE_ON_IMPORT"], "plain": []}  # "exotic" sorts first: it dies first


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """build.py on the tiny source, into tmp_path; returns its build directory."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    monkeypatch.setattr(build, "SOURCE", source)
    monkeypatch.setattr(build, "BUILD_DIR", tmp_path / "_build")
    monkeypatch.setattr(build, "ISA_FLAGS", FLAGS)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # main() prepends the venv's bin
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch_extensions"))
    return tmp_path / "_build"


def built(build_dir, isa: str) -> bool:
    """The build exists and carries its source stamp (what native.load_isa trusts)."""
    return ((build_dir / isa / f"adaspark_native_{isa}.so").is_file()
            and (build_dir / isa / "source.sha256").is_file())


def test_a_build_this_cpu_cannot_run_is_built_but_never_imported(tiny, monkeypatch, capfd):
    monkeypatch.setattr(build, "runnable_isas", lambda: ["plain"])
    assert build.main([]) == 0
    assert built(tiny, "exotic") and built(tiny, "plain")
    out = capfd.readouterr().out
    assert "native forward built for exotic" in out and "native forward built for plain" in out
    assert ("this CPU can use the native builds: plain (best first); built for other CPUs, "
            "not usable here: exotic") in out
    # the oracle: importing that build does die, so the builder must not have imported it
    so = tiny / "exotic" / "adaspark_native_exotic.so"
    load = ("import importlib.util as u, sys; s = u.spec_from_file_location("
            "'adaspark_native_exotic', sys.argv[1]); s.loader.exec_module(u.module_from_spec(s))")
    assert subprocess.run([sys.executable, "-c", load, str(so)]).returncode == -signal.SIGILL


def test_a_build_that_dies_fails_alone(tiny, monkeypatch, capfd):
    # a CPU that says it runs "exotic" and then dies of it: the builder's import crashes; the
    # other set is built all the same, and setup fails (a build this CPU runs failed)
    monkeypatch.setattr(build, "runnable_isas", lambda: ["exotic", "plain"])
    assert build.main([]) == 1
    assert built(tiny, "plain") and not built(tiny, "exotic")
    out = capfd.readouterr().out
    assert "native forward for exotic failed to build: its build process died of SIGILL" in out
    assert "this CPU can use the native builds: plain (best first)" in out
    assert "the native build failed for exotic, which this CPU runs: setup fails" in out


def test_setup_fails_when_every_build_fails(tiny, monkeypatch, capfd):
    monkeypatch.setattr(build, "runnable_isas", lambda: ["exotic"])
    assert build.main(["--isa", "exotic"]) == 1
    out = capfd.readouterr().out
    assert "no native build this CPU can run was built; the torch path runs" in out
