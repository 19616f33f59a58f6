"""`monarch-sky train`: one run from a validated job to an exit code.

Picks the run id, cleans up after a previous controller of the same run id, opens the run
record and W&B, builds the host provider, runs the controller, and writes the summary.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from datetime import datetime

from monarch_sky.control.checkpoint_resume import (
    CheckpointMismatch, attempt_from_checkpoint, fired_before, restart_message, resume_from,
)
from monarch_sky.common import hub_assets, released_weights
from monarch_sky.config import EXIT_CONFIG, Job, resolved_yaml
from monarch_sky.control.controller import Controller
from monarch_sky.control.memory_restore import Superseded
from monarch_sky.hosts.base import CONTROLLER_ENV, RUN_ID_ENV, HostProvider
from monarch_sky.hosts.choice import make_provider
from monarch_sky.hosts.local import reap_run
from monarch_sky.record.outcome import EXIT_SUPERSEDED, failed, refused, stopped
from monarch_sky.record.progress import STORY, Display, group_shape
from monarch_sky.record.tracking import RunFinished, RunRecord, Tracker, previous_attempt

log = logging.getLogger(__name__)

EVERYTHING = (RUN_ID_ENV, CONTROLLER_ENV)  # hosts, trainers and the controller's helpers
# What Ctrl-C, `kill`, Slurm, Kubernetes, `sky cancel` and `timeout` send: each is a stop.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


async def run_until_stopped(controller: Controller) -> dict:
    """Run the controller; a stop signal cancels it, which shuts every process down."""
    loop = asyncio.get_running_loop()
    main = asyncio.ensure_future(controller.run())
    received: list[int] = []

    def on_signal(signum: int) -> None:
        if not received:  # a second signal while shutting down changes nothing
            received.append(signum)
            main.cancel()

    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return await main
    except asyncio.CancelledError:
        if received:
            raise Stopped(received[0]) from None
        raise
    finally:
        for signum in STOP_SIGNALS:
            loop.remove_signal_handler(signum)


def new_run_id(recipe: str) -> str:
    return f"{recipe}-{datetime.now():%Y%m%d-%H%M%S}-{os.urandom(2).hex()}"


def run_job(job: Job, provider: HostProvider | None = None, new_run: bool = False) -> int:
    """Run a validated job to completion; returns the process exit code. `new_run`: its run id
    is new (made up by a standby), so no host holds any of it."""
    os.environ.setdefault("RUST_LOG", "warn")
    _log_to_console()
    cfg = job.config
    # The job validated (shapes too, where the weights were there): what a preview allows must be here now.
    problem = insecure_heal(cfg) or hub_assets.tokenizer_problem(cfg.data) or released_weights.missing(cfg.init)
    if problem:
        print(f"monarch-sky: config error: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    given_id = cfg.run_id is not None and not new_run  # an existing run's, maybe: its hosts' node memory is asked
    run_id = cfg.run_id or new_run_id(cfg.recipe)
    cfg.run_id = run_id
    try:
        previous = previous_attempt(cfg.run_dir, run_id) or attempt_from_checkpoint(cfg)
    except RunFinished as e:  # a managed job's restart after the end gets the same answer
        print(f"monarch-sky: {e}; nothing left to train (run_id: pick another to train again)", file=sys.stderr)
        return e.exit_code
    display = Display(cfg.steps)
    resume = None
    if previous is not None:
        previous["reaped_processes"] = reap_run(run_id, EVERYTHING)
        previous["faults_fired"] = fired_before(cfg, previous)
        try:
            resume = resume_from(cfg, previous)  # the newest checkpoint, if the run has one
        except CheckpointMismatch as e:
            print(f"monarch-sky: cannot resume run {run_id}: {e}", file=sys.stderr)
            return EXIT_CONFIG
        display.line(restart_message(run_id, previous))
    outer_id = os.environ.get(CONTROLLER_ENV)
    os.environ[CONTROLLER_ENV] = run_id  # after the reap: what this controller starts (W&B) is reaped by the next
    record = RunRecord(cfg.run_dir, run_id)
    log_file = _log_to_file(record.path / "controller.log")
    (record.path / "config.yaml").write_text(resolved_yaml(job))
    if previous is not None:
        record.event("controller_restarted", **previous)
    record.event("run_started", config=job.to_dict())
    display.line(
        f"monarch-sky run {run_id}: {cfg.recipe}, {cfg.replicas} replica groups x "
        f"{group_shape(cfg.procs_per_replica, cfg.hosts_per_replica)}, {cfg.steps} steps, ft.mode={cfg.ft.mode}, faults: {job.faults_text}, "
        f"from {released_weights.source(cfg.init)}"
    )
    tracker = Tracker(cfg.wandb, run_id, record.path, job.to_dict())
    if provider is None:
        hosts_log = record.path / "hosts"
        hosts_log.mkdir(exist_ok=True)
        provider = make_provider(cfg.hosts, run_id, str(hosts_log))
    controller = Controller(job, provider, record, tracker, display, previous_controller=previous, resume=resume,
                            survey_memory=given_id)
    summary = None
    try:
        summary = asyncio.run(run_until_stopped(controller))
    except Superseded as e:  # the run's summary, W&B run and hosts are the newer controller's now
        record.event("superseded", reason=str(e))
        display.line(f"monarch-sky: {e}; this controller stopped driving run {run_id} (exit {EXIT_SUPERSEDED})")
    except CheckpointMismatch as e:  # the run id's node memory is another shape's: nothing trained
        summary = controller.partial_summary(refused(str(e)))
        record.event("run_refused", reason=str(e))
        display.line(f"monarch-sky: cannot go on with run {run_id}: {e}")
    except (Stopped, KeyboardInterrupt) as e:
        signum = e.signum if isinstance(e, Stopped) else signal.SIGINT
        name = signal.Signals(signum).name
        summary = controller.partial_summary(stopped(name, signum))
        record.event("stopped", signal=name)
        display.line(f"stopped by {name}: stopped every process of the run")
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
        summary = controller.partial_summary(failed(error))
        record.event("run_failed", error=error)
        log.error("run failed", exc_info=True)
        display.line(f"monarch-sky: run failed: {error} (traceback: {log_file.baseFilename})")
    finally:
        reap_run(run_id, (RUN_ID_ENV,))  # hosts and trainers; W&B's helpers still have to finish
    try:
        if summary is None:
            return EXIT_SUPERSEDED
        record.write_summary(summary)
        try:
            tracker.finish(summary, _render_report(record.path))
        except KeyboardInterrupt:  # the run is over and recorded: its outcome stands
            record.event("interrupted_while_finishing")
            display.line("monarch-sky: interrupted while finishing W&B; the run record is complete")
        display.finish(summary, str(record.path), tracker.mode, tracker.location)
    finally:
        if summary is not None:  # superseded: the helpers under this run id may be the newer controller's
            reap_run(run_id, EVERYTHING)
        _restore_env(CONTROLLER_ENV, outer_id)
        record.close()
        logging.getLogger().removeHandler(log_file)
        STORY.removeHandler(log_file)
        log_file.close()
    return summary["outcome"]["exit_code"]


def _restore_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def insecure_heal(cfg) -> str | None:
    """Why this run may not heal over TorchFT's HTTP transport, or None (it says so instead)."""
    if cfg.ft.heal_transport != "http":
        return None
    from monarch_sky.hosts import tls

    if tls.scheme() == "tls":
        return ("ft.heal_transport=http: TorchFT's HTTP transport makes a rejoiner unpickle (torch.load, "
                "weights_only=False) whatever answers at its peer's address, unauthenticated, and this run has "
                "TLS: use tcp or rdma (authenticated both ways), or run without TLS")
    log.warning("ft.heal_transport=http: a rejoiner unpickles whatever answers at its peer's address, "
                "unauthenticated (docs/security.md); tcp and rdma are authenticated both ways")
    return None


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _log_level() -> int:
    """MONARCH_SKY_LOG (debug, info, warning; `train --log-level` sets it): the console's level."""
    name = os.environ.get("MONARCH_SKY_LOG", "warning").strip().upper() or "WARNING"
    level = logging.getLevelName(name)
    return level if isinstance(level, int) else logging.WARNING


def _log_to_console() -> None:
    logging.basicConfig(level=_log_level(), format=LOG_FORMAT)


def _log_to_file(path) -> logging.FileHandler:
    """The run's controller.log: INFO and up (DEBUG with MONARCH_SKY_LOG=debug), tracebacks in full."""
    level = min(_log_level(), logging.INFO)
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.setLevel(level)
    root = logging.getLogger()
    for console in root.handlers:  # the console keeps its own level while the root lets INFO through
        console.setLevel(max(console.level, _log_level()))
    root.setLevel(min(root.level, level))
    root.addHandler(handler)
    STORY.setLevel(logging.INFO)
    STORY.addHandler(handler)  # the lines the user saw, between the warnings and tracebacks
    return handler


def _render_report(run_path) -> list:
    """The run's `report.md` and `timeline.png` (`monarch-sky report` renders them again)."""
    try:
        from monarch_sky.record.run_report import render_run

        render_run(run_path)
        return [run_path / "timeline.png"]
    except Exception as e:  # a report is no reason to lose the run's exit code
        log.warning("could not render the run's report: %s", e)
        return []
