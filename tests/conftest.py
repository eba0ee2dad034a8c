import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
sys.path.insert(0, str(Path(__file__).parents[1]))

pytest_plugins = ["tests.support.safe_tracebacks"]  # a failure is always reported, never an INTERNALERROR

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> str:
    """Every device the engine serves on: a test taking it runs on the CPU, and on CUDA where there is a GPU
    (select those cases with ``-k cuda``)."""
    return request.param


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level BPE tokenizer of tests.support.tiny_models (trained in a fraction of a second)."""
    from tests.support.tiny_models import make_tokenizer

    return make_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random Llama; module scope, because an engine switches its attention implementation."""
    from tests.support.tiny_models import make_model

    return make_model("llama", len(tokenizer))
