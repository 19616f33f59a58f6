"""The bytes of a heal: a rank's state packed into one flat buffer, and the wire it crosses.

`pack` copies a state dict's tensors into one contiguous host buffer (a snapshot: the live
tensors may change the moment it returns) and describes everything else in JSON: the tree's
shape (torch's pytree spec), each tensor's dtype, shape and offset, and the plain values
(steps, learning rates). `unpack` rebuilds the state as views into the received buffer.
A DTensor (DiLoCo's outer momentum, sharded like its parameter) crosses as its local shard
with its placements and global shape; the receiver, whose rank holds the same shard of the
same mesh, rebuilds it on its own mesh.
Nothing is pickled: a peer, or a stranger who reached the port, can send bytes and numbers,
never code (TorchFT's HTTP transport unpickles with `weights_only=False`).

The wire (`monarch_sky.replica.heal_session`): a mutual handshake under the run's secret, then
authenticated JSON messages and checked byte ranges; this module keeps the plain framing it
builds on (and the raw-TCP baseline of `make bench-heal` uses).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten, treespec_dumps, treespec_loads

ALIGN = 64  # each tensor starts on a cache line, so its view has a legal storage offset
CHUNK = 8 << 20  # bytes per send/recv call: large enough that Python's overhead vanishes
PLAIN = (bool, int, float, str, type(None))
HEAL_SECRET_ENV = "MONARCH_SKY_HEAL_SECRET"  # hex, set by the controller for every trainer


class HealWireError(RuntimeError):
    """A heal connection was refused, broke, or carried something it must not."""


@dataclass
class Packed:
    header: dict  # JSON-ready: step, spec, leaves, nbytes
    buffer: torch.Tensor  # uint8, contiguous, on the host

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()


def host_buffer(nbytes: int) -> torch.Tensor:
    """A host buffer with its pages already mapped: writing into fresh pages costs a page
    fault each, which halves a heal's rate (measured here). A GPU's tensors copy out
    fastest into pinned memory."""
    if torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=torch.uint8)


def layout(state: Any) -> tuple[list, Any, list[dict], int]:
    """(leaves, tree spec, each leaf described, buffer bytes) of a state; a DTensor leaf is
    given as its local shard."""
    leaves, spec = tree_flatten(state)
    described, offset = [], 0
    for i, leaf in enumerate(leaves):
        if torch.is_tensor(leaf):
            extra = {}
            if isinstance(leaf, DTensor):
                extra, leaf = {"dtensor": _dtensor_text(leaf)}, leaf.to_local()
                leaves[i] = leaf
            described.append({"dtype": str(leaf.dtype).removeprefix("torch."), "shape": list(leaf.shape),
                              "offset": offset, **extra})
            offset += math.ceil(leaf.numel() * leaf.element_size() / ALIGN) * ALIGN
        elif isinstance(leaf, PLAIN):
            described.append({"value": leaf})
        else:
            raise HealWireError(f"heal state holds a {type(leaf).__name__}: only tensors and plain values "
                                "(numbers, strings, None) cross the wire")
    return leaves, spec, described, offset


def _dtensor_text(tensor: DTensor) -> dict:
    """What the receiver needs besides the local shard: placements and the global shape."""
    placements = []
    for p in tensor.placements:
        if type(p) is Shard:  # not _StridedShard and the like: their layout is not just a dim
            placements.append({"shard": p.dim})
        elif isinstance(p, Replicate):
            placements.append({"replicate": True})
        else:
            raise HealWireError(f"heal state holds a DTensor placed {p}: only Shard(dim) and Replicate cross the wire")
    return {"placements": placements, "shape": list(tensor.shape), "stride": list(tensor.stride())}


def _rebuild(local: torch.Tensor, text: dict, mesh) -> DTensor:
    if mesh is None:
        raise HealWireError("the heal state holds DTensors but the receiving rank gave no device mesh to rebuild them on")
    placements = [Shard(p["shard"]) if "shard" in p else Replicate() for p in text["placements"]]
    local = local.to(mesh.device_type, copy=True)  # a view would keep the whole receive buffer alive
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(text["shape"]),
                              stride=tuple(text["stride"]))


def describe(state: Any, step: int) -> tuple[list, dict]:
    """(leaves, header) of `state`: the header says where each tensor leaf goes in the buffer."""
    leaves, spec, described, nbytes = layout(state)
    return leaves, {"step": step, "spec": treespec_dumps(spec), "leaves": described, "nbytes": nbytes}


def fill(leaves: list, header: dict, buffer: torch.Tensor) -> None:
    """Copy the tensor leaves into `buffer` at the places `header` gives them."""
    pinned = buffer.is_pinned()  # device to pinned host memory: queue every copy, then wait once
    for leaf, desc in zip(leaves, header["leaves"]):
        if torch.is_tensor(leaf):
            _view(buffer, desc).copy_(leaf.detach(), non_blocking=pinned)
    if pinned:
        torch.cuda.synchronize()


def pack(state: Any, step: int, into: torch.Tensor | None = None) -> Packed:
    """Snapshot `state` (into `into` when it is large enough: its pages are mapped already)."""
    leaves, header = describe(state, step)
    nbytes = header["nbytes"]
    buffer = into[:nbytes] if into is not None and into.numel() >= nbytes else host_buffer(nbytes)
    fill(leaves, header, buffer)
    return Packed(header, buffer)


def _view(buffer: torch.Tensor, desc: dict) -> torch.Tensor:
    dtype = getattr(torch, desc["dtype"])
    start = desc["offset"]
    nbytes = math.prod(desc["shape"]) * dtype.itemsize
    return buffer[start:start + nbytes].view(dtype).view(desc["shape"])


def unpack(header: dict, buffer: torch.Tensor, mesh=None) -> Any:
    """The state as views into `buffer`; DTensor leaves rebuilt on `mesh` (the receiving
    rank's device mesh: same shape, this rank's coordinates)."""
    leaves = []
    for d in header["leaves"]:
        if "offset" not in d:
            leaves.append(d["value"])
        elif "dtensor" in d:
            leaves.append(_rebuild(_view(buffer, d), d["dtensor"], mesh))
        else:
            leaves.append(_view(buffer, d))
    return tree_unflatten(leaves, treespec_loads(header["spec"]))


# ---- the wire ----------------------------------------------------------------------


def secret_from_env() -> bytes:
    value = os.environ.get(HEAL_SECRET_ENV, "")
    if not value:
        raise HealWireError(f"{HEAL_SECRET_ENV} is not set: the run's controller gives every trainer its heal secret")
    return bytes.fromhex(value)


def send_msg(conn: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack("!Q", len(data)) + data)


def recv_msg(conn: socket.socket, limit: int = 1 << 30) -> dict:
    (size,) = struct.unpack("!Q", recv_exact(conn, 8))
    if size > limit:
        raise HealWireError(f"a heal message of {size} bytes is over the limit of {limit}")
    return json.loads(recv_exact(conn, size))


def recv_exact(conn: socket.socket, size: int) -> bytes:
    out = bytearray(size)
    recv_into(conn, memoryview(out))
    return bytes(out)


def recv_into(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:got + CHUNK])
        if n == 0:
            raise HealWireError(f"the heal peer closed the connection after {got} of {len(view)} bytes")
        got += n


def byte_view(buffer: torch.Tensor) -> memoryview:
    return memoryview(buffer.numpy()).cast("B")
