"""An HTTP proxy on loopback in front of the moto S3 server that injects faults.

    proxy = FaultProxy(upstream="http://127.0.0.1:5000")
    proxy.rate = 0.2                      # answer 20% of requests with 503 SlowDown or drop them
    proxy.persistent = ["part-prompts-0001"]   # every PUT of a key containing this fails with 500
    ... s3fs with endpoint_url=proxy.url ...
    proxy.stop()

Only loopback addresses are used; the request count is bounded by the tests that use it.
"""

from __future__ import annotations

import http.client
import random
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOW_DOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
            b"<Message>We encountered an internal error. Please try again.</Message></Error>")


def operation(method: str, path: str) -> str:
    """The S3 operation of a request: a GET of a bucket (path-style, no key) with a query is a LIST."""
    url = urlparse(path)
    key = url.path.lstrip("/").partition("/")[2]
    return "LIST" if method == "GET" and not key and url.query else method


class FaultProxy:
    def __init__(self, upstream: str, seed: int = 0):
        up = urlparse(upstream)
        self.upstream = (up.hostname, up.port)
        self.rate = 0.0
        self.persistent: list[str] = []
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.injected = {"503": 0, "drop": 0, "persistent": 0}
        self.requests = 0
        self.operations: dict[str, int] = {}  # LIST, GET, HEAD, PUT, POST, DELETE: what each request was
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy.lock:
                    proxy.requests += 1
                    op = operation(self.command, self.path)
                    proxy.operations[op] = proxy.operations.get(op, 0) + 1
                    roll = proxy.rng.random()
                if self.command == "PUT" and any(p in self.path for p in proxy.persistent):
                    with proxy.lock:
                        proxy.injected["persistent"] += 1
                    return self._reply(500, INTERNAL)
                if roll < proxy.rate / 2:
                    with proxy.lock:
                        proxy.injected["503"] += 1
                    return self._reply(503, SLOW_DOWN)
                if roll < proxy.rate:
                    with proxy.lock:
                        proxy.injected["drop"] += 1
                    self.close_connection = True  # drop: close without answering
                    return
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "host"}
                headers["Host"] = f"{proxy.upstream[0]}:{proxy.upstream[1]}"
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    # HEAD answers carry the object's length with no body: pass it through as is.
                    if k.lower() not in ("transfer-encoding", "connection") and (
                            k.lower() != "content-length" or self.command == "HEAD"):
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            def _reply(self, status, body):
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()
