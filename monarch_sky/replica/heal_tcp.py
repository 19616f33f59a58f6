"""The `tcp` heal: a rejoining rank pulls its state from a healthy peer's snapshot.

The serving rank serves a snapshot of its shards (`heal_server`): its node-memory snapshot when
that holds the state asked for, else a copy made at memcpy speed; its own step goes on at once:
TorchFT's `disallow_checkpoint` (the serving group's should_commit) waits for no transfer. The
receiver pulls byte ranges over several connections at once, straight into one buffer
(`recv_into`, no copy, no pickle), and may stripe them over several sources that serve the same
step (`fetch`). Connections are bound to the advertised address and authenticated both ways
(`heal_session`). The `rdma` heal (`heal_rdma`) serves the same snapshot and header from here.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator

from torchft.checkpointing.transport import CheckpointTransport


from monarch_sky.replica import heal_session, heal_wire
from monarch_sky.replica.heal_server import SCHEME, HealServer
from monarch_sky.replica.heal_wire import HealWireError, Packed


STREAMS = 4  # connections per source: one stream leaves loopback and NICs under-used


@dataclass
class HealStats:
    """What one rank's transport did since it was last asked (`take_stats`)."""

    received_bytes: int = 0
    received_s: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)  # address -> bytes received from it
    served_bytes: int = 0  # bytes of state this rank staged for a peer
    snapshot_s: float = 0.0  # how long staging held this rank's step
    path: str = ""  # what the received bytes crossed: "tcp", "rdma (ibverbs)", "rdma (tcp fallback)"


def _parse(address: str) -> tuple[str, int]:
    if not address.startswith(SCHEME):
        raise HealWireError(f"not a monarch-sky heal address: {address!r}")
    host, port = address[len(SCHEME):].rsplit(":", 1)
    return host, int(port)


@contextlib.contextmanager
def _connect(address: str, secret: bytes, timeout_s: float) -> Iterator[heal_session.Session]:
    with socket.create_connection(_parse(address), timeout=timeout_s) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        yield heal_session.connect(conn, secret)


def _fetch_range(address: str, secret: bytes, step: int, version: str, view: memoryview, start: int,
                 timeout_s: float) -> None:
    with _connect(address, secret, timeout_s) as session:
        session.send({"op": "range", "step": step, "version": version, "start": start, "end": start + len(view)})
        session.recv_range(view)


def stripes(nbytes: int, sources: list[str], streams: int) -> list[tuple[str, int, int]]:
    """(source, start, end) for each connection: disjoint ranges covering the buffer, dealt
    round-robin over the sources so each serves an equal share."""
    count = max(1, len(sources) * streams)
    size = -(-nbytes // count)
    return [(sources[i % len(sources)], i * size, min(nbytes, (i + 1) * size))
            for i in range(count) if i * size < nbytes]


def fetch_header(source: str, step: int, secret: bytes, timeout_s: float) -> dict:
    """The snapshot's description (`heal_wire.pack`), waiting for its staging up to `timeout_s`."""
    with _connect(source, secret, timeout_s) as session:
        session.send({"op": "header", "step": step})
        header = session.recv()
    if header.get("step") != step:
        raise HealWireError(f"{source} served step {header.get('step')} when asked for step {step}")
    return header


def receive_buffer(nbytes: int, into=None):
    """`into` when it holds `nbytes` (mapped while the rank built), else a new host buffer."""
    return into[:nbytes] if into is not None and into.numel() >= nbytes else heal_wire.host_buffer(nbytes)


def fetch(
    sources: list[str], step: int, secret: bytes, timeout_s: float, streams: int = STREAMS, into=None, mesh=None
) -> tuple[Any, dict]:
    """Receive the state of `step` from `sources` (each serving the same snapshot), into
    `into` when it is large enough; DTensors are rebuilt on `mesh`.

    Returns the state and {source: bytes it sent}. Every socket operation is bounded by
    `timeout_s`: a slow heal that keeps moving finishes, a stalled one fails.
    """
    headers = {src: fetch_header(src, step, secret, timeout_s) for src in sources}
    header = headers[sources[0]]
    layout = ("spec", "leaves", "nbytes")
    if any([h[k] for k in layout] != [header[k] for k in layout] for h in headers.values()):
        raise HealWireError(f"the sources of step {step} serve snapshots of different layouts: {', '.join(sources)}")
    buffer = receive_buffer(header["nbytes"], into)
    view = heal_wire.byte_view(buffer)
    parts = stripes(header["nbytes"], sources, streams)
    per_source = {s: 0 for s in sources}
    with ThreadPoolExecutor(max_workers=len(parts) or 1, thread_name_prefix="heal-recv") as pool:
        futures = [pool.submit(_fetch_range, src, secret, step, headers[src]["version"], view[a:b], a, timeout_s)
                   for src, a, b in parts]
        for (src, a, b), future in zip(parts, futures):
            future.result()
            per_source[src] += b - a
    return heal_wire.unpack(header, buffer, mesh), per_source


class TCPHealTransport(CheckpointTransport[dict]):
    def __init__(self, host: str, secret: bytes, timeout_s: float, streams: int = STREAMS):
        self._secret, self._timeout_s, self._streams = secret, timeout_s, streams
        self.server = HealServer(host, secret, hold_s=timeout_s)
        self._stats = HealStats()
        self._lock = threading.Lock()
        self._buffer = None  # a rejoining rank's receive buffer, mapped while it builds
        self.mesh = None  # this rank's device mesh: a received DTensor is rebuilt on it
        # The node-memory snapshot of the state TorchFT asks to send, if one holds it (node_state).
        self.snapshot_of: Callable[[float], Packed | None] = lambda timeout_s: None

    def prepare(self, nbytes: int) -> None:
        """Map a buffer of `nbytes` now, so the heal itself runs at the wire's rate."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = heal_wire.host_buffer(nbytes)

    def metadata(self) -> str:
        return self.server.address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        """Serve the state of `step`: the node-memory snapshot that holds it, else a copy made
        now (freed once no peer fetched from it for the heal's timeout)."""
        began = time.perf_counter()
        packed = self.snapshot_of(self._timeout_s)
        if packed is None or packed.header["step"] != step:
            packed = heal_wire.pack(state_dict, step)
        self.server.serve(self.publish(packed))
        with self._lock:
            self._stats.served_bytes += packed.nbytes
            self._stats.snapshot_s += time.perf_counter() - began

    def publish(self, packed: Packed) -> Packed:
        """The snapshot as served (a subclass may describe more in its header)."""
        return packed

    def disallow_checkpoint(self) -> None:
        """Nothing to wait for: peers read the snapshot, not the state this rank trains on."""

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> dict:
        began = time.perf_counter()
        # Taken, never given back: the state is a view into it until loaded, and after a failed
        # receive late writes (an RDMA read that outlived its timeout) may still land in it.
        into, self._buffer = self._buffer, None
        state, per_source, path = self.receive([metadata], step, into)
        with self._lock:
            self._stats.path = path
            self._stats.received_bytes += sum(per_source.values())
            self._stats.received_s += time.perf_counter() - began
            for source, nbytes in per_source.items():
                self._stats.sources[source] = self._stats.sources.get(source, 0) + nbytes
        return state

    def receive(self, sources: list[str], step: int, into=None) -> tuple[Any, dict, str]:
        """(state, {source: bytes}, the path the bytes crossed); `into`: a buffer mapped ahead."""
        state, per_source = fetch(sources, step, self._secret, self._timeout_s, self._streams, into=into,
                                  mesh=self.mesh)
        return state, per_source, "tcp"

    def take_stats(self) -> HealStats:
        with self._lock:
            stats, self._stats = self._stats, HealStats()
        return stats

    def shutdown(self, wait: bool = True) -> None:
        self.server.close()
