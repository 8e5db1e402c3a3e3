"""Shared fixtures: the embedded default model, loaded once per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """The machine is shared: one thread per test process keeps a forward from stalling
    (modules that decode a lot opt in with pytest.mark.usefixtures("one_thread"))."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_path():
    from adaspark.model.sources import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def reference_model(model_path):
    """float32 reference precision, a short context to keep the exact attention cheap."""
    from adaspark.model.transformer import Transformer

    return Transformer.from_gguf(model_path, precision="reference", max_context=512)


@pytest.fixture(scope="session")
def fast_model(model_path):
    """Fast kernels with the documented kernel table (tests pick kernels explicitly)."""
    from adaspark.model.transformer import Transformer

    return Transformer.from_gguf(model_path, precision="fast", max_context=512, calibrate=False)


@pytest.fixture(scope="session")
def torch_model(model_path):
    """Fast precision on the torch path alone (what runs without the native build, or on CUDA):
    float32 KV cache, kernels chosen by row count."""
    from adaspark.model.transformer import Transformer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ADASPARK_NATIVE", "off")
        return Transformer.from_gguf(model_path, precision="fast", max_context=512,
                                     calibrate=False)


@pytest.fixture
def prefill_in_chunks_equals_whole(monkeypatch):
    """check(model, prompt, layers, exact): a prefill in chunks of 3 rows gives the taps and
    logits of one chunk (each chunk's first rows read the previous chunk's committed state);
    bit for bit where `exact` (the native forward), else within float32's reordering."""
    import torch

    from adaspark.model import transformer

    def check(model, prompt: list[int], layers: list[int], exact: bool = False) -> None:
        tol = 0.0 if exact else 1e-5  # the logits: ten times that
        model.reset()
        whole = model.prefill(prompt, layers, return_logits=True)
        monkeypatch.setattr(transformer, "PREFILL_CHUNK", 3)
        model.reset()
        chunked = model.prefill(prompt, layers, return_logits=True)
        for layer in layers:
            torch.testing.assert_close(chunked.hiddens[layer], whole.hiddens[layer],
                                       rtol=tol, atol=tol)
        torch.testing.assert_close(chunked.logits, whole.logits, rtol=10 * tol, atol=10 * tol)

    return check
