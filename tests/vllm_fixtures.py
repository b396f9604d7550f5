"""Fixtures shared by the vLLM adapter test modules (import them by name into a module)."""

from __future__ import annotations

import pytest

BF16 = "bfloat16"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """The e2e tests' tiny random Qwen2-VL, built offline once per module."""
    from mrv2_engine import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny-vl")


@pytest.fixture(scope="module")
def compat(tiny_model) -> dict:
    """What an engine built from the tiny model expects of its peers (ec_nixl.vllm.options.compat_fields)."""
    return {"model": tiny_model, "dtype": BF16, "ec_nixl": 1}


@pytest.fixture(scope="module")
def e_engine(tiny_model):
    """An encode-only E engine (vLLM scheduler + MRv2 EC path) in its own process."""
    from mrv2_engine import ProducerEngineProcess

    p = ProducerEngineProcess(tiny_model)
    yield p
    p.close()
