"""A rank's state in node memory: written whole or not at all, read back as it was, served
only for the state it holds, and dropped only once the whole group holds a newer one."""

from __future__ import annotations

import pytest
import torch

from monarch_sky.common import node_memory
from monarch_sky.replica import node_state
from monarch_sky.replica.node_state import NodeState, NodeStateError


@pytest.fixture(autouse=True)
def memory(tmp_path, monkeypatch):
    monkeypatch.setenv(node_memory.ROOT_ENV, str(tmp_path / "node"))
    return tmp_path / "node"


def rank_state(scale: float = 1.0) -> dict:
    """What TorchFT's manager hands a heal: user state per key, and its own step."""
    weights = torch.arange(4096, dtype=torch.float32).reshape(64, 64) * scale
    return {"user": {"monarch_sky": {"model": {"w": weights, "b": torch.ones(3, dtype=torch.bfloat16)},
                                     "lr_scheduler": {"last_epoch": 7}, "ntokens_seen": 123}},
            "torchft": {"step": 7, "batches_committed": 14}}


def taken(store: NodeState, state: dict, progress: int, version: int = 1, data=None) -> None:
    store.take(state, step=progress, progress=progress, version=version, data_state=data or {"pos": b"\x00\x01"})
    store.wait()


def test_a_snapshot_reads_back_as_the_state_it_copied_with_its_data_position():
    store = NodeState("run-a", replica=1, rank=0, every_steps=5)
    state = rank_state()
    taken(store, state, progress=10)
    state["user"]["monarch_sky"]["model"]["w"].add_(1.0)  # training goes on: the snapshot keeps step 10
    header, back = store.load(10)
    assert torch.equal(back["user"]["monarch_sky"]["model"]["w"], rank_state()["user"]["monarch_sky"]["model"]["w"])
    assert back["user"]["monarch_sky"]["model"]["b"].dtype == torch.bfloat16
    assert back["user"]["monarch_sky"]["lr_scheduler"] == {"last_epoch": 7}
    assert back["torchft"] == {"step": 7, "batches_committed": 14}
    assert header["data_state"] == {"pos": b"\x00\x01"} and header["replica"] == 1 and header["progress"] == 10


def test_only_whole_snapshots_are_listed_and_read(memory):
    store = NodeState("run-a", replica=0, rank=0, every_steps=1)
    taken(store, rank_state(), progress=3)
    folder = memory / "run-a"
    (folder / node_memory.partial_name(0, 0, 4)).write_bytes(b"half a snapshot")  # a copy cut off mid-way
    torn = folder / node_memory.snapshot_name(0, 1, 3)
    torn.write_bytes((folder / node_memory.snapshot_name(0, 0, 3)).read_bytes()[:-100])  # not ours to rename, but say it was
    listed = node_memory.listing("run-a")["snapshots"]
    assert [(s["group"], s["rank"], s["step"]) for s in listed] == [(0, 0, 3)]
    with pytest.raises(NodeStateError, match="holds"):
        node_state.read(torn)


def test_a_failed_copy_leaves_nothing_behind(memory, monkeypatch):
    store = NodeState("run-a", replica=0, rank=0, every_steps=1)
    monkeypatch.setattr(node_memory, "free_bytes", lambda path=None: 1000)  # node memory nearly full
    taken(store, rank_state(), progress=1)
    assert "no room" in store.take_error()
    assert list((memory / "run-a").iterdir()) == []


def test_a_rank_drops_an_older_snapshot_only_once_its_whole_group_holds_a_newer_one(memory):
    store = NodeState("run-a", replica=0, rank=0, every_steps=1)
    taken(store, rank_state(), progress=1)
    store.confirm(lambda mine: mine)
    taken(store, rank_state(2.0), progress=2)
    store.confirm(lambda mine: 1)  # another rank of the group has not finished step 2: keep step 1
    assert sorted(s[2] for s in node_memory.snapshots(memory / "run-a")) == [1, 2]
    taken(store, rank_state(3.0), progress=3)
    store.confirm(lambda mine: mine)
    assert [s[2] for s in node_memory.snapshots(memory / "run-a")] == [3]


def test_a_heal_is_served_from_the_snapshot_only_for_the_state_it_holds():
    store = NodeState("run-a", replica=0, rank=0, every_steps=1)
    taken(store, rank_state(), progress=4, version=9)
    served = store.matching(version=9, timeout_s=1.0)
    assert served is not None and served.header["step"] == 4 and set(served.header) == {"step", "spec", "leaves", "nbytes"}
    assert store.matching(version=10, timeout_s=0.1) is None, "the trainer's state moved on: a fresh copy is served"


def test_the_schedule_is_the_same_on_every_rank_and_rounds_up_to_a_diloco_sync():
    assert [s for s in range(1, 31) if NodeState("r", 0, 0, every_steps=10).due(s, committed=True)] == [10, 20, 30]
    assert NodeState("r", 0, 0, every_steps=7, unit_steps=5).every == 10
    assert not NodeState("r", 0, 0, every_steps=10).due(10, committed=False)
    assert NodeState("r", 0, 0, every_steps=0).every == 0
