"""astrai: a compact vLLM-style inference engine with a paged KV cache and a persistent prefix cache.

The public names below are imported on first use (PEP 562), not with the package: ``astrai.lab`` replays traces
without a model, and importing the engine's names would load torch and transformers (seconds) for nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astrai.checkpoints import ModelLoadError, load_checkpoint
    from astrai.engine import EngineClosedError, InferenceEngine, RequestFailedError, Tenant, TenantReserveFull
    from astrai.model_runner import SUPPORTED_DTYPES
    from astrai.sampling import SamplingParams

_HOMES = {  # public name -> the module that defines it
    "ModelLoadError": "astrai.checkpoints",
    "load_checkpoint": "astrai.checkpoints",
    "EngineClosedError": "astrai.engine",
    "InferenceEngine": "astrai.engine",
    "RequestFailedError": "astrai.engine",
    "Tenant": "astrai.engine",
    "TenantReserveFull": "astrai.engine",
    "SUPPORTED_DTYPES": "astrai.model_runner",
    "SamplingParams": "astrai.sampling",
}

__all__ = [
    "SUPPORTED_DTYPES",
    "EngineClosedError",
    "InferenceEngine",
    "ModelLoadError",
    "load_checkpoint",
    "RequestFailedError",
    "SamplingParams",
    "Tenant",
    "TenantReserveFull",
]


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module 'astrai' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once: later lookups find it without this hook
    return value
