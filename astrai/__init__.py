"""astrai: a compact vLLM-style inference engine with a paged KV cache and a persistent prefix cache."""

from astrai.engine import EngineClosedError, InferenceEngine, ModelLoadError, RequestFailedError
from astrai.model_runner import SUPPORTED_DTYPES
from astrai.sampling import SamplingParams

__all__ = [
    "SUPPORTED_DTYPES",
    "EngineClosedError",
    "InferenceEngine",
    "ModelLoadError",
    "RequestFailedError",
    "SamplingParams",
]
