"""Misbehaving network peers on loopback, shared by the remote-tier tests."""

from __future__ import annotations

import socket
import threading


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class DeadPort:
    """A loopback port where nothing listens, kept so while open: every connect is refused at once.

    Bound, never listening. A port from :func:`free_port` goes back to the kernel, and the other
    xdist worker's server (redis, moto) may bind it before the test connects there.
    """

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = int(self.sock.getsockname()[1])

    def __enter__(self) -> DeadPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


class HungServer:
    """Accepts every connection and never answers: a remote whose socket hangs."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        self._held: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            self._held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self._held:
            c.close()
