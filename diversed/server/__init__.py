"""The OpenAI-compatible server (`diversed serve`)."""

from diversed.server.app import ServerConfig, check_address, create_app, serve

__all__ = ["ServerConfig", "check_address", "create_app", "serve"]
