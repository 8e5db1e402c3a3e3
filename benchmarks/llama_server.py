"""llama.cpp's own `llama-server`, built once from the sources vs_llamacpp.py builds, and run.

The binary comes from the same llama-cpp-python sdist (VERSION, its vendor/llama.cpp) with the
same instruction-set switches (vs_llamacpp.cmake_args: GGML_NATIVE off, each extension chosen
from /proc/cpuinfo, AMX off), statically linked, into the user cache beside llama.cpp's venv.
A stamp written last names the version and switches; a build with other switches is redone.

    .venv/bin/python benchmarks/llama_server.py --build-only     # a few minutes on 2 cores
    .venv/bin/python benchmarks/llama_server.py --print-command --parallel 4

A build without AVX-512 (`--no-avx512`, for the AVX2 side-by-side on a machine that has
AVX-512) goes into its own folder beside it, so the two builds are kept and neither is redone.

`LlamaServer` runs it like our LocalServer (adaspark/bench/servers.py): `--parallel N` slots with
continuous batching (llama-server's default), the GGUF's chat template through jinja (tools
included), the same thread count for decoding and batches, and each slot the context a
request of ours gets (-c is shared by the slots, so it is N times that).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import VERSION, cmake_args, default_venv  # noqa: E402

from adaspark.bench.servers import ServerProcess, free_port  # noqa: E402
from adaspark.cpuinfo import flags as cpu_flags  # noqa: E402

STAMP = "adaspark-build.json"
SLOT_CONTEXT = 4096  # per slot: the evaluation's first turns with tools fit


def server_dir(avx512: bool = True) -> Path:
    """The build's folder: one per choice of --no-avx512, so the AVX2 build keeps the other."""
    return default_venv().parent / ("server" if avx512 else "server-no-avx512")


def binary(avx512: bool = True) -> Path:
    return server_dir(avx512) / "llama-server"


def configure_args(isa_args: str) -> list[str]:
    """cmake switches: vs_llamacpp's instruction sets, and only the server, statically."""
    return [*isa_args.split(), "-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF"]


def built(isa_args: str, avx512: bool = True) -> bool:
    try:
        stamp = json.loads((server_dir(avx512) / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return (stamp.get("version") == VERSION and stamp.get("cmake_args") == isa_args
            and binary(avx512).exists())


def build(isa_args: str, jobs: int, avx512: bool = True) -> float:
    """Download the sdist (the registry's, no dependencies), build llama-server; seconds."""
    start = time.perf_counter()
    out = server_dir(avx512)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="llama-server-build-") as tmp:
        tmp = Path(tmp)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                        ":all:", "--disable-pip-version-check", "-q", "-d", str(tmp),
                        f"llama-cpp-python=={VERSION}"], check=True)
        sdist = next(tmp.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as tar:
            tar.extractall(tmp, filter="data")
        source = next(tmp.glob("llama_cpp_python-*/")) / "vendor" / "llama.cpp"
        build_dir = tmp / "build"
        print(f"building llama-server {VERSION}\n  {isa_args}", file=sys.stderr, flush=True)
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), "-G", "Ninja",
                        *configure_args(isa_args)], check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server",
                        "-j", str(jobs)], check=True)
        shutil.copy2(build_dir / "bin" / "llama-server", binary(avx512))
    subprocess.run([str(binary(avx512)), "--version"], check=True, capture_output=True)
    seconds = time.perf_counter() - start
    (out / STAMP).write_text(json.dumps({"version": VERSION, "cmake_args": isa_args,
                                         "build_s": round(seconds, 1)}) + "\n")
    return seconds


def ensure_built(jobs: int = 2, avx512: bool = True) -> Path:
    isa_args = cmake_args(cpu_flags(), avx512=avx512)
    if not built(isa_args, avx512):
        seconds = build(isa_args, jobs, avx512)
        print(f"llama-server built in {seconds / 60:.1f} min", file=sys.stderr)
    return binary(avx512)


def command(model: Path, port: int, parallel: int, threads: int, *,
            slot_context: int = SLOT_CONTEXT, avx512: bool = True,
            extra: list[str] = ()) -> list[str]:
    """extra: more llama-server options (a speculative decoding setup, for one)."""
    return [str(binary(avx512)), "--model", str(model), "--host", "127.0.0.1", "--port",
            str(port), "--parallel", str(parallel), "--ctx-size", str(slot_context * parallel),
            "--threads", str(threads), "--threads-batch", str(threads), "--jinja",
            "--cont-batching", "--no-webui", *extra]


class LlamaServer(ServerProcess):
    """llama-server on a free port, serving `model` with `parallel` slots."""

    def __init__(self, model: Path, log_path: Path, parallel: int, threads: int, *,
                 slot_context: int = SLOT_CONTEXT, avx512: bool = True,
                 extra: list[str] = ()):
        port = free_port()
        cmd = command(model, port, parallel, threads, slot_context=slot_context,
                      avx512=avx512, extra=extra)
        super().__init__(cmd, port, log_path)

    def __enter__(self) -> LlamaServer:
        super().__enter__()
        self.forward = f"llama.cpp-{VERSION}"
        return self


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build-only", action="store_true", help="build if needed, then exit")
    p.add_argument("--print-command", action="store_true", help="print the serve command")
    p.add_argument("--model", type=Path, help="GGUF (default: the embedded SmolLM2)")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jobs", type=int, default=2, help="build parallelism")
    p.add_argument("--no-avx512", action="store_true", help="build without AVX-512")
    args = p.parse_args(argv)
    ensure_built(args.jobs, avx512=not args.no_avx512)
    if args.print_command:
        from adaspark.model.sources import resolve_model

        print(" ".join(command(resolve_model(args.model), 8080, args.parallel, args.threads,
                               avx512=not args.no_avx512)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
