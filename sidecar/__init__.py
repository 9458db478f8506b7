"""The Kalos sidecar process: ``kalos-sidecar serve --name NAME --dim D``.

Installed as ``kalos_retrievers.sidecar``. Client processes never import it (nor CuPy).
"""

from __future__ import annotations

from .server import ServeConfig, Server, StartError

__all__ = ["ServeConfig", "Server", "StartError"]
