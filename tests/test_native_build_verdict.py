"""When the native build fails setup and CI (model/native/build.py): a failed build of a set this
CPU runs exits non-zero (before: 0 as long as any set, even one this CPU cannot run, was built,
and the native tests then skipped); a failed build for another CPU does not; without a compiler
the torch path is chosen, said, and the exit is 0. The builds here are the tiny stand-in
extension of test_native_build.py, into temporary directories (the shared build is untouched)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from test_native_build import TINY

from adaspark.model.native import build
from adaspark.model.native.paths import BUILD_DIR


def test_the_verdict_fails_exactly_when_a_build_this_cpu_runs_failed():
    assert build.verdict({"avx2": 0, "avx512": 0}, ["avx2"]) == 0
    assert build.verdict({"avx2": 0, "avx512": 1}, ["avx2"]) == 0  # another CPU's build
    assert build.verdict({"avx2": 1, "avx512": 0}, ["avx2"]) == 1  # before: 0 (one was built)
    assert build.verdict({"avx2": 0, "avx512": -4}, ["avx512", "avx2"]) == 1  # died of SIGILL
    assert build.verdict({"avx2": 1}, []) == 0  # a CPU that runs none: nothing it could use


BUILDER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from adaspark.model.native import build
    out = Path(sys.argv[1])
    source = out / "tiny.cpp"
    source.write_text(sys.argv[2])
    build.SOURCE, build.BUILD_DIR = source, out / "_build"
    # "exotic": another CPU's set; "plain": this CPU's (sys.argv[3]: its extra flags)
    build.ISA_FLAGS = {"exotic": [], "plain": sys.argv[3].split()}
    build.runnable_isas = lambda: ["plain"]
    raise SystemExit(build.main([]))
""")


def run_builder(tmp_path, flags: str = "", **env) -> subprocess.CompletedProcess:
    stamps = {p: p.stat().st_mtime_ns for p in BUILD_DIR.glob("*/source.sha256")}
    done = subprocess.run(
        [sys.executable, "-c", BUILDER, str(tmp_path), TINY, flags], capture_output=True,
        text=True,
        timeout=600, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), **env})
    assert {p: p.stat().st_mtime_ns for p in BUILD_DIR.glob("*/source.sha256")} == stamps
    return done


def test_a_broken_compiler_fails_the_build_of_this_cpus_set(tmp_path):
    done = run_builder(tmp_path, CXX="/bin/false")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "native forward for plain failed to build" in done.stdout
    assert "which this CPU runs: setup fails" in done.stdout


def test_this_cpus_set_failing_fails_though_another_cpus_was_built(tmp_path):
    """Before: exit 0, as one set (of no use here) was built; the native tests then skipped."""
    done = run_builder(tmp_path, flags="-fno-such-compiler-flag")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "native forward built for exotic" in done.stdout
    assert "the native build failed for plain, which this CPU runs" in done.stdout


def test_a_working_compiler_builds_and_passes(tmp_path):
    done = run_builder(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "native forward built for plain" in done.stdout


def test_no_compiler_chooses_the_torch_path_and_says_why(tmp_path):
    done = run_builder(tmp_path, CXX=str(tmp_path / "no-such-c++"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no C++ compiler" in done.stdout and "the torch path runs" in done.stdout
    assert not (tmp_path / "_build").exists()


def test_the_torch_path_chosen_builds_nothing(tmp_path):
    done = run_builder(tmp_path, ADASPARK_NATIVE="off")
    assert done.returncode == 0 and "ADASPARK_NATIVE=off" in done.stdout
    assert not (tmp_path / "_build").exists()
