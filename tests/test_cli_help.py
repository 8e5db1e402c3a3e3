"""Help and errors name what the engine runs, read from the tables the code itself uses
(config.ARCHITECTURES, gguf.SUPPORTED_TYPES, Arm.BASES / Arm.MODIFIERS), so they cannot drift."""

from __future__ import annotations

import re

import pytest
from gguf import GGUFWriter

from adaspark import cli
from adaspark.bench.servers import plan_arms
from adaspark.errors import UserError
from adaspark.model.config import ARCHITECTURES, ModelConfig
from adaspark.model.gguf import SUPPORTED_TYPES
from adaspark.scheduler.arm import Arm
from adaspark.speculative import DEFAULT_ARM, NO_DRAFTER_ARM

MODEL_COMMANDS = ("generate", "chat", "serve")


def help_of(capsys, monkeypatch, *argv: str) -> str:
    monkeypatch.setenv("COLUMNS", "100000")  # one line an option: no word broken at a hyphen
    assert cli.main([*argv, "--help"]) == 0
    return capsys.readouterr().out


def option_help(text: str, option: str) -> str:
    """The help line of one option (COLUMNS keeps each on one line)."""
    lines = [line for line in text.splitlines() if line.strip().startswith(option + " ")]
    assert len(lines) == 1, (option, text)
    return lines[0]


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_model_help_names_every_architecture_and_type_the_loader_takes(capsys, monkeypatch,
                                                                      command):
    line = option_help(help_of(capsys, monkeypatch, command), "--model")
    words = set(re.findall(r"[A-Za-z0-9_]+", line))
    assert set(ARCHITECTURES) <= words  # gemma3 among them
    assert "gemma3" in words
    assert {t.name for t in SUPPORTED_TYPES} <= words


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_arm_help_names_every_base_and_modifier(capsys, monkeypatch, command):
    line = option_help(help_of(capsys, monkeypatch, command), "--arm")
    for name in (*Arm.BASES, *Arm.MODIFIERS):
        assert re.search(rf"(?<![\w:-]){re.escape(name)}(?![\w:-])", line), name
    assert f"default: {DEFAULT_ARM} when a drafter exists" in line
    assert f"else {NO_DRAFTER_ARM}" in line


def test_bench_help_names_every_base(capsys, monkeypatch):
    line = option_help(help_of(capsys, monkeypatch, "bench"), "--arms")
    for name in (*Arm.BASES, *Arm.MODIFIERS):
        assert re.search(rf"(?<![\w:-]){re.escape(name)}(?![\w:-])", line), name


def test_the_notes_on_arms_name_only_arms_that_exist():
    from adaspark.options import ARM_NOTES, MODIFIER_NOTES

    assert set(ARM_NOTES) <= set(Arm.BASES)
    assert set(MODIFIER_NOTES) <= set(Arm.MODIFIERS)


def test_bench_takes_every_arm_the_engine_parses():
    for base in Arm.BASES:
        name = base.replace(":N", ":4")
        runs = plan_arms([name, f"{name}+{Arm.NGRAM_MODIFIERS[0]}"], {}, repeat_adaspark=False)
        assert [r.arm for r in runs] == [name, f"{name},{Arm.NGRAM_MODIFIERS[0]}"]
    with pytest.raises(UserError, match="unknown arm 'fast'.*arms: ar, chain3"):
        plan_arms(["fast"], {})


def write_model(path, arch: str):
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def supported_named(message: str) -> list[str]:
    match = re.search(r"\(supported: ([^)]*)\)", message)
    assert match, message
    return match.group(1).split(", ")


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path, capsys):
    path = write_model(tmp_path / "mamba.gguf", "mamba")
    assert cli.main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "unsupported model architecture 'mamba'" in err
    assert supported_named(err) == list(ARCHITECTURES)


def test_the_config_reader_names_the_supported_architectures_too():
    with pytest.raises(UserError) as err:
        ModelConfig.from_metadata({"general.architecture": "mamba"})
    assert supported_named(str(err.value)) == list(ARCHITECTURES)
