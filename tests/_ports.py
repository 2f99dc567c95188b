"""Ports for the servers a test starts (a Ray head, a Neo4j of its own) that no other process takes meanwhile.

A port found free by binding port 0 and closing the socket is one the kernel hands out again to the next bind(0) or
connect() anywhere on the machine: a Ray head's client server, started seconds after its port was chosen so, failed
with "Address already in use", and `ray start --block` then took its whole cluster down mid-test. The kernel hands
out ports at random only inside ip_local_port_range, and Ray its workers' ports only in 10002-19999, so these come
from between the two: a block of its own for each xdist worker, taken in turn, each checked free when taken."""

import os
import socket
from collections.abc import Iterator
from pathlib import Path

FIRST = 20_000  # above the worker ports of a Ray node (ray start's --min-worker-port / --max-worker-port defaults)
BLOCK = 1_000  # ports per xdist worker


def _ephemeral_start() -> int:
    """The lowest port the kernel hands out at random (Linux; 32768 where /proc says nothing)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _ports() -> Iterator[int]:
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    start = FIRST + worker * BLOCK
    if start + BLOCK > _ephemeral_start():
        raise RuntimeError(f"xdist worker gw{worker} has no ports below the kernel's ephemeral range")
    for port in range(start, start + BLOCK):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # a server of someone else's: skip it
                continue
        yield port


_FREE = _ports()


def unclaimed_port() -> int:
    """A port free now that nothing hands out to another process before this test's server binds it."""
    return next(_FREE)
