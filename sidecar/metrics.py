"""Optional Prometheus text endpoint (``--metrics-port``), bound to 127.0.0.1 by default."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("kalos.sidecar")


def start_metrics_server(server: Any, host: str, port: int) -> ThreadingHTTPServer:
    """Listen on ``host:port`` and serve the metrics from a daemon thread: a port in use fails
    here, with ``OSError``. Until ``server.ready`` is true (the rows still loading), a scrape
    gets 503 at once rather than a wait or a refused connection."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path not in ("/metrics", "/"):
                self.send_error(404)
                return
            if not server.ready:
                self.send_error(503, "the sidecar is starting")
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

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="kalos-metrics", daemon=True).start()
    log.info("metrics: http://%s:%d/metrics", *httpd.server_address[:2])
    return httpd
