"""A slot's states, the moves between them, and what holds in each: the one table.

    STARTING -> TRAINING -> RECOVERING -> REJOINING -> TRAINING ... -> DONE
         \\ \\                    \\             \\-> RECOVERING (failed again)
          \\ \\-> LOST             \\-> LOST (no restart or host left, or the run ended)
           \\-> REJOINING (the run goes on from node memory its hosts do not hold: it heals first)

Every change goes through `Slot.enter`, which refuses a move the table does not list and
checks the new state's invariant, so a slot can never sit in a state its fields contradict
(a recovery with a generation still attached, a training slot with none).

One queue of events: a slot's state changes only on the controller's event loop, from its
own `drive` task (or the controller's start and end, when no `drive` runs). Events from
elsewhere reach that loop before they touch a slot:
- a failure report from Monarch supervision (its own thread): `loop.call_soon_threadsafe`;
- a provider's answer (a blocking call in a thread): a future settled through the loop
  (`context.off_loop`);
- the watchdog's host probes, the host agents' exit reports and the hang check run as tasks
  on the loop;
- step results and finished builds are awaited by the `drive` task itself.
A detector only marks the generation failed (`Slot.on_failure`); the `drive` task sees that
(the step call it awaits raises) and makes the move. `enter` refuses a change from any
other thread.
"""

from __future__ import annotations

import enum
import threading


class SlotState(enum.Enum):
    STARTING = "starting"
    TRAINING = "training"
    RECOVERING = "recovering"
    REJOINING = "rejoining"  # a new generation trains but has not committed with the others yet
    DONE = "done"
    LOST = "lost"


S = SlotState

# state -> (the states it may move to, what holds while in it)
TABLE: dict[SlotState, tuple[frozenset[SlotState], str]] = {
    S.STARTING: (frozenset({S.TRAINING, S.REJOINING, S.LOST}),
                 "the first generation is being built: no generation attached, no step asked"),
    S.TRAINING: (frozenset({S.RECOVERING, S.DONE, S.LOST}),
                 "a generation is attached and has committed with the others (or is the first one)"),
    S.RECOVERING: (frozenset({S.REJOINING, S.LOST}),
                   "no generation attached: the broken one is being ended and the next one built"),
    S.REJOINING: (frozenset({S.TRAINING, S.RECOVERING, S.DONE, S.LOST}),
                  "a new generation is attached and has not committed at the run's step yet"),
    S.DONE: (frozenset(),
             "the generation reached the run's last step; it stays attached for its final state"),
    S.LOST: (frozenset(),
             "no generation attached, and none will come: the run goes on without this group"),
}

ATTACHED = frozenset({S.TRAINING, S.REJOINING, S.DONE})  # the states with a generation


class IllegalMove(RuntimeError):
    """A slot was asked to make a move its state table does not allow: a controller bug."""


def check_move(index: int, old: SlotState, new: SlotState) -> None:
    if new not in TABLE[old][0]:
        raise IllegalMove(f"replica {index}: {old.value} -> {new.value} is not a move a slot makes")


def check_invariant(index: int, state: SlotState, has_group: bool) -> None:
    if has_group != (state in ATTACHED):
        raise IllegalMove(f"replica {index}: in {state.value} {TABLE[state][1]}, "
                          f"but a generation is {'attached' if has_group else 'missing'}")


def check_thread(index: int, loop_thread: int | None) -> None:
    """Refuse a change from any thread but the controller's event loop's (`loop_thread`)."""
    if loop_thread is not None and threading.get_ident() != loop_thread:
        raise IllegalMove(f"replica {index}: a slot's state changes only on the controller's event loop")
