"""The Gradio playground: ``create_app()`` builds it; ``app.py`` launches it.

Nothing here is imported with ``astrai``: Gradio, Plotly and the backends load when ``create_app`` is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import gradio as gr

    from astrai.playground.backends.protocol import Backend


def create_app(backend: Backend | None = None) -> gr.Blocks:
    """Build the Blocks around ``backend`` (by default a shared in-process engine on the embedded model)."""
    from astrai.playground.backends.local import LocalBackend
    from astrai.playground.service import PlaygroundService
    from astrai.playground.ui import build_demo

    return build_demo(PlaygroundService(backend or LocalBackend()))


__all__ = ["create_app"]
