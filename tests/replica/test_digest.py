"""The group digest hashes each rank's own shards (no gathered tensor, no collective) and
combines the ranks' hashes: equal weights and layout give equal digests, any difference not."""

from __future__ import annotations

import torch
import torch.nn as nn

from monarch_sky.replica.digest import combine, shard_digest


def model(seed: int, dtype=torch.float32) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 8)).to(dtype)]


def test_equal_weights_give_equal_digests_and_any_difference_does_not():
    a, b = model(0), model(0)
    assert shard_digest(a) == shard_digest(b)
    with torch.no_grad():
        b[0][1].bias[3] += 1e-6
    assert shard_digest(a) != shard_digest(b)
    assert shard_digest(a) != shard_digest(model(1))


def test_every_byte_is_hashed_across_chunks_and_dtypes():
    a, b = model(0, torch.bfloat16), model(0, torch.bfloat16)
    assert shard_digest(a, chunk_bytes=7) == shard_digest(b, chunk_bytes=7) == shard_digest(a)
    with torch.no_grad():
        b[0][0].weight[-1, -1] = -b[0][0].weight[-1, -1] - 1  # the last byte of the largest tensor
    assert shard_digest(a, chunk_bytes=7) != shard_digest(b, chunk_bytes=7)


def test_the_group_digest_depends_on_every_rank_and_their_order():
    ranks = [shard_digest(model(0)), shard_digest(model(1))]
    assert combine(ranks) == combine(list(ranks))
    assert combine(ranks) != combine(ranks[::-1])
    assert combine(ranks) != combine([ranks[0], shard_digest(model(2))])
