"""Why did this token miss? Every prompt token of a request with one cause, from the observation events alone.

``KeyHistory`` (``history.py``) is fed ``EngineEvent``s incrementally and keeps, bounded, what each replica's
prefix cache held and when; ``explain`` (``explainer.py``) answers with the frozen records of ``records.py``. Pure:
no engine internals, no locks, no UI. ``LiveHistory`` (``live.py``) is an engine's: fed each event as it is emitted
(never losing one) and read under its own lock; ``InferenceEngine.explain`` reads it.
"""

from astrai.explain.explainer import explain
from astrai.explain.history import KeyHistory
from astrai.explain.live import LiveHistory
from astrai.explain.records import Cause, Divergence, Explanation, PageLife, Segment, Unknown

__all__ = [
    "Cause",
    "Divergence",
    "Explanation",
    "KeyHistory",
    "LiveHistory",
    "PageLife",
    "Segment",
    "Unknown",
    "explain",
]
