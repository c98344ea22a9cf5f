"""What both transports ask of an idle socket before they reuse it."""

from __future__ import annotations

import os
import select
import socket


def closed_by_peer(fileno: int) -> bool:
    """Whether the server has closed this connection while it was idle (its end of file,
    or a reset, is waiting in the socket). Asked before a connection with nothing in
    flight is used again: a writer closes a connection that stayed idle past its idle
    timeout, and a client that has waited longer than that (a worker between
    executions, a server between bursts) must reconnect instead of failing its next
    call with a lost connection. Never reads anything: bytes that are waiting (a late
    reply, a TLS record) stay for the reader, and the connection counts as open.
    Where the platform has no ``poll`` it answers False (the call then fails as before)."""
    if not hasattr(select, "poll"):
        return False
    poller = select.poll()
    poller.register(fileno, select.POLLIN)
    if not poller.poll(0):
        return False  # nothing waiting: open
    probe = socket.socket(fileno=os.dup(fileno))  # a peek of our own; the fd stays theirs
    try:
        return probe.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset by the peer
    finally:
        probe.close()
