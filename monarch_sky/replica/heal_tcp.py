"""The `tcp` heal: a rejoining rank pulls its state from a healthy peer's snapshot.

The serving rank serves a snapshot of its shards (`heal_server`): its node-memory snapshot when
that holds the state asked for, else a copy made at memcpy speed; its own step goes on at once:
TorchFT's `disallow_checkpoint` (the serving group's should_commit) waits for no transfer. The
receiver pulls pieces over several connections at once, straight into one buffer (`recv_into`,
no copy, no pickle), from every source that serves the step, and a heal whose source was lost
resumes where it broke off at the next quorum, from another peer (`heal_receive`). Connections are bound to the advertised address and authenticated both ways
(`heal_session`). The `rdma` heal (`heal_rdma`) serves the same snapshot and header from here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

from torchft.checkpointing.transport import CheckpointTransport

from monarch_sky.replica import heal_receive, heal_wire
from monarch_sky.replica.heal_receive import STREAMS, HealInterrupted, Partial
from monarch_sky.replica.heal_server import HealServer
from monarch_sky.replica.heal_wire import Packed


@dataclass
class HealStats:
    """What one rank's transport did since it was last asked (`take_stats`)."""

    received_bytes: int = 0
    received_s: float = 0.0
    sources: dict[str, int] = field(default_factory=dict)  # address -> bytes received from it
    kept_bytes: int = 0  # bytes a heal kept from an earlier one that broke off (heal_receive.Partial)
    served_bytes: int = 0  # bytes of state this rank staged for a peer
    snapshot_s: float = 0.0  # how long staging held this rank's step
    path: str = ""  # what the received bytes crossed: "tcp", "rdma (ibverbs)", "rdma (tcp fallback)"


class TCPHealTransport(CheckpointTransport[dict]):
    def __init__(self, host: str, secret: bytes, timeout_s: float, streams: int = STREAMS):
        self._secret, self._timeout_s, self._streams = secret, timeout_s, streams
        self.server = HealServer(host, secret, hold_s=timeout_s)
        self._stats = HealStats()
        self._lock = threading.Lock()
        self._buffer = None  # a rejoining rank's receive buffer, mapped while it builds
        self._partial: Partial | None = None  # what a heal that broke off received
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
        partial, self._partial = self._partial, None
        try:
            state, per_source, path, kept = self.receive([metadata], step, into, partial)
        except HealInterrupted as e:  # the next heal (TorchFT's next quorum, another peer) goes on from here
            self._partial = e.partial
            raise
        except BaseException:  # a source gone before its first byte: what earlier heals kept still counts
            self._partial = partial
            raise
        with self._lock:
            self._stats.path = path
            self._stats.kept_bytes += kept
            self._stats.received_bytes += sum(per_source.values())
            self._stats.received_s += time.perf_counter() - began
            for source, nbytes in per_source.items():
                self._stats.sources[source] = self._stats.sources.get(source, 0) + nbytes
        return state

    def receive(self, sources: list[str], step: int, into=None,
                partial: Partial | None = None) -> tuple[Any, dict, str, int]:
        """(state, {source: bytes}, the path the bytes crossed, bytes kept from `partial`);
        `into`: a buffer mapped ahead; `partial`: what an earlier heal that broke off received."""
        state, per_source, kept = heal_receive.fetch(sources, step, self._secret, self._timeout_s, self._streams,
                                                     into=into, mesh=self.mesh, partial=partial)
        return state, per_source, "tcp", kept

    def take_stats(self) -> HealStats:
        with self._lock:
            stats, self._stats = self._stats, HealStats()
        return stats

    def shutdown(self, wait: bool = True) -> None:
        self.server.close()
