"""Servers the object-storage tests, docs and benchmark read from, all on loopback:
moto's S3 server (a subprocess), a fault-injecting TCP proxy in front of it, and a
web server that answers Range requests (the standard library's ``http.server``
does not)."""

from __future__ import annotations

import contextlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

ACCESS_KEY = "headrace-test-key"
SECRET_KEY = "headrace-test-secret-do-not-print"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server in a subprocess (its own GIL: the reader's throughput is not
    the server's); yields its endpoint URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.05)
        yield endpoint
    finally:
        process.terminate()
        process.wait(10)


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that point a client at ``endpoint``."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_REGION": "us-east-1",
        "AWS_ALLOW_HTTP": "true",
    }


@contextlib.contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """The process's AWS variables point at ``endpoint`` (and the object-store clients
    are made anew) inside the block; the variables as they were afterwards."""
    from headrace.io import objstore

    env = s3_env(endpoint)
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    objstore.reset_stores()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        objstore.reset_stores()


def make_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on moto with a plain signed-less PUT (moto accepts it)."""
    request = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    urllib.request.urlopen(request, timeout=10).close()


@dataclass
class Faults:
    """What the proxy does to the next responses (shared with the test, under a lock).

    ``reset_after``: bytes of a response body after which the connection is reset,
    for the next ``resets`` responses that carry at least that many bytes.
    ``errors_503``: answer the next that many requests with 503 SlowDown.
    ``errors_403``: answer the next that many requests with 403 AccessDenied.
    ``delay``: seconds to wait before forwarding each response.
    """

    resets: int = 0
    reset_after: int = 100_000
    errors_503: int = 0
    errors_403: int = 0
    delay: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)
    done_resets: int = 0
    done_503: int = 0
    done_403: int = 0
    requests: int = 0
    #: The Authorization header of each request (which credentials signed it).
    authorizations: list[str] = field(default_factory=list)


def _s3_error(status: str, code: str, message: str) -> bytes:
    body = f"<Error><Code>{code}</Code><Message>{message}</Message></Error>".encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


_SLOWDOWN = _s3_error("503 Slow Down", "SlowDown", "Please reduce your request rate.")
_DENIED = _s3_error("403 Forbidden", "AccessDenied", "Access Denied")


class FaultProxy:
    """A TCP proxy to ``target`` that breaks responses as :class:`Faults` says.

    One upstream connection per client connection; each request's response is
    forwarded byte for byte, so a reset lands mid-body of a real S3 answer."""

    def __init__(self, target: str, faults: Faults) -> None:
        host, port = target.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.faults = faults
        self.server = socket.socket()
        self.server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        try:
            while True:
                request = _read_message(client)
                if request is None:
                    return
                faults = self.faults
                with faults.lock:
                    faults.requests += 1
                    faults.authorizations.extend(
                        line.split(b":", 1)[1].strip().decode()
                        for line in request.split(b"\r\n\r\n", 1)[0].split(b"\r\n")
                        if line.lower().startswith(b"authorization:"))
                    fail_403 = faults.done_403 < faults.errors_403
                    fail_503 = not fail_403 and faults.done_503 < faults.errors_503
                    faults.done_403 += fail_403
                    faults.done_503 += fail_503
                if fail_403 or fail_503:
                    client.sendall(_DENIED if fail_403 else _SLOWDOWN)
                    return
                upstream.sendall(request)
                head, body_length = _read_head(upstream)
                if faults.delay:
                    time.sleep(faults.delay)
                with faults.lock:
                    reset = (faults.done_resets < faults.resets
                             and body_length > faults.reset_after)
                    if reset:
                        faults.done_resets += 1
                client.sendall(head)
                sent = 0
                limit = faults.reset_after if reset else body_length
                while sent < body_length:
                    chunk = upstream.recv(min(65536, body_length - sent))
                    if not chunk:
                        return
                    if reset and sent + len(chunk) >= limit:
                        client.sendall(chunk[: limit - sent])
                        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                          b"\x01\x00\x00\x00\x00\x00\x00\x00")
                        return  # closed with linger 0: a TCP reset mid-body
                    client.sendall(chunk)
                    sent += len(chunk)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()


def _read_head(sock: socket.socket) -> tuple[bytes, int]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)
        if not chunk:
            raise OSError("upstream closed")
        data += chunk
    length = 0
    for line in data.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return data, length


def _read_message(sock: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        rest += chunk
    return head + b"\r\n\r\n" + rest


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """``http.server``'s file handler, plus single ``Range: bytes=a-b`` requests."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def send_head(self):  # type: ignore[no-untyped-def]
        spec = self.headers.get("Range")
        path = self.translate_path(self.path)
        if not spec or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start_text, _, end_text = spec.removeprefix("bytes=").partition("-")
        start = int(start_text)
        end = min(int(end_text) if end_text else size - 1, size - 1)
        if start >= size:
            self.send_error(416)
            return None
        handle = open(path, "rb")  # noqa: SIM115 (closed by copyfile's caller)
        handle.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self._remaining = end - start + 1
        return handle

    def copyfile(self, source, outputfile):  # type: ignore[no-untyped-def]
        remaining = getattr(self, "_remaining", None)
        if remaining is None:
            return super().copyfile(source, outputfile)
        while remaining > 0:
            chunk = source.read(min(65536, remaining))
            if not chunk:
                break
            outputfile.write(chunk)
            remaining -= len(chunk)
        self._remaining = None
        return None


@contextlib.contextmanager
def range_http_server(directory: str) -> Iterator[str]:
    """A threaded web server for ``directory`` answering Range requests; yields its URL."""
    handler = lambda *args, **kwargs: _RangeHandler(*args, directory=directory, **kwargs)  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
