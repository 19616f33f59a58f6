"""monarch-sky's heal transport, between real sockets on this machine: what a rejoining rank
receives is bit for bit what the serving rank had, strangers get nothing, several sources
share the work, a slow heal finishes, and a source that goes away fails the heal at once."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch

from monarch_sky.replica import heal_wire
from monarch_sky.replica import heal_receive
from monarch_sky.replica.heal_receive import missing, pieces
from monarch_sky.replica.heal_tcp import TCPHealTransport
from monarch_sky.replica.heal_wire import HealWireError

SECRET = os.urandom(32)


def fetch(*args, **kwargs):
    state, per_source, _ = heal_receive.fetch(*args, **kwargs)
    return state, per_source


def rank_state(n: int = 300_000) -> dict:
    """Shaped like `healing.RankLocalState.state_dict()` inside TorchFT's manager state."""
    g = torch.Generator().manual_seed(0)
    user = {
        "model": {"tok_embeddings.weight": torch.randn(n, generator=g), "norm.weight": torch.randn(64, generator=g),
                  "bf16": torch.randn(333, generator=g).to(torch.bfloat16)},
        "optimizer": [{"tok_embeddings.weight": {"exp_avg": torch.randn(n, generator=g),
                                                 "exp_avg_sq": torch.rand(n, generator=g), "step": torch.tensor(5.0)}}],
        "param_groups": [[{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "foreach": None, "name": "adamw"}]],
        "lr_scheduler": {"last_epoch": 5, "_step_count": 6, "base_lrs": [3e-4]},
        "ntokens_seen": 12345,
    }
    return {"user": {"monarch_sky": user}, "torchft": {"step": 5, "batches_committed": 10}}


def assert_same(got, want) -> None:
    if torch.is_tensor(want):
        assert got.dtype == want.dtype and torch.equal(got, want)
    elif isinstance(want, dict):
        assert got.keys() == want.keys()
        for k in want:
            assert_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert type(got) is type(want) and len(got) == len(want)
        for a, b in zip(got, want):
            assert_same(a, b)
    else:
        assert got == want


@pytest.fixture
def pair():
    serving, receiving = TCPHealTransport("127.0.0.1", SECRET, 10), TCPHealTransport("127.0.0.1", SECRET, 10)
    yield serving, receiving
    serving.shutdown()
    receiving.shutdown()


def test_a_heal_arrives_bit_for_bit_and_the_serving_rank_trains_on_at_once(pair, monkeypatch):
    # The serving group's should_commit (TorchFT's disallow_checkpoint) returns while a slow
    # receiver is still reading: the serving rank's next step changes its tensors, the heal
    # goes on from the snapshot, and what arrives is the state of the step it asked for.
    monkeypatch.setenv("MONARCH_SKY_TEST_HEAL_PACE", str(2_000_000))  # ~1 s per stream
    serving, receiving = pair
    state = rank_state()
    want = torch.utils._pytree.tree_map(lambda v: v.clone() if torch.is_tensor(v) else v, state)
    serving.send_checkpoint([1], 5, state, timedelta(seconds=5))
    receiving.prepare(heal_wire.layout(want)[3])
    got: dict = {}
    heal = threading.Thread(target=lambda: got.update(r=receiving.recv_checkpoint(0, serving.metadata(), 5,
                                                                                  timedelta(seconds=5))))
    heal.start()
    while serving.server._conns == set() and heal.is_alive():  # the transfer has begun
        time.sleep(0.01)
    serving.disallow_checkpoint()
    assert heal.is_alive(), "test premise: the transfer outlasts the serving rank's commit"
    state["user"]["monarch_sky"]["model"]["tok_embeddings.weight"].add_(1.0)  # its optimizer steps on
    heal.join(30)
    assert_same(got["r"], want)  # the snapshot, not the live tensors
    sent, received = serving.take_stats(), receiving.take_stats()
    assert sent.served_bytes == received.received_bytes == heal_wire.layout(want)[3]
    assert received.sources == {serving.metadata(): received.received_bytes}


def test_a_peer_without_the_runs_secret_gets_nothing(pair):
    serving, _ = pair
    serving.send_checkpoint([1], 5, rank_state(1000), timedelta(seconds=5))
    with pytest.raises((HealWireError, OSError)):
        fetch([serving.metadata()], 5, os.urandom(32), timeout_s=5)
    assert serving.server.refused >= 1


def test_only_tensors_and_plain_values_cross_the_wire():
    with pytest.raises(HealWireError, match="only tensors and plain values"):
        heal_wire.pack({"fn": object()}, step=1)


@pytest.fixture
def rank1_of_two():
    """This process as rank 1 of a 2-rank world (torch's fake backend: no peer, no traffic)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,))
    finally:
        dist.destroy_process_group()


def test_diloco_outer_momentum_crosses_as_this_ranks_shard_and_is_rebuilt_on_the_receivers_mesh(pair, rank1_of_two):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh, (serving, receiving) = rank1_of_two, pair
    shard = torch.arange(12.0).view(3, 4) + 100  # rank 1's rows 3-5 of a (6, 4) parameter
    momentum = DTensor.from_local(shard, mesh, [Shard(0)], run_check=False, shape=torch.Size([6, 4]),
                                  stride=(4, 1))
    scale = DTensor.from_local(torch.ones(4), mesh, [Replicate()], run_check=False)
    state = {"user": {"StreamingDiLoCoFragment_0": {"outer_optimizer": {"state": {0: {"momentum_buffer": momentum}},
                                                                        "param_groups": [{"lr": 0.7, "params": [0]}]},
                                                    "original_parameters": {"w": shard.clone()}},
                      "scale": scale}, "torchft": {"step": 2}}
    serving.send_checkpoint([1], 2, state, timedelta(seconds=5))
    receiving.mesh = mesh
    got = receiving.recv_checkpoint(1, serving.metadata(), 2, timedelta(seconds=5))
    fragment = got["user"]["StreamingDiLoCoFragment_0"]
    buf = fragment["outer_optimizer"]["state"][0]["momentum_buffer"]
    assert isinstance(buf, DTensor) and buf.device_mesh is mesh and buf.placements == (Shard(0),)
    assert buf.shape == (6, 4) and torch.equal(buf.to_local(), shard)
    assert isinstance(got["user"]["scale"], DTensor) and got["user"]["scale"].placements == (Replicate(),)
    assert torch.equal(fragment["original_parameters"]["w"], shard)
    assert fragment["outer_optimizer"]["param_groups"] == [{"lr": 0.7, "params": [0]}]
    receiving.mesh = None  # a rank that gave no mesh is told why, not handed plain tensors
    with pytest.raises(HealWireError, match="device mesh"):
        receiving.recv_checkpoint(1, serving.metadata(), 2, timedelta(seconds=5))


def test_a_heal_is_striped_over_every_source_of_the_same_step(monkeypatch):
    monkeypatch.setenv("MONARCH_SKY_TEST_HEAL_PACE", str(20_000_000))  # neither drains the pieces before the other connects
    sources = [TCPHealTransport("127.0.0.1", SECRET, 10) for _ in range(2)]
    try:
        state = rank_state()
        for s in sources:
            s.send_checkpoint([1], 5, state, timedelta(seconds=5))
        got, per_source = fetch([s.metadata() for s in sources], 5, SECRET, timeout_s=5, streams=3)
        assert_same(got, state)
        assert sorted(per_source) == sorted(s.metadata() for s in sources)
        assert all(n > 0 for n in per_source.values())
        assert sum(per_source.values()) == heal_wire.pack(state, 5).nbytes, "each byte came once"
    finally:
        for s in sources:
            s.shutdown()


def test_pieces_cover_what_is_missing_once_and_give_every_connection_work():
    mb = 1 << 20
    done = {(1 * mb, 2 * mb): "x", (5 * mb, 6 * mb): "y"}
    gaps = missing(done, 40 * mb)
    assert gaps == [(0, mb), (2 * mb, 5 * mb), (6 * mb, 40 * mb)]
    cut = pieces(gaps, 4)
    assert len(cut) >= 4 * 8 and all(b - a <= heal_receive.PIECE for a, b in cut)
    covered = sorted(cut + list(done))
    assert covered[0][0] == 0 and covered[-1][1] == 40 * mb
    assert all(prev[1] == nxt[0] for prev, nxt in zip(covered, covered[1:]))
    assert len(pieces([(0, 1000)], 4)) == 1, "a small state is not cut below MIN_PIECE"


def test_a_heal_three_times_longer_than_the_transports_timeout_still_finishes(monkeypatch):
    # The only bound is per socket operation: a slow heal that keeps moving is never cut off.
    monkeypatch.setenv("MONARCH_SKY_TEST_HEAL_PACE", str(1_000_000))  # 1 MB/s per connection
    serving = TCPHealTransport("127.0.0.1", SECRET, timeout_s=0.5)
    try:
        state = rank_state(300_000)  # ~3.6 MB over one connection: ~3.6 s
        serving.send_checkpoint([1], 5, state, timedelta(seconds=1))
        began = time.perf_counter()
        got, _ = fetch([serving.metadata()], 5, SECRET, timeout_s=0.5, streams=1)
        seconds = time.perf_counter() - began
        assert seconds > 3 * 0.5, f"test premise: the heal must outlast the timeout three times ({seconds:.2f}s)"
        assert_same(got, state)
    finally:
        serving.shutdown()


def test_a_source_that_goes_away_mid_heal_fails_the_heal_without_a_hang(monkeypatch):
    monkeypatch.setenv("MONARCH_SKY_TEST_HEAL_PACE", str(500_000))
    serving = TCPHealTransport("127.0.0.1", SECRET, timeout_s=30)
    serving.send_checkpoint([1], 5, rank_state(), timedelta(seconds=1))
    threading.Timer(0.5, serving.shutdown).start()
    began = time.perf_counter()
    with pytest.raises((HealWireError, OSError)):
        fetch([serving.metadata()], 5, SECRET, timeout_s=30)
    assert time.perf_counter() - began < 10, "the break must be seen at once, not at the 30 s timeout"


def test_a_step_nobody_serves_fails_within_the_receivers_timeout(pair):
    serving, _ = pair
    serving.send_checkpoint([1], 5, rank_state(1000), timedelta(seconds=5))
    began = time.perf_counter()
    with pytest.raises((HealWireError, OSError)):
        fetch([serving.metadata()], 6, SECRET, timeout_s=1)
    assert time.perf_counter() - began < 5


def test_a_server_that_cannot_prove_it_holds_the_runs_secret_is_not_healed_from():
    # A stranger listening where a peer was (a port reused, an address spoofed) accepts the
    # rejoiner's proof but cannot answer with one of its own: nothing of it is loaded.
    import socket

    from monarch_sky.replica.heal_session import NONCE_BYTES, TAG_BYTES
    from monarch_sky.replica.heal_server import SCHEME

    listener = socket.create_server(("127.0.0.1", 0))

    def impostor() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(os.urandom(NONCE_BYTES))
            conn.recv(NONCE_BYTES + TAG_BYTES)
            conn.sendall(os.urandom(TAG_BYTES))  # a proof made up
            time.sleep(1)

    threading.Thread(target=impostor, daemon=True).start()
    with pytest.raises(HealWireError, match="did not prove it holds the run's secret"):
        fetch([f"{SCHEME}127.0.0.1:{listener.getsockname()[1]}"], 5, SECRET, timeout_s=5)
    listener.close()


def test_a_snapshot_replaced_during_a_heal_is_never_mixed_with_the_one_before(pair):
    from monarch_sky.replica.heal_receive import connect, fetch_header

    serving, _ = pair
    old, new = rank_state(1000), rank_state(1000)
    new["user"]["monarch_sky"]["model"]["norm.weight"].add_(1.0)
    serving.send_checkpoint([1], 5, old, timedelta(seconds=5))
    header = fetch_header(serving.metadata(), 5, SECRET, 5)
    serving.send_checkpoint([1], 5, new, timedelta(seconds=5))  # TorchFT asked again, the state moved on
    buffer = torch.empty(header["nbytes"], dtype=torch.uint8)
    with pytest.raises((HealWireError, OSError)):  # the old snapshot's ranges are no longer served
        with connect(serving.metadata(), SECRET, 5) as session:
            session.send({"op": "range", "step": 5, "version": header["version"], "start": 0, "end": 64})
            session.recv_range(heal_wire.byte_view(buffer)[:64])
    got, _ = fetch([serving.metadata()], 5, SECRET, timeout_s=5)
    assert_same(got, new)


def test_bytes_damaged_on_the_way_and_altered_messages_are_caught():
    import socket

    from monarch_sky.replica.heal_session import Session

    a, b = socket.socketpair()
    sender, receiver = Session(a, b"k" * 32), Session(b, b"k" * 32)
    good = bytes(range(256)) * 64
    sender.send_range(memoryview(good))
    got = bytearray(len(good))
    receiver.recv_range(memoryview(got))
    assert bytes(got) == good
    damaged = bytearray(good)
    damaged[100] ^= 1
    import xxhash

    a.sendall(damaged)
    sender.send({"xxh3": xxhash.xxh3_64_hexdigest(good)})  # the digest of what should have come
    with pytest.raises(HealWireError, match="arrived damaged"):
        receiver.recv_range(memoryview(bytearray(len(good))))
    Session(a, b"x" * 32).send({"op": "header", "step": 5})  # not this session's key
    with pytest.raises(HealWireError, match="failed its authentication"):
        receiver.recv()
    a.close()
    b.close()


def test_a_receive_that_failed_never_hands_its_buffer_to_the_next(pair):
    # Late writes of the failed receive (an RDMA read that outlived its timeout) may still land
    # in the buffer it was given: the next heal must land somewhere else.
    serving, receiving = pair
    state = rank_state(1000)
    want = torch.utils._pytree.tree_map(lambda v: v.clone() if torch.is_tensor(v) else v, state)
    serving.send_checkpoint([1], 5, state, timedelta(seconds=5))
    receiving.prepare(heal_wire.layout(want)[3])
    failed = receiving._buffer
    with pytest.raises((HealWireError, OSError)):
        receiving.recv_checkpoint(0, serving.metadata(), 6, timedelta(seconds=1))  # nobody serves step 6
    got = receiving.recv_checkpoint(0, serving.metadata(), 5, timedelta(seconds=5))
    assert_same(got, want)
    start, end = failed.data_ptr(), failed.data_ptr() + failed.numel()
    for tensor in torch.utils._pytree.tree_leaves(got):
        if torch.is_tensor(tensor):
            assert not start <= tensor.untyped_storage().data_ptr() < end, "the failed receive's buffer was reused"


def test_a_peer_that_answers_for_another_step_is_not_healed_from(pair, monkeypatch):
    # A peer holding the run's secret (a stale generation, a bug) serves the snapshot it has,
    # whatever step was asked: the receiver checks the step itself and loads nothing.
    serving, receiving = pair
    serving.send_checkpoint([1], 5, rank_state(1000), timedelta(seconds=5))
    monkeypatch.setattr(serving.server, "_snapshot", lambda step, timeout_s: serving.server._packed)
    with pytest.raises(HealWireError, match="served step 5 when asked for step 6"):
        receiving.recv_checkpoint(0, serving.metadata(), 6, timedelta(seconds=5))
