"""Why did this token miss? Every prompt token of a request with one cause, from the observation events alone.

``KeyHistory`` (``history.py``) is fed ``EngineEvent``s incrementally and keeps, bounded, what each replica's
prefix cache held and when; ``explain`` (``explainer.py``) answers with the frozen records of ``records.py``. Pure:
no engine internals, no locks, no UI. ``InferenceEngine.explain`` is the engine's own use of them.
"""

from astrai.explain.explainer import explain
from astrai.explain.history import KeyHistory
from astrai.explain.records import Cause, Divergence, Explanation, PageLife, Segment, Unknown

__all__ = ["Cause", "Divergence", "Explanation", "KeyHistory", "PageLife", "Segment", "Unknown", "explain"]
