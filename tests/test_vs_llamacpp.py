"""benchmarks/vs_llamacpp.py: the parts that need neither llama.cpp nor the model."""

import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "vs_llamacpp", Path(__file__).resolve().parents[1] / "benchmarks" / "vs_llamacpp.py")
vs = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(vs)

# This VM's flags (sapphire rapids): AVX-512 with VNNI/BF16/VBMI, AVX-VNNI and AMX.
SPR = set("fpu sse4_2 avx avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512dq avx512cd "
          "avx512_vnni avx512_bf16 avx512vbmi avx_vnni amx_tile amx_int8 amx_bf16".split())


def switches(args: str) -> dict[str, str]:
    return dict(a.removeprefix("-D").split("=") for a in args.split())


def test_cpuinfo_parsing():
    text = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 fma\n"
    assert vs.cpu_flags(text) == {"fpu", "avx2", "fma"}
    assert vs.cpu_name(text) == "Intel(R) Xeon(R) Processor"
    assert vs.cpu_flags("") == set() and vs.cpu_name("") == "unknown CPU"


def test_cmake_args_follow_the_flags_and_keep_amx_off():
    s = switches(vs.cmake_args(SPR))
    assert vs.cmake_args(SPR).startswith("-DGGML_NATIVE=OFF")  # else the switches are ignored
    for on in ("GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_AVX512", "GGML_AVX512_VNNI",
               "GGML_AVX512_BF16", "GGML_AVX512_VBMI", "GGML_AVX_VNNI"):
        assert s[on] == "ON", on
    assert s["GGML_AMX_TILE"] == s["GGML_AMX_INT8"] == s["GGML_AMX_BF16"] == "OFF"


def test_cmake_args_on_an_avx2_machine():
    s = switches(vs.cmake_args({"avx", "avx2", "fma", "f16c"}))
    assert s["GGML_AVX2"] == s["GGML_FMA"] == s["GGML_F16C"] == "ON"
    assert all(s[k] == "OFF" for k in s if k.startswith("GGML_AVX512") or k == "GGML_AVX_VNNI")


def test_avx512_extensions_need_the_base_set_and_can_be_dropped():
    # VNNI listed without AVX512BW/VL: no AVX-512 switch at all
    s = switches(vs.cmake_args({"avx2", "avx512f", "avx512_vnni"}))
    assert s["GGML_AVX512"] == s["GGML_AVX512_VNNI"] == "OFF"
    s = switches(vs.cmake_args(SPR, avx512=False))  # the SIGILL fallback
    assert all(v == "OFF" for k, v in s.items() if k.startswith("GGML_AVX512"))
    assert s["GGML_AVX2"] == s["GGML_AVX_VNNI"] == "ON"


def test_stamp_matches_only_a_finished_build_with_the_same_args(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    args = vs.cmake_args(SPR)
    assert not vs.stamp_matches(venv, "0.3.36", args)  # no stamp: unfinished build
    vs.write_stamp(venv, "0.3.36", args, 12.3)
    assert not vs.stamp_matches(venv, "0.3.36", args)  # no interpreter
    (venv / "bin" / "python").touch()
    assert vs.stamp_matches(venv, "0.3.36", args)
    assert not vs.stamp_matches(venv, "0.3.35", args)
    assert not vs.stamp_matches(venv, "0.3.36", vs.cmake_args(SPR, avx512=False))
    assert json.loads((venv / vs.STAMP).read_text())["build_s"] == 12.3
    (venv / vs.STAMP).write_text("not json")
    assert not vs.stamp_matches(venv, "0.3.36", args)


def test_build_refuses_to_remove_a_directory_that_is_not_a_venv(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(SystemExit):
        vs.build(tmp_path, "0.3.36", "-DGGML_NATIVE=OFF", 2)
    assert (tmp_path / "keep.txt").exists()


def test_summary_medians_and_ratios():
    pairs = [
        {"round": 0, "prompt": 0, "llamacpp_tok_s": 100.0, "ar_tok_s": 50.0},
        {"round": 0, "prompt": 1, "llamacpp_tok_s": 80.0, "ar_tok_s": 60.0},
        {"round": 1, "prompt": 0, "llamacpp_tok_s": 90.0, "ar_tok_s": 45.0},
        {"round": 1, "prompt": 1, "llamacpp_tok_s": 0.0, "ar_tok_s": 40.0},
    ]
    s = vs.summarize(pairs)
    assert s["median_llamacpp_tok_s"] == 85.0 and s["median_ar_tok_s"] == 47.5
    assert s["ratio_of_medians"] == pytest.approx(47.5 / 85.0)
    assert s["pair_ratios"] == [0.5, 0.75, 0.5, None]  # ar / llama.cpp; no speed: no ratio
    assert s["round_ratios"] == [pytest.approx(55 / 90), pytest.approx(42.5 / 45)]
    assert vs.summarize([]) == {}


def test_decode_speed():
    assert vs.tok_s(31, 0.5) == 62.0 and vs.tok_s(0, 0.0) == 0.0


def test_prompts_fall_back_to_fixed_ones(tmp_path):
    prompts = vs.load_prompts(tmp_path / "missing.jsonl", 2, 6000)
    assert [m[0]["role"] for m in prompts] == ["user", "user"]


def test_prompts_from_conversations_skip_tools_repeats_and_long_turns(tmp_path):
    lines = [
        {"source": "a", "id": 1, "turns": ["first a", "second"]},
        {"source": "a", "id": 2, "turns": ["another a"]},
        {"source": "t", "id": 1, "turns": ["tool turn"], "tools": [{"name": "f"}]},
        {"source": "l", "id": 1, "turns": ["x" * 100]},
        {"source": "b", "id": 1, "turns": ["first b"], "system": "be brief"},
    ]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    prompts = vs.load_prompts(path, 4, 50)
    assert prompts == [[{"role": "user", "content": "first a"}],
                       [{"role": "system", "content": "be brief"},
                        {"role": "user", "content": "first b"}]]
