"""The `rdma` heal: the receiver reads the serving rank's snapshot one-sided, through Monarch's
`RDMABuffer`.

The serving side is the `tcp` heal's (the snapshot at memcpy speed, the authenticated header
server); on top, the snapshot is registered as a few RDMA buffers and their handles travel in
its header. The receiver reads every piece straight into its own buffer, all in flight at once,
and the sender's CPU never touches the bytes. Over ibverbs (an RDMA adapter with its device
files in the container) that is the NIC's rate; without one Monarch falls back to its own TCP
path, measured here slower than the `tcp` heal (`make bench-heal`), which is why `auto` picks
`rdma` only where ibverbs is up. A receiver that gets no handles (a `tcp` sender, or RDMA
unusable on its side) pulls the same snapshot over `tcp`, so the two mix within one run.

A handle is the text Monarch itself pickles an `_RdmaBuffer` into (the owning actor's address,
the memory's id and size), so it crosses in the JSON header and nothing is unpickled.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import xxhash

from monarch_sky.replica import heal_wire
from monarch_sky.replica.heal_receive import STREAMS, Partial, fetch_header, receive_buffer
from monarch_sky.replica.heal_receive import fetch as tcp_fetch
from monarch_sky.replica.heal_tcp import TCPHealTransport
from monarch_sky.replica.heal_wire import HealWireError, Packed

PIECES = 4  # buffers per snapshot, read side by side (4 beat 1 and 8 over the TCP fallback here)
_configured = threading.Lock()


def backend() -> str:
    """Monarch's RDMA backend in this process: "ibverbs", "tcp" (its fallback) or "none"."""
    import monarch
    from monarch.rdma import get_rdma_backend

    with _configured:
        monarch.configure(rdma_allow_tcp_fallback=True)
    return get_rdma_backend()


def _handle(buffer) -> str:
    # Monarch 0.7.0 pickles an _RdmaBuffer as its class called on this text (no public accessor).
    _, (text,) = buffer._buffer.__reduce__()
    if not isinstance(text, str):
        raise HealWireError(f"Monarch's RDMA buffer no longer pickles to text ({type(text).__name__})")
    return text


def _buffer(text: str):
    from monarch._rust_bindings.rdma import _RdmaBuffer
    from monarch.rdma import RDMABuffer

    buffer = RDMABuffer.__new__(RDMABuffer)
    buffer._buffer = _RdmaBuffer(text)
    return buffer


def pieces(nbytes: int, count: int = PIECES) -> list[tuple[int, int]]:
    """(start, end) of each registered piece: disjoint, covering the snapshot once."""
    size = max(heal_wire.ALIGN, -(-nbytes // count))
    return [(a, min(nbytes, a + size)) for a in range(0, nbytes, size)]


class RDMAHealTransport(TCPHealTransport):
    def __init__(self, host: str, secret: bytes, timeout_s: float, **kwargs):
        super().__init__(host, secret, timeout_s, **kwargs)
        self.backend = backend()
        self._registered: tuple[int, int, list] | None = None  # (data_ptr, nbytes, [(start, end, buffer)])
        self._registering = threading.Lock()  # publish (TorchFT's quorum thread) against expiry (a timer)
        self.server.on_expire = self._expired  # the snapshot given back: its registration too

    def publish(self, packed: Packed) -> Packed:
        """The snapshot with its RDMA handles in the header. A snapshot served again (node
        memory's, heal after heal) keeps its registrations: pinning gigabytes is not free."""
        key = (packed.buffer.data_ptr(), packed.nbytes)
        with self._registering:
            if self._registered is None or self._registered[:2] != key:
                self._drop_registered()
                from monarch.rdma import RDMABuffer

                view = heal_wire.byte_view(packed.buffer)
                registered = [(a, b, RDMABuffer(packed.buffer[a:b]), xxhash.xxh3_64_hexdigest(view[a:b]))
                              for a, b in pieces(packed.nbytes)]
                self._registered = (*key, registered)
            handles = [{"start": a, "end": b, "handle": _handle(buf), "xxh3": digest}
                       for a, b, buf, digest in self._registered[2]]
        return Packed({**packed.header, "rdma": {"backend": self.backend, "pieces": handles}}, packed.buffer)

    def receive(self, sources: list[str], step: int, into=None,
                partial: Partial | None = None) -> tuple[Any, dict, str, int]:
        """As the `tcp` heal's; what an RDMA read that broke off received is never kept (a read
        that outlived its timeout may still land), only a `tcp` one's."""
        if self.backend == "none":
            return super().receive(sources, step, into, partial)
        return fetch(sources[0], step, self._secret, self._timeout_s, into=into, mesh=self.mesh,
                     streams=self._streams, partial=partial)

    def _expired(self, packed: Packed) -> None:
        with self._registering:
            if self._registered is not None and self._registered[:2] == (packed.buffer.data_ptr(), packed.nbytes):
                self._drop_registered()

    def _drop(self) -> None:
        with self._registering:
            self._drop_registered()

    def _drop_registered(self) -> None:
        registered, self._registered = self._registered, None
        for _, _, buf, _ in registered[2] if registered else []:
            try:
                buf.drop().get(timeout=10)
            except Exception:  # noqa: BLE001 - its owner may be going away: the memory goes with it
                pass

    def shutdown(self, wait: bool = True) -> None:
        super().shutdown(wait)
        self._drop()


def fetch(source: str, step: int, secret: bytes, timeout_s: float, into=None, mesh=None,
          streams: int = STREAMS, partial: Partial | None = None) -> tuple[Any, dict, str, int]:
    """(state, {source: bytes}, path, bytes kept from `partial`) of `step`: read through RDMA
    when `source` published handles, else pulled over tcp."""
    header = fetch_header(source, step, secret, timeout_s)
    if "rdma" not in header:
        state, per_source, kept = tcp_fetch([source], step, secret, timeout_s, streams, into=into, mesh=mesh,
                                            partial=partial)
        return state, per_source, "tcp", kept
    buffer = receive_buffer(header["nbytes"], into)
    read_pieces(header["rdma"]["pieces"], buffer, timeout_s)
    path = "rdma (ibverbs)" if header["rdma"]["backend"] == "ibverbs" == backend() else "rdma (tcp fallback)"
    return heal_wire.unpack(header, buffer, mesh), {source: header["nbytes"]}, path, 0


def read_pieces(described: list[dict], buffer, timeout_s: float) -> None:
    """Read every piece into its place in `buffer`, all in flight at once; each read fails
    after `timeout_s` (Monarch's bound: whole seconds). Each piece must hash to the digest its
    (authenticated) header gives."""
    seconds = max(1, round(timeout_s))
    deadline = time.monotonic() + timeout_s
    futures = [_buffer(p["handle"]).read_into(buffer[p["start"]:p["end"]], timeout=seconds) for p in described]
    for future in futures:
        future.get(timeout=max(0.1, deadline - time.monotonic()) + 1)
    view = heal_wire.byte_view(buffer)
    for p in described:
        if xxhash.xxh3_64_hexdigest(view[p["start"]:p["end"]]) != p["xxh3"]:
            raise HealWireError(f"an RDMA read of bytes {p['start']}-{p['end']} arrived damaged")

