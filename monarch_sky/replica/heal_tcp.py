"""The `tcp` heal: a rejoining rank pulls its state from a healthy peer's snapshot.

The serving rank snapshots its shards into one host buffer at memcpy speed and serves from the
snapshot, so its own step goes on at once: TorchFT's `disallow_checkpoint` (the serving group's
should_commit) waits for no transfer. The receiver pulls byte ranges over several connections
at once, straight into one buffer (`recv_into`, no copy, no pickle), and may stripe them over
several sources that serve the same step (`fetch`). Connections are bound to the advertised
address and answer only a peer holding the run's secret (`monarch_sky.replica.heal_wire`).
The `rdma` heal (`monarch_sky.replica.heal_rdma`) serves the same snapshot and header from here.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from torchft.checkpointing.transport import CheckpointTransport

from monarch_sky.common import test_hooks

from monarch_sky.replica import heal_wire
from monarch_sky.replica.heal_wire import HealWireError, Packed

log = logging.getLogger(__name__)

SCHEME = "monarch-sky-tcp://"
STREAMS = 4  # connections per source: one stream leaves loopback and NICs under-used
PACED_PIECE = 64 << 10  # a paced heal (test hook) sends this much at a time


@dataclass
class HealStats:
    """What one rank's transport did since it was last asked (`take_stats`)."""

    received_bytes: int = 0
    received_s: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)  # address -> bytes received from it
    served_bytes: int = 0  # bytes of state this rank staged for a peer
    snapshot_s: float = 0.0  # how long staging held this rank's step
    path: str = ""  # what the received bytes crossed: "tcp", "rdma (ibverbs)", "rdma (tcp fallback)"


class HealServer:
    """Serves the newest snapshot to authenticated peers, one thread per connection."""

    def __init__(self, host: str, secret: bytes, hold_s: float):
        self._secret, self._hold_s = secret, hold_s
        self._sock = socket.create_server((host, 0))
        self.address = f"{SCHEME}{host}:{self._sock.getsockname()[1]}"
        self._ready = threading.Condition()
        self._packed: Packed | None = None
        self._expires = 0.0
        self._closed = False
        self._conns: set[socket.socket] = set()
        self.refused = 0  # connections that failed the challenge
        threading.Thread(target=self._accept, name="heal-server", daemon=True).start()

    def serve(self, packed: Packed) -> None:
        with self._ready:
            self._packed, self._expires = packed, time.monotonic() + self._hold_s
            self._ready.notify_all()

    def _snapshot(self, step: int, timeout_s: float) -> Packed:
        """The snapshot of `step`, waiting for its staging (TorchFT asks before it is done)."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while not self._closed:
                packed = self._packed
                if packed is not None and time.monotonic() > self._expires:
                    self._packed = packed = None  # nobody fetched it in time: give the memory back
                if packed is not None and packed.header["step"] == step:
                    self._expires = time.monotonic() + self._hold_s
                    return packed
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._ready.wait(min(left, 1.0))
        raise HealWireError(f"no snapshot of step {step} to serve")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._handle, args=(conn,), name="heal-conn", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        with self._ready:
            if self._closed:
                conn.close()
                return
            self._conns.add(conn)
        with conn:
            try:
                conn.settimeout(self._hold_s)
                if not heal_wire.challenge(conn, self._secret):
                    self.refused += 1
                    return
                while True:
                    request = heal_wire.recv_msg(conn, limit=4096)
                    packed = self._snapshot(int(request["step"]), self._hold_s)
                    if request["op"] == "header":
                        heal_wire.send_msg(conn, packed.header)
                    else:
                        self._send_range(conn, packed, int(request["start"]), int(request["end"]))
            except (OSError, HealWireError, ValueError, KeyError) as e:
                log.debug("heal connection ended: %s", e)
            finally:
                with self._ready:
                    self._conns.discard(conn)

    def _send_range(self, conn: socket.socket, packed: Packed, start: int, end: int) -> None:
        if not 0 <= start <= end <= packed.nbytes:
            raise HealWireError(f"range {start}-{end} outside the snapshot's {packed.nbytes} bytes")
        view = heal_wire.byte_view(packed.buffer)[start:end]
        pace = test_hooks.heal_pace_bytes_per_s()
        piece = PACED_PIECE if pace else heal_wire.CHUNK
        began = time.monotonic()
        for at in range(0, len(view), piece):
            if pace:
                time.sleep(max(0.0, began + at / pace - time.monotonic()))
            conn.sendall(view[at:at + piece])

    def close(self) -> None:
        """Stop serving, also the transfers under way (a receiver sees the break at once)."""
        with self._ready:
            self._closed, self._packed = True, None
            conns, self._conns = list(self._conns), set()
            self._ready.notify_all()
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _parse(address: str) -> tuple[str, int]:
    if not address.startswith(SCHEME):
        raise HealWireError(f"not a monarch-sky heal address: {address!r}")
    host, port = address[len(SCHEME):].rsplit(":", 1)
    return host, int(port)


def _connect(address: str, secret: bytes, timeout_s: float) -> socket.socket:
    conn = socket.create_connection(_parse(address), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    heal_wire.respond(conn, secret)
    return conn


def _fetch_range(address: str, secret: bytes, step: int, view: memoryview, start: int, timeout_s: float) -> None:
    with _connect(address, secret, timeout_s) as conn:
        heal_wire.send_msg(conn, {"op": "range", "step": step, "start": start, "end": start + len(view)})
        heal_wire.recv_into(conn, view)


def stripes(nbytes: int, sources: list[str], streams: int) -> list[tuple[str, int, int]]:
    """(source, start, end) for each connection: disjoint ranges covering the buffer, dealt
    round-robin over the sources so each serves an equal share."""
    count = max(1, len(sources) * streams)
    size = -(-nbytes // count)
    return [(sources[i % len(sources)], i * size, min(nbytes, (i + 1) * size))
            for i in range(count) if i * size < nbytes]


def fetch_header(source: str, step: int, secret: bytes, timeout_s: float) -> dict:
    """The snapshot's description (`heal_wire.pack`), waiting for its staging up to `timeout_s`."""
    with _connect(source, secret, timeout_s) as conn:
        heal_wire.send_msg(conn, {"op": "header", "step": step})
        return heal_wire.recv_msg(conn)


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
    header = fetch_header(sources[0], step, secret, timeout_s)
    buffer = receive_buffer(header["nbytes"], into)
    view = heal_wire.byte_view(buffer)
    parts = stripes(header["nbytes"], sources, streams)
    per_source = {s: 0 for s in sources}
    with ThreadPoolExecutor(max_workers=len(parts) or 1, thread_name_prefix="heal-recv") as pool:
        futures = [pool.submit(_fetch_range, src, secret, step, view[a:b], a, timeout_s) for src, a, b in parts]
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
        self._buffer = None  # mapped host memory, reused by every snapshot and receive
        self.mesh = None  # this rank's device mesh: a received DTensor is rebuilt on it

    def prepare(self, nbytes: int) -> None:
        """Map a buffer of `nbytes` now, so the heal itself runs at the wire's rate."""
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = heal_wire.host_buffer(nbytes)

    def metadata(self) -> str:
        return self.server.address

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: dict, timeout: timedelta) -> None:
        began = time.perf_counter()
        packed = heal_wire.pack(state_dict, step, into=self._buffer)
        self._buffer = packed.buffer  # kept: the next heal this rank serves snapshots at memcpy speed
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
        state, per_source, path = self.receive([metadata], step)
        self._buffer = None  # the state is a view into it until loaded
        with self._lock:
            self._stats.path = path
            self._stats.received_bytes += sum(per_source.values())
            self._stats.received_s += time.perf_counter() - began
            for source, nbytes in per_source.items():
                self._stats.sources[source] = self._stats.sources.get(source, 0) + nbytes
        return state

    def receive(self, sources: list[str], step: int) -> tuple[Any, dict, str]:
        """(state, {source: bytes}, the path the bytes crossed)."""
        state, per_source = fetch(sources, step, self._secret, self._timeout_s, self._streams, into=self._buffer,
                                  mesh=self.mesh)
        return state, per_source, "tcp"

    def take_stats(self) -> HealStats:
        with self._lock:
            stats, self._stats = self._stats, HealStats()
        return stats

    def shutdown(self, wait: bool = True) -> None:
        self.server.close()
