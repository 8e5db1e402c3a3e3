"""OpenAI-compatible HTTP server over the engine (see app.py for the routes)."""

from adaspark.server.app import create_app

__all__ = ["create_app"]
