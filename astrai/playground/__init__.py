"""The Gradio playground: build it with ``create_app()``; ``app.py`` launches it."""

from astrai.playground.service import EngineService
from astrai.playground.ui import build_demo


def create_app(service: EngineService | None = None):
    """Start the shared engine (the embedded model by default) and build the Blocks around it."""
    return build_demo((service or EngineService()).start())


__all__ = ["EngineService", "build_demo", "create_app"]
