"""A replica group's parameter digest: equal digests mean identical weights.

Each rank hashes only its own shards (FSDP's local tensors, with each parameter's name and
global and local shapes) and the group's digest combines its ranks' hashes in rank order. No
full tensor is gathered and no collective runs: a 70B group's ranks each hash their ~35 GB
in place, streamed in chunks through host memory. Groups with the same layout (processes per
group, sharding) and the same weights get the same digest; any differing shard changes it.
"""

from __future__ import annotations

import hashlib

import torch

CHUNK_BYTES = 256 << 20  # host memory a hash streams through at a time


@torch.no_grad()
def shard_digest(model_parts, chunk_bytes: int = CHUNK_BYTES) -> str:
    """sha256 of this rank's local parameter shards, in name order."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for model in model_parts:
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            local = p._local_tensor if isinstance(p, DTensor) else p
            h.update(f"{name}|{tuple(p.shape)}|{tuple(local.shape)}|{local.dtype}".encode())
            _hash_bytes(h, local.detach(), chunk_bytes)
    return h.hexdigest()


def _hash_bytes(h, tensor: torch.Tensor, chunk_bytes: int) -> None:
    flat = tensor.contiguous().reshape(-1).view(torch.uint8)  # any dtype, bf16 too
    for start in range(0, flat.numel(), chunk_bytes):
        h.update(flat[start:start + chunk_bytes].cpu().numpy())


def combine(rank_digests: list[str]) -> str:
    """The group's digest from its ranks' `shard_digest`s, in rank order."""
    return hashlib.sha256("|".join(rank_digests).encode()).hexdigest()
