"""The Gradio playground: ``create_app()`` builds it; ``app.py`` launches it.

Layout: ``backends/`` (the protocols, in-process engines by profile, vLLM), ``state.py`` (per-visitor state),
``views/`` (pure functions from observations to what the page shows), ``ui/`` (typed components and the layout),
``callbacks/`` (run, live view, replay, setup: each wires its own events).

Nothing here is imported with ``astrai``: Gradio, Plotly and the backends load when ``create_app`` is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import gradio as gr

    from astrai.playground.backends.protocol import Engines


def create_app(engines: Engines | None = None, allow_hub_models: bool = False) -> gr.Blocks:
    """Build the Blocks around ``engines`` (by default in-process engines on the embedded model, one per profile,
    the lesson's built in the background at start)."""
    from astrai.playground.backends.engines import LocalEngines
    from astrai.playground.backends.profiles import hub_models_allowed
    from astrai.playground.scenarios import LESSON_PROFILES
    from astrai.playground.ui.app import build_demo

    if engines is None:
        engines = LocalEngines(preload=LESSON_PROFILES, allow_hub=hub_models_allowed(allow_hub_models))
    return build_demo(engines)


__all__ = ["create_app"]
