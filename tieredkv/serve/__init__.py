"""The OpenAI-compatible HTTP server (`pip install tieredkv[serve]`; `tieredkv serve`)."""

from tieredkv.serve.app import ServerSettings, create_app, serve_until_signal, start_server
from tieredkv.engine.telemetry import install_prometheus

__all__ = ["ServerSettings", "create_app", "install_prometheus", "serve_until_signal", "start_server"]
