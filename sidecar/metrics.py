"""Optional Prometheus text endpoint (``--metrics-port``), bound to 127.0.0.1 by default."""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("kalos.sidecar")


def start_metrics_server(server: Any, host: str, port: int) -> ThreadingHTTPServer:
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

    httpd = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=httpd.serve_forever, name="kalos-metrics", daemon=True).start()
    log.info("metrics: http://%s:%d/metrics", host, httpd.server_address[1])
    return httpd
