"""Build the native forward (module.cpp and its headers) once per instruction set, with torch's
extension tooling: `python -m adaspark.model.native.build` (scripts/setup.sh runs it).

One module per instruction set from the same source, each compiled for that set only (no
-march=native), so a build made here runs on any CPU that has the set; `native.load()` picks
the best module the CPU can run. Floating-point flags stay strict (no -ffast-math): a row's
arithmetic must stay one fixed sequence for the width-invariance promise.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import ModuleType

from adaspark.model.native.paths import BUILD_DIR, ISA_FLAGS, SOURCE, module_name, source_hash


def compile_module(name: str, source: Path, out: Path, isa: str) -> ModuleType:
    """module.cpp at `source` compiled for one instruction set into `out`, loaded as `name`
    (also benchmarks/native_ab.py's build of another revision's sources)."""
    from torch.utils.cpp_extension import load

    out.mkdir(parents=True, exist_ok=True)
    return load(name=name, sources=[str(source)], build_directory=str(out),
                # -fopenmp compiles at::parallel_for's pragma (a header template); the loader
                # then binds libgomp.so.1 to the copy torch already loaded: one OpenMP runtime
                extra_cflags=["-O3", "-std=c++17", "-fopenmp", *ISA_FLAGS[isa]],
                extra_ldflags=["-fopenmp"], verbose=False)


def build_one(isa: str) -> str:
    out = BUILD_DIR / isa
    out.mkdir(parents=True, exist_ok=True)
    (out / "source.sha256").unlink(missing_ok=True)  # a half-built module is never trusted
    compile_module(module_name(isa), SOURCE, out, isa)
    (out / "source.sha256").write_text(source_hash())
    return isa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", action="append", choices=sorted(ISA_FLAGS),
                        help="build only these (default: all)")
    args = parser.parse_args(argv)
    # ninja from the venv's bin, where pip puts it
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    missing = next((tool for tool in ("c++", "ninja") if not shutil.which(tool)), None)
    if missing:
        print(f"adaspark: native forward not built ({missing} not found); the torch path runs")
        return 0
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", tempfile.gettempdir())
    isas = args.isa or sorted(ISA_FLAGS)
    failed = []
    with ProcessPoolExecutor(max_workers=min(len(isas), os.cpu_count() or 1)) as pool:
        for isa, future in [(isa, pool.submit(build_one, isa)) for isa in isas]:
            try:
                future.result()
                print(f"adaspark: native forward built for {isa}")
            except Exception as err:  # noqa: BLE001 - a failed build leaves the torch path
                failed.append(isa)
                print(f"adaspark: native forward for {isa} failed to build: {err}")
    return 1 if failed and len(failed) == len(isas) else 0


if __name__ == "__main__":
    raise SystemExit(main())
