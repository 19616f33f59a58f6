"""The step ledger and the run record stay bounded however long the run."""

from __future__ import annotations

import json

from monarch_sky.control.ledger import QUORUM_HISTORY, StatusCounts, StepLedger
from monarch_sky.record.tracking import STEPS_TAIL_BYTES, previous_attempt
from monarch_sky.replica.step_result import StepResult


class Sink:
    def __init__(self):
        self.logged = []

    def step(self, *args):
        pass

    def event(self, *args, **kwargs):
        pass

    def log(self, metrics, step):
        self.logged.append((step, metrics.get("loss")))

    def status(self, *args):
        pass


def result(replica: int, step: int, loss: float, quorum: tuple = ()) -> StepResult:
    return StepResult(replica=replica, step=step, committed=True, synced=True, loss=loss, tokens=10, participants=2,
                      healed=False, healed_now=False, seconds=0.01, quorum=quorum)


def test_the_ledger_keeps_only_the_steps_it_has_not_logged():
    sink = Sink()
    ledger = StepLedger(10_000, sink, sink, sink, lambda: StatusCounts(2, 2, 0, 0))
    members = ("replica_0:a", "replica_1:b")
    for step in range(1, 10_001):
        for replica in (0, 1):
            ledger.add(result(replica, step, loss=10.0 - step / 1000, quorum=members), now=step)
    ledger.add(result(1, 5, loss=99.0, quorum=members[1:]), now=10_001)  # a late group's old step
    ledger.flush(final=True)
    assert len(ledger.steps) <= 2, len(ledger.steps)
    assert len(ledger.quorums) == QUORUM_HISTORY and ledger.quorums[10_000] == members
    assert ledger.quorums[5] == members[1:], "the latest commit of a step number counts"
    assert [s for s, _ in sink.logged] == list(range(1, 10_001)), "every step logged once, in order"
    assert ledger.first_and_last_loss() == {"first": 9.999, "last": 0.0}


def test_a_rewind_to_a_checkpoint_trains_steps_again_but_logs_each_step_once():
    sink = Sink()
    ledger = StepLedger(40, sink, sink, sink, lambda: StatusCounts(2, 2, 0, 0))
    for step in range(1, 31):
        ledger.add(result(0, step, loss=1.0), now=step)
    ledger.rewind(23)  # every group failed at 30; the checkpoint is at 23
    assert ledger.run_step == 23
    for step in range(24, 41):
        ledger.add(result(0, step, loss=2.0), now=100 + step)
    ledger.flush(final=True)
    assert [s for s, _ in sink.logged] == list(range(1, 41)), "W&B's step only grows"
    assert sink.logged[30] == (31, 2.0) and ledger.run_step == 40


def test_a_restart_reads_only_the_end_of_a_long_steps_file(tmp_path):
    run = tmp_path / "r1"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"event": "run_started"}) + "\n")
    line = json.dumps({"replica": 0, "step": 0, "committed": True, "pad": "x" * 100})
    with (run / "steps.jsonl").open("w") as f:
        for step in range(1, 3 * STEPS_TAIL_BYTES // len(line)):
            f.write(line.replace('"step": 0', f'"step": {step}') + "\n")
        f.write('{"replica": 0, "st')  # cut off by the controller's death
    previous = previous_attempt(str(tmp_path), "r1")
    assert previous["last_step"] == step and previous["ended"] == "controller lost"
