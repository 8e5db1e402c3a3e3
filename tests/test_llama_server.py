"""benchmarks/llama_server.py: llama.cpp's server, built once, run like ours by the benchmarks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import llama_server  # noqa: E402
from vs_llamacpp import cmake_args  # noqa: E402

from adaspark.bench.client import ChatClient  # noqa: E402
from adaspark.cpuinfo import flags  # noqa: E402


def test_slots_share_the_context_and_threads_are_pinned():
    cmd = llama_server.command(Path("m.gguf"), 8123, parallel=4, threads=2)
    value = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("--")}
    assert value["--parallel"] == "4"
    assert int(value["--ctx-size"]) == 4 * llama_server.SLOT_CONTEXT  # -c is split by slots
    assert value["--threads"] == value["--threads-batch"] == "2"
    assert "--jinja" in cmd and "--cont-batching" in cmd


def test_the_build_uses_the_python_builds_instruction_sets():
    isa = cmake_args({"avx2", "fma", "f16c"})
    args = llama_server.configure_args(isa)
    assert args[:len(isa.split())] == isa.split()  # the same switches, in the same order
    assert "-DGGML_NATIVE=OFF" in args and "-DLLAMA_BUILD_SERVER=ON" in args


@pytest.mark.skipif(not llama_server.built(cmake_args(flags())),
                    reason="llama-server not built (benchmarks/llama_server.py --build-only)")
def test_llama_server_serves_two_streams(tmp_path, model_path):
    with llama_server.LlamaServer(model_path, tmp_path / "log", parallel=2, threads=1) as srv, \
            ChatClient(srv.url) as chat:
        assert srv.forward.startswith("llama.cpp-")
        replies = [chat.stream_chat([{"role": "user", "content": "Count from 1 to 5."}],
                                    max_tokens=12) for _ in range(2)]
    assert all(r.completion_tokens > 0 and r.text for r in replies)
    assert replies[0].text == replies[1].text  # greedy (temperature 0) both times
