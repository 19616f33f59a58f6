"""The fault injector: when a random fault still has time to heal, and where one aimed at a recovery goes."""

from __future__ import annotations

from monarch_sky.faults.injector import FaultInjector, FaultRecord
from monarch_sky.faults.schedule import FIRST_HEAL_S, once_per_run, too_late
from monarch_sky.faults.spec import Fault, parse_faults
from monarch_sky.replica.step_result import StepResult


class Quiet:
    def event(self, *a, **k):
        pass

    def line(self, *a, **k):
        pass

    def note(self, *a, **k):
        pass


def injector() -> FaultInjector:
    return FaultInjector([], seed=0, ranks_per_replica=2, record=Quiet(), display=Quiet(), tracker=Quiet())


def test_a_fault_near_the_end_of_a_fast_run_is_too_late_although_outside_the_last_tenth():
    # The case `make chaos` once hit: a host fault at step 179 of 200, at 0.15 s a step.
    assert too_late(179, 200, time_left_s=21 * 0.15, heal_s=FIRST_HEAL_S["host"])
    assert not too_late(100, 200, time_left_s=100 * 0.5, heal_s=FIRST_HEAL_S["host"])
    assert too_late(180, 200, time_left_s=1e9, heal_s=1.0), "the last tenth gets none, however slow"


def test_the_allowance_follows_the_slowest_heal_of_the_kind_seen_so_far():
    inj = injector()
    assert inj.heal_allowance_s("host") == FIRST_HEAL_S["host"]
    assert inj.heal_allowance_s("kill") == FIRST_HEAL_S["process"]
    for seconds in (12.0, 20.0):
        inj.records.append(FaultRecord(Fault("host", 10, 1), None, injected_at=100.0, generation=0,
                                       rejoined_at=100.0 + seconds))
    inj.records.append(FaultRecord(Fault("host", 20, 1), None, injected_at=200.0, generation=1))  # not healed yet
    assert inj.heal_allowance_s("host") == 1.5 * 20.0
    assert inj.heal_allowance_s("kill") == FIRST_HEAL_S["process"]


def test_a_draw_aimed_at_recovery_arms_one_rejoin_fault_per_recovering_group():
    class Slot:
        def __init__(self, index):
            self.index = index

    inj = injector()
    assert not inj.aim_at_recovery("kill", 1, [], run_step=5), "nobody recovering: the draw goes the usual way"
    assert inj.aim_at_recovery("host", 2, [Slot(0), Slot(2)], run_step=5)
    assert inj.aim_at_recovery("kill", 2, [Slot(0), Slot(2)], run_step=6), "2 is armed: the other recovering group"
    assert inj.pending == [Fault("host", 0, 2, "rejoin"), Fault("kill", 0, 0, "rejoin")]
    assert not inj.aim_at_recovery("kill", 0, [Slot(0), Slot(2)], run_step=7), "both armed already"


def test_a_rejoin_heals_the_faults_of_earlier_generations_not_one_aimed_at_itself():
    inj = injector()
    earlier = FaultRecord(Fault("kill", 10, 1), 0, injected_at=100.0, generation=0)
    at_heal = FaultRecord(Fault("kill", 12, 1, "rejoin"), 0, injected_at=106.0, generation=1)  # lands after the commit
    inj.records += [earlier, at_heal]
    assert inj.rejoined(1, generation=1, source="peer", now=105.9) == [earlier]
    assert inj.open_faults(1) == [at_heal], "its death is still a planned failure, not an unplanned one"


def test_a_restarted_controller_skips_each_scheduled_fault_an_earlier_one_fired_and_only_as_often():
    faults = parse_faults("kill@5:1,controller@9,kill@rejoin:1,kill@rejoin:1,host@20:0")
    fired = ["kill@5:1", "kill@rejoin:1", "controller@9"]
    assert once_per_run(faults, fired) == parse_faults("kill@rejoin:1,host@20:0")
    assert once_per_run(faults, []) == faults


def step(replica: int, committed: bool) -> StepResult:
    return StepResult(replica=replica, step=1, committed=committed, synced=committed, loss=1.0, tokens=1,
                      participants=2, healed=False, healed_now=False, seconds=0.3)


def test_a_comms_fault_that_fails_no_step_is_absorbed_after_two_quiet_commits_and_one_that_fails_is_detected():
    # The `make chaos` case: another group's failure changed the quorum, and TorchFT replaced
    # the aborted process group before any collective used it: the fault stayed open forever.
    inj = injector()
    absorbed = FaultRecord(Fault("comms", 10, 1), 0, injected_at=100.0, generation=0)
    inj.records.append(absorbed)
    assert inj.same_generation_result(step(1, True), 0, issued=99.9, now=100.2) == []  # begun before it
    inj.same_generation_result(step(1, True), 0, issued=100.3, now=100.6)
    assert absorbed.recovered_from is None, "one quiet commit: the abort may not have landed yet"
    inj.same_generation_result(step(1, True), 0, issued=100.7, now=101.0)
    assert (absorbed.recovered_from, absorbed.detected_at, absorbed.rejoined_at) == ("in place", None, 101.0)

    landed = FaultRecord(Fault("comms", 20, 2), 0, injected_at=200.0, generation=0)
    inj.records.append(landed)
    inj.same_generation_result(step(2, False), 0, issued=200.1, now=200.4)
    assert inj.same_generation_result(step(2, True), 0, issued=200.5, now=200.9) == [landed]
    assert (landed.detected_at, landed.recovered_from) == (200.4, "in place")


def test_a_serve_fault_waits_for_a_rejoin_it_can_serve_and_goes_to_its_own_group():
    class Group:
        generation = 3

        def __init__(self):
            self.armed = []

        def inject_when_serving(self, kind):
            self.armed.append(kind)

    class Slot:
        def __init__(self):
            self.group = Group()

    inj = injector()
    inj.pending = parse_faults("kill@20:2,kill@serve:0")[1:]
    serving = {0: Slot(), 1: Slot()}
    inj.fire_serving(0, run_step=21, training={1: serving[1]})
    assert inj.pending and not serving[1].group.armed, "replica 0 is the one rejoining (or not training): not yet"
    inj.fire_serving(2, run_step=22, training=serving)
    assert serving[0].group.armed == ["kill"] and not serving[1].group.armed and not inj.pending
    [rec] = inj.records
    assert (rec.fault.replica, rec.fault.during, rec.generation) == (0, "serve", 3)
