"""Run record and Weights & Biases tracking.

The run record is what tests and tools read: `<run_dir>/<run_id>/events.jsonl` (one JSON
object per event, written as it happens), `steps.jsonl` (one line per replica group's step:
the format `monarch-sky report` and `make bench` read for every arm) and `summary.json` (at
the end). W&B gets the same metrics and events; it runs offline unless wandb finds your key
(WANDB_API_KEY or `wandb login`) or `wandb.mode=online`. The API key is read by wandb itself
and never logged here.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RunFinished(Exception):
    """The run id already reached its target: starting it again has nothing to train."""

    def __init__(self, run_id: str, summary_path: Path, outcome: dict[str, Any]):
        super().__init__(f"run {run_id} already finished ({outcome['status']}, exit {outcome['exit_code']}): {summary_path}")
        self.exit_code = outcome["exit_code"]


class RunRecord:
    def __init__(self, run_dir: str, run_id: str):
        self.path = Path(run_dir) / run_id
        self.path.mkdir(parents=True, exist_ok=True)
        self.events_path = self.path / "events.jsonl"
        self.summary_path = self.path / "summary.json"
        self._start = time.monotonic()
        self._events = open(self.events_path, "a", buffering=1)
        self._steps = open(self.path / "steps.jsonl", "a", buffering=1)

    def elapsed(self, at: float | None = None) -> float:
        return (time.monotonic() if at is None else at) - self._start

    def event(self, name: str, **fields: Any) -> dict[str, Any]:
        event = {"t": round(self.elapsed(), 3), "wall": round(time.time(), 3), "event": name, **fields}
        self._events.write(json.dumps(event) + "\n")
        return event

    def step(self, replica: int, step: int, committed: bool, seconds: float, loss: float | None, participants: int,
             wall: float) -> None:
        """One replica group's step as it ended at `wall` (committed or not)."""
        line = {"wall": round(wall, 3), "replica": replica, "step": step, "committed": committed,
                "seconds": round(seconds, 4), "loss": loss, "participants": participants}
        self._steps.write(json.dumps(line) + "\n")

    def write_summary(self, summary: dict[str, Any]) -> None:
        tmp = self.summary_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(summary, indent=2) + "\n")
        tmp.replace(self.summary_path)

    def close(self) -> None:
        self._events.close()
        self._steps.close()


def previous_attempt(run_dir: str, run_id: str) -> dict[str, Any] | None:
    """What an earlier controller of this run id left: None if there was none.

    A run whose events exist but whose summary does not lost its controller (killed, or
    its machine died); one whose summary says it was stopped or failed may go on too (its
    summary is kept as `summary-<status>-<n>.json`). Raises RunFinished if the run id
    already reached its target.
    """
    from monarch_sky.record.outcome import resumable

    path = Path(run_dir) / run_id
    summary_path = path / "summary.json"
    ended = None
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        if not resumable(summary):
            raise RunFinished(run_id, summary_path, summary["outcome"])
        ended = summary["outcome"]["status"]
        kept = len(list(path.glob("summary-*.json")))
        summary_path.replace(path / f"summary-{ended}-{kept}.json")
    events_path = path / "events.jsonl"
    if not events_path.exists():
        return None
    events = _json_lines(events_path)
    lines = _json_lines(path / "steps.jsonl", tail_bytes=STEPS_TAIL_BYTES)
    steps = [e["step"] for e in events if e.get("event") == "progress"]  # every 5% of the run
    steps += [s["step"] for s in lines if s.get("committed")]
    return {
        "last_step": max(steps, default=0),
        "last_wall": max((x.get("wall", 0) for x in (*events, *lines)), default=None),  # about when it was lost
        "faults_injected": sum(e.get("event") == "fault_injected" for e in events),
        "faults_fired": [e["scheduled"] for e in events if e.get("event") == "fault_injected" and e.get("scheduled")],
        "ended": ended or "controller lost",
    }


STEPS_TAIL_BYTES = 1 << 20  # steps.jsonl has a line per group and step: its newest end is enough


def _json_lines(path: Path, tail_bytes: int | None = None) -> list[dict[str, Any]]:
    """The file's JSON lines (only those in its last `tail_bytes`, if given)."""
    if not path.exists():
        return []
    with path.open("rb") as f:
        if tail_bytes is not None and f.seek(0, 2) > tail_bytes:
            f.seek(-tail_bytes, 2)
            f.readline()  # the first line is cut off
        else:
            f.seek(0)
        text = f.read().decode(errors="replace")
    lines = []
    for line in text.splitlines():
        try:
            lines.append(json.loads(line))
        except ValueError:  # the last line may be cut off
            continue
    return lines


def wandb_mode(setting: str) -> str:
    """"auto": online when wandb would find credentials (WANDB_API_KEY, an identity token
    file, or the key `wandb login` keeps in ~/.netrc), else offline."""
    if setting != "auto":
        return setting
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "online"
    return "online" if _netrc_has_key() else "offline"


def _netrc_has_key() -> bool:
    """Whether wandb's own netrc reader (where `wandb login` writes) has a key for the W&B host."""
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth  # wandb's own; pinned in pyproject

        return bool(read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")))
    except Exception as e:  # a malformed netrc or another wandb: offline, and say why
        log.warning("W&B: could not read a key from netrc (%s); running offline", type(e).__name__)
        return False


class Tracker:
    """W&B run for the controller; every call is a no-op when W&B is disabled or broken."""

    def __init__(self, settings, run_id: str, directory: Path, config: dict[str, Any]):
        self.mode = wandb_mode(settings.mode)
        self.run = None
        self.location = None
        self.error: str | None = None  # why W&B stopped, if it did (shown in the summary)
        self._pending: dict[str, Any] = {}
        if self.mode == "disabled":
            return
        try:
            import wandb

            self.run = wandb.init(
                project=settings.project,
                entity=settings.entity,
                id=run_id,
                name=run_id,
                dir=str(directory),
                mode=self.mode,
                config=config,
                resume="allow",
                settings=wandb.Settings(silent=True, console="off"),
            )
            # online: the run's page; offline: its run folder, what `wandb sync` uploads
            self.location = self.run.url if self.mode == "online" else str(Path(self.run.dir).parent)
        except Exception as e:  # tracking must never stop training
            self._fail("init", e)

    def _fail(self, call: str, e: Exception) -> None:
        """Report a W&B failure once and stop calling it: tracking must never stop training."""
        self.error = f"wandb {call} failed: {_scrub(str(e))[:300]}"
        log.warning("%s; W&B is off for the rest of this run", self.error)
        self.run = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Per-step metrics; W&B needs steps in increasing order."""
        if self.run is not None:
            metrics, self._pending = {**self._pending, **metrics}, {}
            try:
                self.run.log(metrics, step=step)
            except Exception as e:
                self._fail("log", e)

    def note(self, metrics: dict[str, Any]) -> None:
        """Event metrics (fault timings), sent with the next step's metrics."""
        self._pending.update(metrics)

    def finish(self, summary: dict[str, Any], plots: list[Path]) -> None:
        """Final numbers, the report's plots as media and the faults as a table."""
        if self.run is None:
            return
        try:
            import wandb

            media = {f"report/{plot.stem}": wandb.Image(str(plot)) for plot in plots}
            if summary.get("faults"):
                columns = list(summary["faults"][0])
                media["faults"] = wandb.Table(columns=columns, data=[[f[c] for c in columns] for f in summary["faults"]])
            self.run.log({**self._pending, **media})
            for key in ("committed_steps", "wall_s", "checkpoints_written"):
                self.run.summary[key] = summary.get(key)
            self.run.summary["outcome"] = summary["outcome"]["status"]
            self.run.finish()
            wandb.teardown()
        except Exception as e:
            self._fail("finish", e)


def _scrub(text: str) -> str:
    key = os.environ.get("WANDB_API_KEY")
    return text.replace(key, "***") if key else text
