"""Fault injection's spec: `KIND@STEP:REPLICA` (`monarch_sky/replica/fault_actor.py` carries faults out).

`faults=kill@20:1,segfault@40:0` injects a SIGKILL into one trainer process of replica 1
once the run has committed 20 steps, and a segfault into replica 0 at step 40;
`host@30:2` takes down the whole host of replica 2 (the host provider does that one).

A compound fault aims at a recovery in progress instead of a step: `kill@20:1,host@rejoin:1`
kills replica 1 at step 20, then takes down the host of its new generation while that one
heals from a peer (its first step back, before it has committed with the others). Each
`@rejoin` fault fires at one rejoin of its replica, in order, so `kill@rejoin:1` twice more
fails three generations in a row. `kill@20:2,kill@serve:0` kills replica 2 at step 20, then
kills replica 0 while it sends replica 2 its state (a source lost mid-heal; process kinds only).
The syntax is stable: other tooling writes it.

`controller@STEP` (no replica) SIGKILLs the controller itself once the run reaches STEP; its
hosts and trainers live on, as when the controller's node dies. Running the same run_id again
resumes from the newest checkpoint. Each scheduled fault fires once per run id: a restarted
controller skips those an earlier one fired (read from the run record).
"""

from __future__ import annotations

from dataclasses import dataclass

# Kinds this build can inject. Each kind names what a user would see fail.
KINDS = {
    "kill": "SIGKILL of one trainer process of the replica",
    "segfault": "segmentation fault in one trainer process of the replica",
    "comms": "abort of one trainer's cross-group process group mid-step (the process lives)",
    "hang": "one trainer holds the GIL in a native sleep, as a deadlock does (sockets stay open)",
    "stop": "one trainer process is frozen (SIGSTOP), like a GPU hang or a swapped-out host",
    "host": "loss of the replica's whole host (its worker loop and every process on it)",
}
CONTROLLER = "controller"  # not a replica's fault: `controller@STEP`, and never drawn by chaos
PROCESS_KINDS = ("kill", "segfault", "comms", "hang", "stop")  # injected by the FaultActor inside the group
# Recovery phases a fault can aim at in place of a step.
REJOIN = "rejoin"
SERVE = "serve"
PHASES = {
    REJOIN: "the replica's new generation, in its first step back (the heal), before it commits with the others",
    SERVE: "the replica while it serves another group's heal: each of its processes as it begins to send",
}


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int  # the run step it is due at; for a phase fault, the step it fired at (0 before)
    replica: int | None  # None: the controller
    during: str = ""  # a recovery phase (PHASES) to aim at instead of a step

    def __str__(self) -> str:
        if self.kind == CONTROLLER:
            return f"{CONTROLLER}@{self.step}"
        return f"{self.kind}@{self.during or self.step}:{self.replica}"


def parse_faults(spec: str | None) -> list[Fault]:
    """Parse `KIND@STEP:REPLICA[,...]` (STEP may be a phase, e.g. `rejoin`); empty or "none"
    means no faults."""
    if spec is None or str(spec).strip().lower() in ("", "none"):
        return []
    faults = [_parse_one(part.strip()) for part in str(spec).split(",")]
    return sorted(faults, key=lambda f: (bool(f.during), f.step))  # phase faults after, in their order


def _parse_one(text: str) -> Fault:
    if text.startswith(f"{CONTROLLER}@"):
        return _parse_controller(text)
    usage = f"'{text}' is not KIND@STEP:REPLICA (for example kill@20:1, or kill@rejoin:1)"
    kind, at, rest = text.partition("@")
    step, colon, replica = rest.partition(":")
    if not (at and colon and kind and step and replica):
        raise FaultSpecError(usage)
    if kind not in KINDS:
        raise FaultSpecError(f"unknown fault kind '{kind}' in '{text}'; allowed: {', '.join(KINDS)}, {CONTROLLER}")
    during = step if step in PHASES else ""
    try:
        step_n, replica_n = 0 if during else int(step), int(replica)
    except ValueError:
        raise FaultSpecError(f"{usage}: STEP and REPLICA must be integers (STEP may also be a "
                             f"phase: {', '.join(PHASES)})") from None
    if not during and step_n < 1:
        raise FaultSpecError(f"fault step must be >= 1 in '{text}'")
    if replica_n < 0:
        raise FaultSpecError(f"fault replica must be >= 0 in '{text}'")
    return Fault(kind, step_n, replica_n, during)


def _parse_controller(text: str) -> Fault:
    step = text.partition("@")[2]
    if not step.isdigit() or int(step) < 1:
        raise FaultSpecError(f"'{text}' is not {CONTROLLER}@STEP with STEP >= 1 (for example {CONTROLLER}@40; "
                             "it takes no replica)")
    return Fault(CONTROLLER, int(step), None)


def check_faults(faults: list[Fault], replicas: int, steps: int) -> None:
    for fault in faults:
        if fault.replica is not None and fault.replica >= replicas:
            raise FaultSpecError(
                f"fault '{fault}' targets replica {fault.replica}, but replicas are "
                f"0..{replicas - 1} (replicas={replicas})"
            )
        if not fault.during and fault.step >= steps:
            raise FaultSpecError(
                f"fault '{fault}' is at step {fault.step}, but the run stops at step {steps} "
                f"(steps={steps}); pick a step below {steps}"
            )

