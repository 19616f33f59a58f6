"""The receiving side of the `tcp` heal: a rejoining rank pulls a snapshot's bytes from the
peers that serve it, piece by piece, and keeps what arrived when a source is lost.

Each source gets `streams` connections, and each connection takes the next piece (at most
`PIECE` bytes) from one shared queue: a faster source serves more, and the pieces of a source
that breaks off go to the others. A heal that still breaks off (its only source lost) leaves a
`Partial`, the pieces that arrived and checked out. The next heal of the same step (TorchFT's
next quorum, from another peer) asks its source for the digests of those pieces and fetches
only the rest, and any piece whose bytes differ there: a source lost at 90% costs the last 10%
again, not the whole state, and bytes of two different states are never mixed.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator

from monarch_sky.replica import heal_session, heal_wire
from monarch_sky.replica.heal_server import SCHEME
from monarch_sky.replica.heal_wire import HealWireError

STREAMS = 4  # connections per source: one stream leaves loopback and NICs under-used
PIECE = 64 << 20  # bytes per request at most: what a lost source costs each connection
MIN_PIECE = 1 << 20  # bytes per request at least: a request's round trip stays under 1% of its bytes
PIECES_PER_CONNECTION = 8  # a heal lost at any point keeps all but one eighth of each connection's share


@dataclass
class Partial:
    """What a heal that broke off had received: `done` maps each piece (start, end) that
    arrived and checked out to the xxh3 of its bytes."""

    step: int
    layout: str
    buffer: Any
    done: dict[tuple[int, int], str] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b in self.done)


class HealInterrupted(HealWireError):
    """Every source of a heal broke off before all its bytes arrived; `partial` keeps those that did."""

    def __init__(self, message: str, partial: Partial):
        super().__init__(message)
        self.partial = partial


def _parse(address: str) -> tuple[str, int]:
    if not address.startswith(SCHEME):
        raise HealWireError(f"not a monarch-sky heal address: {address!r}")
    host, port = address[len(SCHEME):].rsplit(":", 1)
    return host, int(port)


@contextlib.contextmanager
def connect(address: str, secret: bytes, timeout_s: float) -> Iterator[heal_session.Session]:
    with socket.create_connection(_parse(address), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield heal_session.connect(conn, secret)


def fetch_header(source: str, step: int, secret: bytes, timeout_s: float) -> dict:
    """The snapshot's description (`heal_wire.pack`), waiting for its staging up to `timeout_s`."""
    with connect(source, secret, timeout_s) as session:
        session.send({"op": "header", "step": step})
        header = session.recv()
    if header.get("step") != step:
        raise HealWireError(f"{source} served step {header.get('step')} when asked for step {step}")
    return header


def layout_of(header: dict) -> str:
    return json.dumps([header[k] for k in ("spec", "leaves", "nbytes")], sort_keys=True)


def receive_buffer(nbytes: int, into=None):
    """`into` when it holds `nbytes` (mapped while the rank built), else a new host buffer."""
    return into[:nbytes] if into is not None and into.numel() >= nbytes else heal_wire.host_buffer(nbytes)


def missing(done, nbytes: int) -> list[tuple[int, int]]:
    """The ranges of [0, nbytes) that no piece in `done` covers."""
    gaps, at = [], 0
    for a, b in sorted(done):
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    return gaps + ([(at, nbytes)] if at < nbytes else [])


def pieces(ranges: list[tuple[int, int]], connections: int) -> list[tuple[int, int]]:
    """`ranges` cut into pieces of PIECE bytes at most, PIECES_PER_CONNECTION for each
    connection where that leaves them MIN_PIECE or more."""
    total = sum(b - a for a, b in ranges)
    size = min(PIECE, max(MIN_PIECE, -(-total // max(1, connections * PIECES_PER_CONNECTION))))
    return [(at, min(b, at + size)) for a, b in ranges for at in range(a, b, size)]


class _Work:
    """The pieces still to check or fetch, shared by every connection of one heal."""

    def __init__(self, check: dict[tuple[int, int], str], fetch: list[tuple[int, int]], sources: list[str]):
        self._lock = threading.Lock()
        self._jobs = deque([("check", a, b) for a, b in check] + [("fetch", a, b) for a, b in fetch])
        self.kept = dict(check)  # digests of the pieces an earlier heal received
        self.done: dict[tuple[int, int], str] = {}
        self.per_source = {s: 0 for s in sources}
        self.kept_bytes = 0

    def take(self):
        with self._lock:
            return self._jobs.popleft() if self._jobs else None

    def put_back(self, job, as_fetch: bool = False) -> None:
        with self._lock:
            self._jobs.appendleft(("fetch", *job[1:]) if as_fetch else job)

    def finish(self, job, digest: str, source: str) -> None:
        with self._lock:
            self.done[job[1:]] = digest
            if job[0] == "fetch":
                self.per_source[source] += job[2] - job[1]
            else:
                self.kept_bytes += job[2] - job[1]

    @property
    def left(self) -> int:
        with self._lock:
            return len(self._jobs)


def _serve_from(source: str, secret: bytes, step: int, version: str, view: memoryview, work: _Work,
                timeout_s: float) -> None:
    """One connection to `source`: check or fetch pieces until none are left."""
    with connect(source, secret, timeout_s) as session:
        while (job := work.take()) is not None:
            kind, a, b = job
            try:
                session.send({"op": "digest" if kind == "check" else "range", "step": step, "version": version,
                              "start": a, "end": b})
                if kind == "check":
                    theirs = session.recv(limit=4096).get("xxh3")
                    if theirs != work.kept[(a, b)]:
                        work.put_back(job, as_fetch=True)  # this source's state differs there: fetch it
                        continue
                    work.finish(job, theirs, source)
                else:
                    work.finish(job, session.recv_range(view[a:b]), source)
            except BaseException:
                work.put_back(job)
                raise


def fetch(sources: list[str], step: int, secret: bytes, timeout_s: float, streams: int = STREAMS, into=None,
          mesh=None, partial: Partial | None = None) -> tuple[Any, dict, int]:
    """Receive the state of `step` from `sources` (each serving the same snapshot), into
    `into` when it is large enough, keeping what `partial` (an earlier heal that broke off)
    received where the sources hold the same bytes; DTensors are rebuilt on `mesh`.

    Returns the state, {source: bytes it sent} and the bytes kept from `partial`. Every socket
    operation is bounded by `timeout_s`: a slow heal that keeps moving finishes, a stalled one
    fails. Raises HealInterrupted, with what arrived, when every source broke off.
    """
    headers = {src: fetch_header(src, step, secret, timeout_s) for src in sources}
    header, layout = headers[sources[0]], layout_of(headers[sources[0]])
    if any(layout_of(h) != layout for h in headers.values()):
        raise HealWireError(f"the sources of step {step} serve snapshots of different layouts: {', '.join(sources)}")
    resume = partial is not None and partial.step == step and partial.layout == layout
    buffer = partial.buffer if resume else receive_buffer(header["nbytes"], partial.buffer if partial else into)
    kept = partial.done if resume else {}
    work = _Work(kept, pieces(missing(kept, header["nbytes"]), len(sources) * streams), sources)
    view, live, errors = heal_wire.byte_view(buffer), list(sources), []
    while work.left and live:
        with ThreadPoolExecutor(max_workers=len(live) * streams, thread_name_prefix="heal-recv") as pool:
            runs = [(src, pool.submit(_serve_from, src, secret, step, headers[src]["version"], view, work, timeout_s))
                    for src in live for _ in range(streams)]
        failed = [(src, run.exception()) for src, run in runs if run.exception() is not None]
        errors += [e for _, e in failed]
        live = [src for src in live if src not in {s for s, _ in failed}]
    if work.left:
        arrived = Partial(step, layout, buffer, work.done)
        raise HealInterrupted(f"the heal of step {step} broke off with {arrived.nbytes} of {header['nbytes']} bytes "
                              f"received: {errors[0]}", arrived) from errors[0]
    return heal_wire.unpack(header, buffer, mesh), work.per_source, work.kept_bytes
