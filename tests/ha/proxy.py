"""A TCP proxy a test controls, for the replication link: it forwards each connection
both ways until told to cut one way or both (what is cut is held back, not dropped, and
no connection is closed: a partition, not a crash), then forwards again once healed."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from harness.deployment import free_ports


class Proxy:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.forward = threading.Event()  # client -> target flows
        self.backward = threading.Event()  # target -> client flows
        self.heal()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self, *, forward: bool = True, backward: bool = True) -> None:
        if forward:
            self.forward.clear()
        if backward:
            self.backward.clear()

    def heal(self) -> None:
        self.forward.set()
        self.backward.set()

    def close(self) -> None:
        self._closed = True
        self.heal()
        for sock in [self._listener, *self._sockets]:
            with suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target)
            except OSError:
                continue
            self._sockets += [client, upstream]
            threading.Thread(
                target=self._pump, args=(client, upstream, self.forward), daemon=True
            ).start()
            threading.Thread(
                target=self._pump, args=(upstream, client, self.backward), daemon=True
            ).start()

    def _pump(self, source: socket.socket, sink: socket.socket, flowing: threading.Event) -> None:
        try:
            while True:
                flowing.wait()
                data = source.recv(65536)
                if not data:
                    break
                flowing.wait()  # (cut meanwhile: held back until healed)
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def free_port() -> int:
    """One that no client's connection can take as its own local port meanwhile."""
    return free_ports(1)[0]


@contextmanager
def proxy_to(port: int) -> Iterator[Proxy]:
    proxy = Proxy(("127.0.0.1", port))
    try:
        yield proxy
    finally:
        proxy.close()
