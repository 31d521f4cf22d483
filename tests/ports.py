"""Ports on the real host for tests that listen there: the kernel picks a free one, so tests in
parallel pytest workers (or beside a `make demo`) never contend for a fixed number."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port nothing listens on now (bound to 127.0.0.1 and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
