"""A real S3 endpoint on loopback for the tests, and a fault-injecting proxy in front of it.

``S3Server`` runs moto's server (real HTTP, real S3 wire protocol) in a thread of the test process.
``FaultProxy`` is a small HTTP/1.1 proxy, also a thread, that forwards requests to it and can:

* answer a fraction of requests with ``500 InternalError`` (before forwarding: nothing applied);
* reset the connection (TCP RST) instead of answering (also before forwarding);
* cut a GET response off halfway and reset (the request *was* served: a mid-body failure);
* slow everything down (a delay per request and a bandwidth cap on request bodies), so that a push
  through it can be killed mid-upload;
* log every request, so a test can check the order of writes (manifest last).

Faults are only injected before a request reaches the server, except the mid-body cut of GETs
(idempotent): a retried write then never meets a half-applied one. That mirrors what S3 clients
must survive, without testing moto's corner cases instead of ours.
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}
ERROR_500 = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
             b"<Message>injected fault</Message><RequestId>fault</RequestId></Error>")


class S3Server:
    """moto's S3 server on 127.0.0.1 (a free port); ``endpoint`` is its URL."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.endpoint = ""

    def start(self) -> S3Server:
        self._server.start()
        host, port = self._server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        self._server.stop()

    def client(self, endpoint: str | None = None) -> Any:
        """A plain boto3 client (test-side checks: list, head, tamper with objects)."""
        import boto3

        return boto3.client("s3", endpoint_url=endpoint or self.endpoint, region_name="us-east-1")


@dataclass
class Faults:
    p500: float = 0.0  # answer 500 InternalError
    preset: float = 0.0  # reset the connection without answering
    pcut: float = 0.0  # GET with a body: send half, then reset
    delay: float = 0.0  # seconds added to every request
    bandwidth: float = 0.0  # bytes/second for request bodies (0: unlimited)
    seed: int = 0
    match: str = ""  # faults only for requests whose path contains this
    stall: str = ""  # requests whose path contains this wait (unanswered) until the faults change


@dataclass
class Record:
    method: str
    path: str
    status: int | str  # HTTP status, or "reset" / "cut"
    start: float
    end: float = 0.0


@dataclass
class _State:
    faults: Faults = field(default_factory=Faults)
    log: list[Record] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    attempts: dict[str, int] = field(default_factory=dict)  # request key -> requests seen
    release: threading.Event = field(default_factory=threading.Event)  # ends stalls
    seen: threading.Condition = field(default_factory=threading.Condition)


class FaultProxy:
    """``FaultProxy(upstream_port).start()``; set ``.faults``; point clients at ``.endpoint``."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.state = _State()
        proxy = self

        class Handler(_Handler):
            owner = proxy

        self._httpd = _QuietServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def faults(self) -> Faults:
        return self.state.faults

    @faults.setter
    def faults(self, value: Faults) -> None:
        with self.state.lock:
            self.state.faults = value
            self.state.attempts.clear()
            old, self.state.release = self.state.release, threading.Event()
        old.set()  # requests stalled under the previous faults go on

    @property
    def log(self) -> list[Record]:
        with self.state.lock:
            return list(self.state.log)

    def clear(self) -> None:
        with self.state.lock:
            self.state.log.clear()

    def wait_for(self, predicate: Any, timeout: float) -> bool:
        """Block until predicate(log) is true (checked after each request starts or ends)."""
        deadline = time.monotonic() + timeout
        with self.state.seen:
            while not predicate(self.log):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.state.seen.wait(min(left, 0.1))
        return True

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def _decide(self, method: str, path: str) -> str | None:
        """Seeded per object and attempt, not per arrival: the n-th request for the same object part
        meets the same fault whatever order the client's threads send requests in."""
        obj, _, query = path.partition("?")
        params = dict(p.partition("=")[::2] for p in query.split("&") if p)
        key = f"{method} {obj} part={params.get('partNumber', '')}"
        with self.state.lock:
            f = self.state.faults
            n = self.state.attempts[key] = self.state.attempts.get(key, 0) + 1
        if f.match and f.match not in path:
            return None
        r = random.Random(f"{f.seed}:{key}:{n}").random()
        if r < f.p500:
            return "500"
        if r < f.p500 + f.preset:
            return "reset"
        if method == "GET" and r < f.p500 + f.preset + f.pcut:
            return "cut"
        return None

    def _record(self, rec: Record, new: bool = False) -> None:
        if new:
            with self.state.lock:
                self.state.log.append(rec)
        with self.state.seen:
            self.state.seen.notify_all()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gives up on a connection is normal here (we reset them on purpose)."""


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: FaultProxy

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _body(self) -> bytes:
        """The request body as sent (Content-Length, or chunked framing relayed verbatim)."""
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            raw = bytearray()
            while True:
                line = self.rfile.readline()
                raw += line
                size = int(line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while True:  # trailers, then the blank line
                        t = self.rfile.readline()
                        raw += t
                        if t in (b"\r\n", b"\n", b""):
                            return bytes(raw)
                raw += self.rfile.read(size + 2)
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _reset(self) -> None:
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True

    def _handle(self) -> None:
        owner = self.owner
        with owner.state.lock:  # the faults and the event that ends their stalls, as one pair
            f, release = owner.state.faults, owner.state.release
        rec = Record(self.command, self.path, 0, time.monotonic())
        owner._record(rec, new=True)
        body = self._body()
        if f.stall and f.stall in self.path:
            release.wait(120)
        if f.delay:
            time.sleep(f.delay)
        if f.bandwidth and body:
            time.sleep(len(body) / f.bandwidth)
        fault = owner._decide(self.command, self.path)
        if fault == "500":
            rec.status, rec.end = 500, time.monotonic()
            self.send_response(500)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(ERROR_500)))
            self.end_headers()
            self.wfile.write(ERROR_500)
            owner._record(rec)
            return
        if fault == "reset":
            rec.status, rec.end = "reset", time.monotonic()
            self._reset()
            owner._record(rec)
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        conn = http.client.HTTPConnection(*owner.upstream, timeout=60)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            status, out_headers = resp.status, resp.getheaders()
        finally:
            conn.close()
        self.send_response(status)
        keep_length = self.command == "HEAD"  # no body, but the object's length
        for k, v in out_headers:
            if k.lower() in HOP_BY_HOP or k.lower() == "transfer-encoding":
                continue
            if k.lower() == "content-length" and not keep_length:
                continue
            self.send_header(k, v)
        if not keep_length or resp.getheader("Content-Length") is None:
            self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if fault == "cut" and len(data) > 1 and self.command == "GET":
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            rec.status, rec.end = "cut", time.monotonic()
            self._reset()
            owner._record(rec)
            return
        if self.command != "HEAD":
            self.wfile.write(data)
        rec.status, rec.end = status, time.monotonic()
        owner._record(rec)

    def do_GET(self) -> None:  # noqa: N802
        self._handle()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET  # noqa: N815
