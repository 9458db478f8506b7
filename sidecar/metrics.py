"""Optional Prometheus text endpoint (``--metrics-port``), bound to 127.0.0.1 by default."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("kalos.sidecar")


def bind_metrics_server(server: Any, host: str, port: int) -> ThreadingHTTPServer:
    """The metrics endpoint, bound but not listening yet (:func:`serve_metrics` listens and
    serves): a port in use fails here, with ``OSError``, before the sidecar loads its rows,
    and a scrape during the load is refused rather than left waiting."""
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

    httpd = ThreadingHTTPServer((host, port), Handler, bind_and_activate=False)
    try:
        httpd.server_bind()
    except BaseException:
        httpd.server_close()
        raise
    return httpd


def serve_metrics(httpd: ThreadingHTTPServer) -> None:
    """Listen on a bound metrics endpoint and serve it from a daemon thread."""
    httpd.server_activate()
    threading.Thread(target=httpd.serve_forever, name="kalos-metrics", daemon=True).start()
    log.info("metrics: http://%s:%d/metrics", *httpd.server_address[:2])
