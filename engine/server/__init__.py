"""The OpenAI-compatible HTTP server (run it with `python -m engine.serve`)."""
from engine.server.app import build_app
from engine.server.background import BackgroundServer, ServerProcess
from engine.server.config import ServerConfig

__all__ = ["build_app", "BackgroundServer", "ServerProcess", "ServerConfig"]
