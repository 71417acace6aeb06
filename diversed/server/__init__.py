"""The OpenAI-compatible server (`diversed serve`)."""

from diversed.server.app import ServerConfig, create_app, serve

__all__ = ["ServerConfig", "create_app", "serve"]
