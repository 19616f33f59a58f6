"""Where a run goes on from node memory: the newest step some group's hosts hold whole, every
group's data position there, and the fence that keeps an older controller out."""

from __future__ import annotations

from monarch_sky.common import node_memory
from monarch_sky.control.memory_point import choose, snapshot_every


def held(*snapshots, notes=None, run=None, epoch=0) -> dict:
    """A host's `node_memory.listing`: snapshots as (group, rank, step)."""
    return {"snapshots": [{"group": g, "rank": r, "step": s, "data_state": {"at": [g, r, s]}, "bytes": 1}
                          for g, r, s in snapshots],
            "notes": notes or {}, "run": run, "epoch": epoch}


def test_the_newest_step_one_groups_hosts_hold_whole_is_where_the_run_goes_on():
    listings = {
        "h0": held((0, 0, 10), (0, 1, 10), (0, 0, 20)),  # rank 1's step 20 never finished here
        "h1": held((1, 0, 10), (1, 1, 10), (1, 0, 20), (1, 1, 20)),
    }
    point = choose(listings, {0: ["h0"], 1: ["h1"]}, procs=2, target=100)
    assert point.step == 20 and point.loaders == (1,)
    assert point.hosts == ("h1",)


def test_a_group_spanning_hosts_needs_each_rank_on_its_own_host():
    listings = {"a": held((0, 0, 10), (0, 1, 10)), "b": held((0, 2, 10), (0, 3, 10))}
    assert choose(listings, {0: ["a", "b"]}, procs=2, target=100).loaders == (0,)
    assert choose(listings, {0: ["b", "a"]}, procs=2, target=100) is None, "ranks 0-1 live on the first host"


def test_every_group_goes_on_from_its_own_data_position():
    note = {"step": 20, "data_states": {"0": [{"n": 0}], "1": [{"n": 1}]}, "skip_steps": {"1": 2}}
    listings = {"h0": held((0, 0, 20), notes={20: note}), "h1": held()}
    point = choose(listings, {0: ["h0"], 1: ["h1"]}, procs=1, target=100)
    assert point.data_states == {0: ({"n": 0},), 1: ({"n": 1},)} and point.skip_steps == {0: 0, 1: 2}
    assert point.estimated == ()


def test_without_the_note_a_group_reads_on_from_its_own_snapshot_or_an_older_note_plus_the_steps_since():
    older = {"step": 10, "data_states": {"1": [{"n": 10}]}}
    listings = {"h0": held((0, 0, 20)), "h1": held(notes={10: older})}
    point = choose(listings, {0: ["h0"], 1: ["h1"]}, procs=1, target=100)
    assert point.data_states[0] == ({"at": [0, 0, 20]},), "group 0's own rank snapshot says where it was"
    assert point.data_states[1] == ({"n": 10},) and point.skip_steps[1] == 10
    assert point.estimated == (1,), "an estimate is said to be one"


def test_a_snapshot_at_the_target_is_of_a_run_that_ended():
    listings = {"h0": held((0, 0, 30), (0, 0, 40))}
    assert choose(listings, {0: ["h0"]}, procs=1, target=40).step == 30
    assert choose({"h0": held()}, {0: ["h0"]}, procs=1, target=40) is None


def test_the_controller_mirrors_the_trainers_snapshot_steps():
    class Cfg:
        class ft:
            mode, sync_steps = "diloco", 5

        class snapshot:
            every_steps = 7

    assert snapshot_every(Cfg) == 10
    Cfg.ft.mode = "step"
    assert snapshot_every(Cfg) == 7


def test_a_newer_controller_fences_an_older_one_out(tmp_path, monkeypatch):
    monkeypatch.setenv(node_memory.ROOT_ENV, str(tmp_path))
    assert node_memory.claim("run", 2, "a") == (2, "a")
    assert node_memory.claim("run", 1, "b") == (2, "a"), "the older controller is told who holds the host"
    assert node_memory.claim("run", 3, "b") == (3, "b")
    assert node_memory.claim("run", 3, "b") == (3, "b"), "a controller's own claim stands again"
    for step in (10, 20, 30, 40):
        node_memory.write_note("run", step, {"step": step, "data_states": {"0": [{"b": b"\xff"}]}})
    listing = node_memory.listing("run")
    assert sorted(listing["notes"]) == [20, 30, 40] and listing["epoch"] == 3
    assert listing["notes"][40]["data_states"]["0"] == [{"b": b"\xff"}]
    assert node_memory.drop_run("run") > 0 and node_memory.listing("run")["notes"] == {}


def test_two_controllers_that_count_the_same_epoch_never_both_hold_a_node(tmp_path, monkeypatch):
    # Two standbys woke at once, read the same epochs and claim with the same one: the owner
    # token orders them, so after the race one claim holds and every other is refused at its
    # next note, whatever order the claims landed in.
    import threading

    monkeypatch.setenv(node_memory.ROOT_ENV, str(tmp_path))
    owners = [f"standby-{i}" for i in range(8)]
    start = threading.Barrier(len(owners))

    def claim(owner):
        start.wait()
        node_memory.claim("run", 4, owner)

    threads = [threading.Thread(target=claim, args=(o,)) for o in owners]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    standing = [o for o in owners if node_memory.claim("run", 4, o) == (4, o)]
    assert len(standing) == 1, standing
    assert node_memory.read_claim("run") == (4, standing[0])
    assert node_memory.claim("run", 3, "zzz") == (4, standing[0]), "an older epoch never wins on its token"
