"""astrai: a compact vLLM-style inference engine with a paged KV cache and a persistent prefix cache."""

from astrai.checkpoints import ModelLoadError, load_checkpoint
from astrai.engine import EngineClosedError, InferenceEngine, RequestFailedError, Tenant, TenantReserveFull
from astrai.model_runner import SUPPORTED_DTYPES
from astrai.sampling import SamplingParams

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
