"""The OpenAI-compatible HTTP server (run it with `python -m engine.serve`)."""
from engine.server.app import build_app

__all__ = ["build_app"]
