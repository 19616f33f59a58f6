"""What the user sees: a live status line, one line per fault and recovery, a summary table."""

from __future__ import annotations

import logging
import shutil
import sys
import time
from collections import deque
from typing import Any, TextIO


LOG_EVERY_S = 30.0  # off a terminal (sky logs, CI, a file): a progress line this often
# What the user is shown, for the run's controller.log only (run.py attaches the file to it).
STORY = logging.getLogger("monarch_sky.display")
STORY.propagate = False


class Display:
    def __init__(self, target_steps: int, stream: TextIO = sys.stdout, log_every_s: float = LOG_EVERY_S, clock=time.monotonic):
        self.target = target_steps
        self.stream = stream
        self.live = stream.isatty()
        self.log_every_s = log_every_s
        self._next_log = 0.0
        self._status = ""
        self._rate = StepRate()
        self._clock = clock

    def line(self, text: str) -> None:
        STORY.info(text)
        self._clear()
        print(text, file=self.stream, flush=True)
        self._redraw()

    def status(
        self,
        step: int,
        loss: float | None,
        tokens_per_s: float,
        quorum: int,
        replicas: int,
        training: int,
        faults: int,
        recovered: int,
    ) -> None:
        now = self._clock()
        per_s = self._rate.add(step, now)
        loss_text = f"{loss:7.4f}" if loss is not None else "   n/a "
        text = (
            f"step {step:>5}/{self.target}{' ' + _bar(step, self.target) if self.live else ''}  loss {loss_text}  "
            f"{per_s:5.2f} step/s  eta {_duration(eta_s(step, self.target, per_s))}  {tokens_per_s:8.0f} tok/s  "
            f"quorum {quorum}/{replicas}  training {training}/{replicas}  faults {faults}  recovered {recovered}"
        )
        due = now >= self._next_log or step >= self.target
        if due:
            self._next_log = now + self.log_every_s
            STORY.info(text)
        if self.live:
            self._status = text
            self._redraw()
        elif due:
            print(text, file=self.stream, flush=True)

    def _clear(self) -> None:
        if self.live and self._status:
            width = shutil.get_terminal_size().columns
            self.stream.write("\r" + " " * min(len(self._status), width - 1) + "\r")

    def _redraw(self) -> None:
        if self.live and self._status:
            width = shutil.get_terminal_size().columns
            self.stream.write("\r" + self._status[: width - 1])
            self.stream.flush()

    def finish(self, summary: dict[str, Any], record_path: str, tracker_mode: str, wandb_location: str | None) -> None:
        self._clear()
        self._status = ""
        STORY.info(format_summary(summary))
        print(format_summary(summary), file=self.stream)
        print(f"run record: {record_path}/ (summary.json, events.jsonl, controller.log, config.yaml)", file=self.stream)
        print(_wandb_line(tracker_mode, wandb_location), file=self.stream, flush=True)


def _wandb_line(mode: str, location: str | None) -> str:
    if mode == "online" and location:
        return f"W&B (online): {location}"
    if mode == "offline" and location:
        return f"W&B (offline): {location}; upload it with `wandb sync {location}`"
    return f"W&B: {mode if mode == 'disabled' else 'off (see the warning above)'}"


class StepRate:
    """Committed steps per second over the last minute (a heal or a stall shows up in it)."""

    WINDOW_S = 60.0

    def __init__(self):
        self._points: deque[tuple[float, int]] = deque()

    def add(self, step: int, now: float) -> float:
        self._points.append((now, step))
        while len(self._points) > 2 and now - self._points[1][0] >= self.WINDOW_S:
            self._points.popleft()
        (t0, s0), (t1, s1) = self._points[0], self._points[-1]
        return (s1 - s0) / (t1 - t0) if t1 > t0 else 0.0


def eta_s(step: int, target: int, per_s: float) -> float | None:
    return (target - step) / per_s if per_s > 0 else None


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes:02d}:{secs:02d}"


def _bar(step: int, target: int, width: int = 20) -> str:
    done = int(width * min(step, target) / max(target, 1))
    return "[" + "#" * done + "." * (width - done) + "]"


def _spares(s: dict[str, Any]) -> str:
    return f"{s['used']} used of {s['size']}, {s['ready']} ready at the end ({'warm' if s['warm'] else 'attached'})"


def _kind(fault: dict[str, Any]) -> str:
    return f"{fault['kind']}@{fault['during']}" if fault.get("during") else fault["kind"]


def _on_spare(fault: dict[str, Any]) -> str:
    host = fault.get("host_replaced")
    if not host:
        return ""
    return f", on a spare host ready {host['spare_age_s']:.0f}s" if host.get("spare") else ", on a new host"


def _started_from(init: dict[str, Any]) -> str:
    loads = init.get("loads") or {}
    if not loads:
        return init["source"]
    slowest = max(load["seconds"] for load in loads.values())
    return f"{init['source']} (loaded by {len(loads)} groups, the slowest in {slowest:.1f}s)"


def format_summary(s: dict[str, Any]) -> str:
    loss = s.get("loss") or {}
    rows = [
        ("run", s["run_id"]),
        ("recipe", s["recipe"]),
        ("replica groups", f"{s['replicas']} x {group_shape(s['procs_per_replica'], s.get('hosts_per_replica', 1))}"),
        ("committed steps", f"{s['committed_steps']}/{s['target_steps']}"),
        *([("started from", _started_from(s["initial_weights"]))] if s.get("initial_weights") else []),
        ("loss", f"{_num(loss.get('first'))} -> {_num(loss.get('last'))}"),
        ("wall time", f"{s['wall_s']:.1f}s"),
        ("checkpoints written", _checkpoints(s)),
        *([("spare hosts", _spares(s["spares"]))] if (s.get("spares") or {}).get("size") else []),
        ("final digests", _digests(s.get("final_param_digest") or {}, s["replicas"])),
        ("outcome", _outcome(s.get("outcome") or {})),
    ]
    out = ["", "== monarch-sky run summary =="]
    out += [f"  {name:<20} {value}" for name, value in rows]
    if s.get("faults"):
        out.append("  faults (seconds after injection):")
        out.append(
            f"    {'kind':<14}{'replica':>8}{'step':>6}{'detected':>10}{'resumed':>9}"
            f"{'rejoined':>10}  recovered from"
        )
        for f in s["faults"]:
            out.append(
                f"    {_kind(f):<14}{f['replica']:>8}{f['step']:>6}{_num(f['detected_s']):>10}"
                f"{_num(f['survivors_resumed_s']):>9}{_num(f['rejoined_s']):>10}  {f['recovered_from']}{_on_spare(f)}"
            )
    if s.get("faults_not_fired"):
        out.append(f"  faults not fired (the run ended first): {', '.join(s['faults_not_fired'])}")
    for lost in s.get("progress_lost") or []:
        went = ("the state in node memory at step" if lost.get("from_memory")
                else "the checkpoint at step" if lost.get("from_checkpoint") else "scratch, at step")
        out.append(f"  every group holding the training state failed at step {lost['at_step']}: "
                   f"went back to {went} {lost['restarted_at_step']}")
    for failure in s.get("unplanned_failures") or []:
        out.append(f"  UNPLANNED failure of replica {failure['replica']}: {failure['reason']}")
    for lost in s.get("lost_replicas") or []:
        out.append(f"  replica {lost['replica']} was lost: {lost['reason']}")
    for replica, reason in (s.get("final_state_errors") or {}).items():
        out.append(f"  replica {replica}: final state could not be read: {reason}")
    if s.get("clusters_left_up"):  # last, where a reader looks for what to do next
        out.append(f"  STILL UP, still billed: replacement clusters {', '.join(s['clusters_left_up'])}; "
                   f"take them down with `sky down -y {' '.join(s['clusters_left_up'])}`")
    return "\n".join(out)


def group_shape(procs: int, hosts: int) -> str:
    """What one replica group is made of: "2 processes", or "2 hosts x 8 processes"."""
    return f"{hosts} hosts x {procs} processes" if hosts > 1 else f"{procs} processes"


def _checkpoints(s: dict[str, Any]) -> str:
    text = str(s["checkpoints_written"])
    previous = s.get("previous_controller") or {}
    if previous.get("resumed_from_step") is not None:
        text += f" (resumed from the checkpoint at step {previous['resumed_from_step']}, {previous['steps_lost']} steps lost)"
    return text


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


def _digests(digests: dict[str, str], replicas: int) -> str:
    """Says 'all equal' only when every replica group reported the same digest."""
    if not digests:
        return "none reported"
    listed = ", ".join(f"{k}:{v[:10]}" for k, v in sorted(digests.items()))
    if len(set(digests.values())) > 1:
        return f"DIFFER ({listed})"
    if len(digests) < replicas:
        return f"{len(digests)} of {replicas} groups reported, equal ({listed})"
    return f"all equal ({listed})"


def _outcome(outcome: dict[str, Any]) -> str:
    if not outcome:
        return "-"
    text = f"{outcome['status']} (exit {outcome['exit_code']})"
    return f"{text}: {'; '.join(outcome['reasons'])}" if outcome.get("reasons") else text
