"""A replica group's parameter digest: equal digests mean identical weights."""

from __future__ import annotations

import hashlib

import torch


@torch.no_grad()
def param_digest(model_parts) -> str:
    """sha256 of the group's full parameters (a collective: call it on every rank)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for model in model_parts:
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            h.update(name.encode())
            h.update(full.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()
