"""Bad model files give one clear UserError line each (crafted with the gguf package)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from adaspark.errors import UserError
from adaspark.model.gguf import read_gguf


def write_model(path, arch="llama", tensor_type=GGMLQuantizationType.F32):
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    if tensor_type == GGMLQuantizationType.F32:
        writer.add_tensor("token_embd.weight", np.ones((8, 32), dtype=np.float32))
    else:  # raw blocks: 8 rows of 256 values in a type this engine cannot run
        writer.add_tensor("token_embd.weight", np.zeros((8, 66), dtype=np.uint8),
                          raw_shape=(8, 66), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def error_of(path) -> str:
    with pytest.raises(UserError) as err:
        read_gguf(path)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_well_formed_file_reads(tmp_path):
    f = read_gguf(write_model(tmp_path / "ok.gguf"))
    assert f.architecture == "llama"
    assert f.tensors["token_embd.weight"].shape == (8, 32)
    assert f.tensors["token_embd.weight"].dequantize().sum() == 8 * 32


def test_missing_file(tmp_path):
    assert "not found" in error_of(tmp_path / "absent.gguf")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_bytes(b"these are not the bytes of a model\n" * 10)
    assert "not a GGUF file" in error_of(path)


@pytest.mark.parametrize("keep", [0.3, 0.9])
def test_truncated_file(tmp_path, keep):
    whole = write_model(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:int(len(whole) * keep)])
    assert "truncated" in error_of(cut)


def test_unsupported_architecture(tmp_path):
    message = error_of(write_model(tmp_path / "gpt2.gguf", arch="gpt2"))
    assert "unsupported model architecture 'gpt2'" in message


def test_unsupported_quantisation(tmp_path):
    path = write_model(tmp_path / "iq.gguf", tensor_type=GGMLQuantizationType.IQ2_XXS)
    assert "unsupported quantisation type IQ2_XXS" in error_of(path)
