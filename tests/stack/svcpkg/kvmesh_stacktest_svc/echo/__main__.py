"""A minimal service for the stack tests, run by `kvmesh up` like any kvmesh service.

It reads its settings the way services do (kvmesh.config), serves
GET /readyz (200) and GET /settings (what it was told), and exits 0 on
SIGTERM. STACKTEST_EXIT_AT_START=1 makes it fail at once (exit 3);
STACKTEST_NEVER_READY=1 makes /readyz answer 503 forever;
STACKTEST_IGNORE_SIGTERM=1 makes it ignore SIGTERM (only SIGKILL ends it).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from kvmesh.config import load_settings


def main() -> None:
    if os.environ.get("STACKTEST_EXIT_AT_START"):
        sys.exit(3)
    settings = load_settings()
    told = {
        "nats_url": settings.nats_url,
        "s3_endpoint": settings.s3_endpoint,
        "s3_access_key": settings.s3_access_key,
        "bucket": settings.s3.bucket,
        "worker_id": settings.service.worker_id,
        "http_port": settings.service.http_port,
        "model_dir": str(settings.model_dir),
        "state_dir": str(settings.state_dir),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            body = {"/readyz": b"ok", "/settings": json.dumps(told).encode()}.get(self.path)
            if self.path == "/readyz" and os.environ.get("STACKTEST_NEVER_READY"):
                self.send_response(503)
            else:
                self.send_response(200 if body is not None else 404)
            self.end_headers()
            self.wfile.write(body or b"")

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((settings.service.http_host, settings.service.http_port), Handler)
    if os.environ.get("STACKTEST_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    server.serve_forever()
    server.server_close()


main()
