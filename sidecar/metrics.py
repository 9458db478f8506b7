"""Optional Prometheus text endpoint (``--metrics-port``), bound to 127.0.0.1 by default."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("kalos.sidecar")


def bind_metrics_server(server: Any, host: str, port: int) -> ThreadingHTTPServer:
    """The metrics endpoint, bound but not serving yet (:func:`serve_metrics` starts it): a
    port in use fails here, with ``OSError``, before the sidecar loads anything."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/metrics", "/"):
                self.send_error(404)
                return
            try:
                body = server.stats.prometheus(server.describe()).encode()
            except RuntimeError:  # a counter changed size mid-read: ask again
                body = server.stats.prometheus(server.describe()).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)


def serve_metrics(httpd: ThreadingHTTPServer) -> None:
    """Serve a bound metrics endpoint from a daemon thread."""
    threading.Thread(target=httpd.serve_forever, name="kalos-metrics", daemon=True).start()
    log.info("metrics: http://%s:%d/metrics", *httpd.server_address[:2])
