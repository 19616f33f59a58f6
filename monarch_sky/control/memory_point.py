"""Where a run goes on from in node memory: the newest step some group's hosts hold whole.

`choose` reads what each host holds (`monarch_sky.common.node_memory.listing`: the ranks'
snapshots and the controller's notes) and returns a `MemoryPoint`: the step, the groups whose
own hosts hold every rank of it (they load it at setup; the others heal from them), and every
group's data position there. Pure: `monarch_sky.control.memory_restore` asks the hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class MemoryPoint:
    """Where a run goes on from node memory."""

    step: int
    loaders: tuple[int, ...]  # slots whose own hosts hold every rank's snapshot at `step`
    data_states: dict[int, tuple]  # per slot, its ranks' data positions at `step`
    skip_steps: dict[int, int] = field(default_factory=dict)  # per slot: steps after its position (an older note)
    estimated: tuple[int, ...] = ()  # slots whose position at `step` is not known exactly
    hosts: tuple[str, ...] = ()  # where the loaders read it
    run_note: dict = field(default_factory=dict)  # the newest run note: run_step, faults_fired
    epoch: int = 0  # the newest controller epoch any host was claimed by


def snapshot_every(cfg) -> int:
    """The trainers' snapshot interval in run steps (`TrainerSnapshots`: DiLoCo rounds up to a sync)."""
    unit = cfg.ft.sync_steps if cfg.ft.mode == "diloco" else 1
    every = cfg.snapshot.every_steps
    return max(1, -(-every // unit)) * unit if every > 0 else 0


def choose(listings: dict[str, dict], slot_hosts: dict[int, list[str]], procs: int, target: int) -> MemoryPoint | None:
    """The newest step below `target` some slot's hosts hold whole (rank r on the slot's host
    r // procs), with every slot's data position there. `listings`: host address ->
    `node_memory.listing`. (A snapshot at the target is of a run that ended; the one before it
    is trained on to the target again, so every group ends with it.)"""
    held = {host: {(s["rank"], s["step"]) for s in listing["snapshots"]} for host, listing in listings.items()}

    def whole(hosts: list[str], step: int) -> bool:
        return all((r, step) in held.get(hosts[r // procs], ()) for r in range(procs * len(hosts)))

    steps = sorted({s["step"] for listing in listings.values() for s in listing["snapshots"] if s["step"] < target},
                   reverse=True)
    for step in steps:
        loaders = tuple(i for i, hosts in slot_hosts.items() if whole(hosts, step))
        if loaders:
            break
    else:
        return None
    notes = {s: n for listing in listings.values() for s, n in listing["notes"].items() if n}
    runs = [listing["run"] for listing in listings.values() if listing.get("run")]
    point = MemoryPoint(step, loaders, {}, hosts=tuple(h for i in loaders for h in slot_hosts[i]),
                        run_note=max(runs, key=lambda n: n.get("run_step", 0), default={}),
                        epoch=max((listing.get("epoch", 0) for listing in listings.values()), default=0))
    for slot, hosts in slot_hosts.items():
        _place(point, slot, procs * len(hosts), notes, listings)
    return point


def _place(point: MemoryPoint, slot: int, ranks: int, notes: dict, listings: dict) -> None:
    """Slot's data position at the point's step: the note of that step, else its own ranks'
    snapshots there, else an older note and the steps since (an estimate, said so)."""
    note = notes.get(point.step)
    if note is not None and str(slot) in note["data_states"]:
        point.data_states[slot] = tuple(note["data_states"][str(slot)])
        point.skip_steps[slot] = note.get("skip_steps", {}).get(str(slot), 0)
        return
    own = {s["rank"]: s["data_state"] for listing in listings.values() for s in listing["snapshots"]
           if s["group"] == slot and s["step"] == point.step}
    if len(own) == ranks:
        point.data_states[slot] = tuple(own[r] for r in range(ranks))
        return
    older = max((s for s, n in notes.items() if s < point.step and str(slot) in n["data_states"]), default=None)
    point.data_states[slot] = tuple(notes[older]["data_states"][str(slot)]) if older is not None else ()
    point.skip_steps[slot] = point.step - (older or 0)
    point.estimated += (slot,)
