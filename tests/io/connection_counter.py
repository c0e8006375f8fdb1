"""An HTTP proxy that counts the connections a client holds to a server, exactly.

Why a proxy and not sampling: a connection the client opens and closes between two
samples is never seen, and one the client's pool keeps idle looks the same as one in
use. The proxy sees every connect and every close, the requests each connection
carries, and the requests the server is answering at once.

The proxy keeps a client's connection alive across requests, as S3 does, even when
the server behind it does not (moto answers ``Connection: close``): each request is
forwarded on a connection of its own to the server, and the answer goes back on the
client's connection without that header.

Exact on loopback: a client's ``close()`` queues its FIN at the proxy's socket before
the call returns, so when a new connection is accepted, the proxy first looks (without
waiting) at every connection it counts as live; one whose client has closed already
ended before the new one began, and is not counted with it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Connection:
    """One client connection: when it opened and closed (monotonic seconds), and the
    request line and Range header of each request it carried."""

    number: int
    opened: float
    closed: float | None = None
    requests: list[str] = field(default_factory=list)


class ConnectionCounter:
    """Forwards ``127.0.0.1:<port>`` (:attr:`endpoint`) to ``target``
    (``http://host:port``); :attr:`peak` is the most client connections open at
    once, :attr:`connections` each one's history."""

    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").split(":")
        self._target = (host, int(port))
        self._lock = threading.Lock()
        self._live: dict[int, tuple[socket.socket, Connection]] = {}
        self.connections: list[Connection] = []
        self.peak = 0
        #: The connections live when :attr:`peak` was reached (their histories so far).
        self.at_peak: list[Connection] = []
        self._answering = 0
        #: The most requests the server was answering at once: each counted from the
        #: arrival of its head to the moment its answer is ready to send, a part of
        #: the time the client waits for it.
        self.peak_requests = 0
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(128)
        self.endpoint = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        accept = threading.Thread(target=self._accept, daemon=True)
        accept.start()
        self._threads.append(accept)

    @property
    def live(self) -> int:
        with self._lock:
            self._drop_closed()
            return len(self._live)

    def reset_peak(self) -> None:
        """Start a new measurement: the peaks are the connections live and the requests
        answered now."""
        with self._lock:
            self._drop_closed()
            self.peak = len(self._live)
            self.at_peak = [record for _, record in self._live.values()]
            self.peak_requests = self._answering

    def close(self) -> None:
        self._server.close()
        with self._lock:
            for client, _ in self._live.values():
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(5)

    # ------------------------------------------------------------------ internals
    def _drop_closed(self) -> None:
        """(Lock held.) Forget the connections whose client has closed: a read that does
        not wait finds their end of stream (or their reset)."""
        for number, (client, record) in list(self._live.items()):
            try:
                data = client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:
                self._ended(number, record)

    def _ended(self, number: int, record: Connection) -> None:
        if self._live.pop(number, None) is not None:
            record.closed = time.monotonic()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            with self._lock:
                self._drop_closed()
                record = Connection(len(self.connections), time.monotonic())
                self.connections.append(record)
                self._live[record.number] = (client, record)
                if len(self._live) > self.peak:
                    self.peak = len(self._live)
                    self.at_peak = [entry for _, entry in self._live.values()]
            serve = threading.Thread(target=self._serve, args=(client, record), daemon=True)
            serve.start()
            self._threads.append(serve)

    def _serve(self, client: socket.socket, record: Connection) -> None:
        """Answer the client's requests one after another, each forwarded on a new
        upstream connection (moto closes each), until the client closes."""
        pending = b""
        try:
            while True:
                request, pending = _read_request(client, pending)
                if request is None:
                    return
                head = request.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
                ranges = [line.split(":", 1)[1].strip() for line in head[1:]
                          if line.lower().startswith("range:")]
                record.requests.append(" ".join([head[0].rsplit(" ", 1)[0], *ranges]))
                with self._lock:
                    self._answering += 1
                    self.peak_requests = max(self.peak_requests, self._answering)
                try:
                    answer = self._forward(request, head[0].startswith("HEAD "))
                finally:
                    with self._lock:  # (before the client can have the answer)
                        self._answering -= 1
                client.sendall(answer)
        except OSError:
            return
        finally:
            with self._lock:  # the client closed (or the proxy did): it ends now
                self._ended(record.number, record)
            client.close()

    def _forward(self, request: bytes, head_only: bool) -> bytes:
        """The server's answer to ``request``, made keep-alive: its own ``Connection:
        close`` removed, so the client keeps the connection as it would with S3."""
        with socket.create_connection(self._target) as upstream:
            upstream.sendall(request)
            parts = []
            while chunk := upstream.recv(1 << 16):
                parts.append(chunk)
        response = b"".join(parts)
        head, _, body = response.partition(b"\r\n\r\n")
        lines = [line for line in head.split(b"\r\n")
                 if not line.lower().startswith((b"connection:", b"keep-alive:"))]
        if not head_only and not any(line.lower().startswith(b"content-length:")
                                     for line in lines):
            lines.append(b"Content-Length: %d" % len(body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _read_request(sock: socket.socket, pending: bytes) -> tuple[bytes | None, bytes]:
    """One request (head and Content-Length body) from ``sock``, and the bytes after
    it; None at the end of the stream."""
    data = pending
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None, b""
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    while len(rest) < length:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return None, b""
        rest += chunk
    return head + b"\r\n\r\n" + rest[:length], rest[length:]
