"""How a run ended, as an exit code and words: the one place that judges a run.

A run is `ok` (exit 0) only if it reached its target steps and every replica group ended
with the same parameter digest. Anything less says what went wrong:

| exit | status     | meaning |
|------|------------|---------|
| 0    | ok         | target reached; every group finished with equal digests |
| 1    | incomplete | the target was not reached |
| 1    | failed     | the controller failed (the reason is in the summary) |
| 2    | refused    | config error: nothing was started, or nothing trained because the run id's state |
|      |            | in node memory was saved under another shape or settings (the message names them) |
| 3    | degraded   | target reached, but a group was lost, its final state could not be read, or
|      |            | every group holding the training state failed at once with no checkpoint to |
|      |            | load (training restarted from scratch) |
| 4    | diverged   | target reached, but the groups' final digests differ |
| 5    | superseded | a newer controller of the run took it over (this one's node was cut off) |
| 128+N| stopped    | stopped by signal N (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP) |
"""

from __future__ import annotations

from typing import Any

from monarch_sky.config import EXIT_CONFIG

EXIT_OK = 0
EXIT_INCOMPLETE = 1
EXIT_REFUSED = EXIT_CONFIG  # what a config error found before anything started exits with
EXIT_DEGRADED = 3
EXIT_DIVERGED = 4
EXIT_SUPERSEDED = 5


def judge(summary: dict[str, Any]) -> dict[str, Any]:
    """`{"exit_code", "status", "reasons"}` for a finished run's summary."""
    if summary["committed_steps"] < summary["target_steps"]:
        reasons = [f"committed {summary['committed_steps']} of {summary['target_steps']} steps"]
        return _outcome(EXIT_INCOMPLETE, "incomplete", reasons)
    digests = summary["final_param_digest"]
    if len(set(digests.values())) > 1:
        return _outcome(EXIT_DIVERGED, "diverged", [f"final digests differ: {_short(digests)}"])
    reasons = [f"replica {lost['replica']} was lost: {lost['reason']}" for lost in summary["lost_replicas"]]
    reasons += [  # one that went back to node memory or a checkpoint lost a bounded stretch: not degraded
        f"training state lost at step {p['at_step']} (every group holding it failed); restarted at step {p['restarted_at_step']}"
        for p in summary.get("progress_lost", []) if not p.get("from_checkpoint") and not p.get("from_memory")
    ]
    reasons += [
        f"replica {replica}: final state unreadable: {reason}"
        for replica, reason in summary["final_state_errors"].items()
    ]
    if reasons or not digests:
        return _outcome(EXIT_DEGRADED, "degraded", reasons or ["no group reported a final state"])
    return _outcome(EXIT_OK, "ok", [])


def stopped(signal_name: str, signal_number: int) -> dict[str, Any]:
    return _outcome(128 + signal_number, "stopped", [f"stopped by {signal_name}"])


def failed(error: str) -> dict[str, Any]:
    return _outcome(EXIT_INCOMPLETE, "failed", [error])


def refused(error: str) -> dict[str, Any]:
    return _outcome(EXIT_REFUSED, "refused", [error])


def resumable(summary: dict[str, Any]) -> bool:
    """A run that did not reach its target (stopped, failed, incomplete) may be started
    again under the same run id; one that did has nothing left to train."""
    return (summary.get("outcome") or {}).get("status") in ("stopped", "failed", "incomplete", "refused")


def _outcome(code: int, status: str, reasons: list[str]) -> dict[str, Any]:
    return {"exit_code": code, "status": status, "reasons": reasons}


def _short(digests: dict[str, str]) -> str:
    return ", ".join(f"{k}:{v[:10]}" for k, v in sorted(digests.items()))
