"""Heal transports: how a rejoining rank receives its state from a healthy peer.

TorchFT moves the state through a `CheckpointTransport`; torchtitan leaves TorchFT's default,
an HTTPTransport whose lock is held by a fixed 60 s timeout. `install` puts the run's choice
(`ft.heal_transport`) into the manager instead:

- `tcp` (`monarch_sky.replica.heal_tcp`): the serving rank snapshots its shards into host memory and
  serves the snapshot; the receiver pulls it over several authenticated connections, striped
  over every source of the step.
- `rdma` (`monarch_sky.replica.heal_rdma`): the same snapshot, read one-sided through Monarch's
  RDMABuffer (ibverbs, else Monarch's TCP fallback).
- `auto` (the default): `rdma` on a node where Monarch sees ibverbs, else `tcp` (faster than
  Monarch's TCP fallback here: `make bench-heal`).
- `http`: TorchFT's HTTPTransport, built with the heal budget's timeout instead of 60 s.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Callable

from torch.distributed.tensor import DTensor
from torchft.checkpointing.transport import CheckpointTransport

from monarch_sky.common import test_hooks

from monarch_sky.common.platform import ADVERTISE_ENV
from monarch_sky.replica import heal_wire
from monarch_sky.replica.heal_tcp import TCPHealTransport
from monarch_sky.replica.healing import local_tensor

def receive_bytes(shard_bytes: list[int], copies: int) -> int:
    """The buffer a rejoining rank maps for shards of `shard_bytes`: `copies` of each (a
    parameter and AdamW's two moments: 3; DiLoCo adds its original parameters and outer
    momentum: 5), each tensor aligned, plus room for the step counters."""
    return copies * sum(shard_bytes) + 2 * heal_wire.ALIGN * copies * len(shard_bytes) + (1 << 16)


def device_mesh(params: list):
    """The mesh this rank's parameters live on (None: not sharded): received DTensors are rebuilt on it."""
    return next((p.device_mesh for p in params if isinstance(p, DTensor)), None)


def prepare_receive(transport: CheckpointTransport, params: list, diloco: bool, rejoining: bool) -> None:
    """Any rank may be healed (one that fell behind too): it rebuilds received DTensors
    (DiLoCo's outer momentum) on the mesh its parameters live on. A rejoining rank also maps
    its receive buffer while it builds, from its own shards' sizes (the peer's optimizer
    state exists, this rank's not yet). A larger state still arrives, into a buffer mapped then."""
    if not isinstance(transport, TCPHealTransport):
        return
    transport.mesh = device_mesh(params)
    if rejoining:
        transport.prepare(receive_bytes([local_tensor(p).nbytes for p in params], 5 if diloco else 3))


def serve_snapshots(transport: CheckpointTransport, snapshots, version: Callable[[], int]) -> None:
    """A heal of the state this rank's newest node-memory snapshot holds is served from that
    snapshot (`monarch_sky.replica.node_state`), not from a second copy."""
    if isinstance(transport, TCPHealTransport) and snapshots is not None:
        transport.snapshot_of = lambda timeout_s: snapshots.store.matching(version(), timeout_s)


def step_stats(transport: CheckpointTransport) -> dict:
    """The StepResult fields of what `transport` did since the last step (zeros for http)."""
    if not isinstance(transport, TCPHealTransport):
        return {}
    s = transport.take_stats()
    return {"heal_s": s.received_s, "heal_sources": tuple(s.sources.items()), "served_bytes": s.served_bytes,
            "snapshot_s": s.snapshot_s, "heal_path": s.path}


def resolve(kind: str) -> str:
    """The transport this trainer runs: `auto` is rdma where Monarch sees ibverbs, else tcp."""
    if kind == "auto":
        return "rdma" if _ibverbs() else "tcp"
    return kind


def _ibverbs() -> bool:
    try:
        from monarch.rdma import is_ibverbs_available
    except ImportError:
        return False
    return bool(is_ibverbs_available())


def install(manager, kind: str, timeout_s: float) -> CheckpointTransport:
    """Replace the transport TorchFT's manager was built with (before its first quorum)."""
    from torchft.checkpointing.http_transport import HTTPTransport

    kind = resolve(kind)
    timeout_s = test_hooks.heal_timeout_s() or timeout_s
    host = os.environ.get(ADVERTISE_ENV) or "127.0.0.1"
    if kind == "tcp":
        transport = TCPHealTransport(host, heal_wire.secret_from_env(), timeout_s)
    elif kind == "rdma":
        from monarch_sky.replica.heal_rdma import RDMAHealTransport

        transport = RDMAHealTransport(host, heal_wire.secret_from_env(), timeout_s)
    elif kind == "http":
        transport = HTTPTransport(timeout=timedelta(seconds=timeout_s), num_chunks=0)
    else:
        raise ValueError(f"ft.heal_transport={kind!r}: use auto, tcp, rdma or http")
    built = manager._checkpoint_transport  # torchft 0.2.0 offers no setter (see module docstring)
    manager._checkpoint_transport = transport
    threading.Thread(target=_close_http, args=(built,), name="close-torchft-http", daemon=True).start()
    return transport


def _close_http(transport) -> None:
    """Stop the HTTP server torchft's manager started on every interface, and close its socket
    (its own `shutdown` leaves it listening). Off the build path: stopping waits for the
    server's 0.5 s poll."""
    transport.shutdown(wait=True)
    transport._server.server_close()
