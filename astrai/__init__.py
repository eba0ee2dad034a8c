"""astrai: a compact vLLM-style inference engine with a paged KV cache and a persistent prefix cache."""

from astrai.engine import EngineClosedError, InferenceEngine, RequestFailedError
from astrai.sampling import SamplingParams

__all__ = ["EngineClosedError", "InferenceEngine", "RequestFailedError", "SamplingParams"]
