"""The OpenAI-compatible HTTP server (run it with `livemoe serve`)."""
from livemoe.engine.server.app import build_app
from livemoe.engine.server.background import BackgroundServer, ServerProcess
from livemoe.engine.server.config import ServerConfig

__all__ = ["build_app", "BackgroundServer", "ServerProcess", "ServerConfig"]
