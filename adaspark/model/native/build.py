"""Build the native forward (module.cpp and its headers) once per instruction set, with torch's
extension tooling: `python -m adaspark.model.native.build` (scripts/setup.sh runs it).

One module per instruction set from the same source, each compiled for that set only (no
-march=native), so a build made here runs on any CPU that has the set; `native.load()` picks
the best module the CPU can run. Floating-point flags stay strict (no -ffast-math): a row's
arithmetic must stay one fixed sequence for the width-invariance promise.

Every set is built on every CPU, but only the builds this CPU runs are imported (an AVX-512
module's import dies of SIGILL on a CPU without AVX-512), and each build runs in a process of
its own, so a build that dies fails alone.

The exit status is what setup and CI go by (`verdict`): non-zero when a build this CPU runs
failed (the native tests would otherwise skip and pass), or when a compiler is present but
ninja is not; zero when every build this CPU runs was built, whatever became of the builds for
other CPUs. Without a C++ compiler ($CXX, else c++) nothing is built and the torch path runs:
it says so and exits 0, as it does under ADASPARK_NATIVE=off (the torch path chosen).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
from multiprocessing.connection import wait
from pathlib import Path
from types import ModuleType

from adaspark.model.native import runnable_isas
from adaspark.model.native.paths import BUILD_DIR, ISA_FLAGS, SOURCE, module_name, source_hash


def _flags(isa: str) -> dict:
    # -fopenmp compiles at::parallel_for's pragma (a header template); the loader then binds
    # libgomp.so.1 to the copy torch already loaded: one OpenMP runtime
    return {"extra_cflags": ["-O3", "-std=c++17", "-fopenmp", "-fvisibility=hidden",
                             *ISA_FLAGS[isa]],
            "extra_ldflags": ["-fopenmp"]}


def compile_module(name: str, source: Path, out: Path, isa: str) -> ModuleType:
    """module.cpp at `source` compiled for one instruction set into `out`, loaded as `name`
    (also benchmarks/native_ab.py's build of another revision's sources)."""
    from torch.utils.cpp_extension import load

    out.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(source)], build_directory=str(out), verbose=False,
                **_flags(isa))


def compile_library(name: str, source: Path, out: Path, isa: str) -> Path:
    """As compile_module (the same ninja file), but the library is only built, never loaded:
    load(is_python_module=False) would still dlopen it. The helper is torch's own (private;
    pyproject pins torch, and a changed signature fails this build by name)."""
    from torch.utils.cpp_extension import _write_ninja_file_and_build_library

    out.mkdir(parents=True, exist_ok=True)
    _write_ninja_file_and_build_library(
        name=name, sources=[str(source)], extra_cuda_cflags=[], extra_sycl_cflags=[],
        extra_include_paths=[], build_directory=str(out), verbose=False, with_cuda=False,
        with_sycl=False, **_flags(isa))
    return out / f"{name}.so"


def build_one(isa: str, runs_here: bool) -> str:
    """Build one set; import it (torch's check that it loads) only if this CPU runs it."""
    out = BUILD_DIR / isa
    out.mkdir(parents=True, exist_ok=True)
    (out / "source.sha256").unlink(missing_ok=True)  # a half-built module is never trusted
    (compile_module if runs_here else compile_library)(module_name(isa), SOURCE, out, isa)
    (out / "source.sha256").write_text(source_hash())
    return isa


def _build_child(isa: str, runs_here: bool) -> None:
    try:
        build_one(isa, runs_here)
    except Exception as err:  # noqa: BLE001 - a failed build leaves the torch path
        print(f"adaspark: native forward for {isa} failed to build: {err}", flush=True)
        raise SystemExit(1) from None


def _report(isa: str, code: int) -> None:
    if code == 0:
        print(f"adaspark: native forward built for {isa}", flush=True)
    elif code < 0:  # the child had no chance to say why
        print(f"adaspark: native forward for {isa} failed to build: its build process died of "
              f"{signal.Signals(-code).name}", flush=True)


def build_all(isas: list[str], runnable: list[str], jobs: int) -> dict[str, int]:
    """Each set's build exit code (0: built), each built in a process of its own, `jobs` at a
    time: one dead worker of a shared pool would fail every build still in the pool. Forked,
    so that the children build exactly what this process was told to build."""
    context = multiprocessing.get_context("fork")
    waiting, running, codes = list(isas), {}, {}
    while waiting or running:
        while waiting and len(running) < jobs:
            isa = waiting.pop(0)
            running[isa] = context.Process(target=_build_child, args=(isa, isa in runnable))
            running[isa].start()
        wait([process.sentinel for process in running.values()])
        for isa in [isa for isa, process in running.items() if not process.is_alive()]:
            process = running.pop(isa)
            process.join()
            codes[isa] = process.exitcode
            _report(isa, process.exitcode)
    return codes


def _summary(codes: dict[str, int], runnable: list[str]) -> str:
    usable = [isa for isa in runnable if codes.get(isa) == 0]  # best first
    foreign = [isa for isa, code in codes.items() if code == 0 and isa not in runnable]
    line = (f"adaspark: this CPU can use the native builds: {', '.join(usable)} "
            f"(best first)" if usable else
            "adaspark: no native build this CPU can run was built; the torch path runs")
    if foreign:
        line += f"; built for other CPUs, not usable here: {', '.join(foreign)}"
    return line


def verdict(codes: dict[str, int], runnable: list[str]) -> int:
    """The exit status of the builds `codes` (each set's exit code, 0: built): 1 when a set
    this CPU runs failed to build (setup and CI must fail: the engine would fall back to
    the torch path and the native tests skip), else 0."""
    return 1 if any(code != 0 for isa, code in codes.items() if isa in runnable) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", action="append", choices=sorted(ISA_FLAGS),
                        help="build only these (default: all)")
    args = parser.parse_args(argv)
    if os.environ.get("ADASPARK_NATIVE") == "off":
        print("adaspark: native forward not built (ADASPARK_NATIVE=off); the torch path runs")
        return 0
    # ninja from the venv's bin, where pip puts it
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    compiler = os.environ.get("CXX") or "c++"  # the one torch's extension tooling runs
    if not shutil.which(compiler):
        print(f"adaspark: native forward not built: no C++ compiler ({compiler} not found); "
              f"the torch path runs (slower). Install one (e.g. g++) and run this again.")
        return 0
    if not shutil.which("ninja"):
        print("adaspark: native forward not built: a C++ compiler is here but ninja is not "
              "(pip install ninja)")
        return 1
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", tempfile.gettempdir())
    isas = args.isa or sorted(ISA_FLAGS)
    runnable = runnable_isas()
    codes = build_all(isas, runnable, min(len(isas), os.cpu_count() or 1))
    print(_summary(codes, runnable))
    status = verdict(codes, runnable)
    if status:
        failed = [isa for isa in runnable if codes.get(isa, 0) != 0]
        print(f"adaspark: the native build failed for {', '.join(failed)}, which this CPU "
              f"runs: setup fails (see the errors above)")
    return status


if __name__ == "__main__":
    raise SystemExit(main())
