"""A slot's state table: the moves it refuses, the invariants it checks, the one thread it
allows, and that nothing changes a slot's state or generation except `Slot.enter`."""

from __future__ import annotations

import ast
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from monarch_sky.control.checkpoint_loads import CheckpointLoads
from monarch_sky.control.context import RunContext
from monarch_sky.control.slot import Slot
from monarch_sky.control.slot_state import TABLE, IllegalMove, SlotState

S = SlotState
PACKAGE = Path(__file__).resolve().parents[2] / "monarch_sky"


def slot() -> Slot:
    ctx = RunContext(cfg=None, provider=None, record=None, tracker=None, display=None, platform=None)
    ctx.loop_thread = threading.get_ident()
    ctx.checkpoints = SimpleNamespace(loads=CheckpointLoads(record=None))
    return Slot(ctx, 0, hosts=[], host_mesh=None)


def test_every_state_has_a_row_and_only_lost_and_done_end_a_slot():
    assert set(TABLE) == set(SlotState)
    assert {s for s, (moves, _) in TABLE.items() if not moves} == {S.DONE, S.LOST}
    for state, (moves, holds) in TABLE.items():
        assert moves <= set(SlotState) and state not in moves and holds


def test_a_recovery_goes_through_rejoining_and_a_generation_is_attached_exactly_where_the_table_says():
    s, group = slot(), object()
    s.enter(S.TRAINING, group)
    s.enter(S.RECOVERING, None)
    with pytest.raises(IllegalMove, match="recovering -> training"):
        s.enter(S.TRAINING, group)  # a new generation rejoins before it trains
    with pytest.raises(IllegalMove, match="missing"):
        s.enter(S.REJOINING)  # no generation was attached
    s.enter(S.REJOINING, object())
    with pytest.raises(IllegalMove, match="attached"):
        s.enter(S.LOST)  # losing a slot detaches its generation
    s.enter(S.TRAINING)
    s.enter(S.DONE)
    assert s.state is S.DONE and s.group is not None
    with pytest.raises(IllegalMove, match="done -> recovering"):
        s.enter(S.RECOVERING, None)  # a finished group is never recovered


def test_a_generation_detached_no_longer_counts_as_holding_the_checkpoint_it_loaded():
    s, found = slot(), SimpleNamespace(step=10)
    loads = s.ctx.checkpoints.loads
    loads.begin(found, 0)
    loads.loaded(found, 0)
    s.enter(S.TRAINING, object())
    assert loads.holders(10) == {0}
    s.enter(S.RECOVERING, None)
    assert loads.holders(10) == set(), "a later group would heal from a generation that is gone"


def test_a_refused_move_changes_nothing():
    s, group = slot(), object()
    s.enter(S.TRAINING, group)
    with pytest.raises(IllegalMove):
        s.enter(S.RECOVERING, object())
    assert s.state is S.TRAINING and s.group is group


def test_a_slot_changes_only_on_the_controller_loops_thread():
    s, errors = slot(), []

    def elsewhere():
        try:
            s.enter(S.TRAINING, object())
        except IllegalMove as e:
            errors.append(str(e))

    t = threading.Thread(target=elsewhere)
    t.start()
    t.join(5)
    assert errors and "event loop" in errors[0] and s.state is S.STARTING


def assigned_attributes(tree: ast.AST):
    """(function name, attribute) of every `x.state = ...` / `x.group = ...` in a module."""
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and t.attr in ("state", "group"):
                        yield func.name, ast.unparse(t)


def test_only_enter_changes_a_slots_state_or_generation():
    slot_code = ast.parse((PACKAGE / "control" / "slot.py").read_text())
    writers = {(name, attr) for name, attr in assigned_attributes(slot_code) if name != "__init__"}
    assert writers == {("enter", "self.state"), ("enter", "self.group")}
    mixin = ast.parse((PACKAGE / "control" / "slot_recovery.py").read_text())  # Slot's recovery half
    assert not list(assigned_attributes(mixin)), "slot_recovery.py writes a slot's state or generation"
    for path in PACKAGE.rglob("*.py"):  # nobody else writes a slot's
        if path.name not in ("slot.py", "slot_recovery.py"):
            hits = [a for _, a in assigned_attributes(ast.parse(path.read_text())) if a.split(".")[0] in ("slot", "s")]
            assert not hits, f"{path.name} writes {hits}"
