"""The OpenAI-compatible HTTP server (`pip install tieredkv[serve]`; `tieredkv serve`)."""

from tieredkv.serve.app import ServerSettings, create_app, install_prometheus, start_server

__all__ = ["ServerSettings", "create_app", "install_prometheus", "start_server"]
