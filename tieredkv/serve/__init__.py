"""The OpenAI-compatible HTTP server (`pip install tieredkv[serve]`; `tieredkv serve`)."""

from tieredkv.engine.telemetry import install_prometheus
from tieredkv.serve.app import ServerSettings, create_app, serve_until_signal, start_server

__all__ = ["ServerSettings", "create_app", "install_prometheus", "serve_until_signal", "start_server"]
