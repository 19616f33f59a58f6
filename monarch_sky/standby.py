"""The standby controller: when the controller is lost, another one goes on with the run.

`monarch-sky train` runs the controller as a child process and stands by (`controller.standby`,
on by default). A controller that ends by itself (any exit code, a stop signal it handled)
ends the run; one that is lost (killed by a signal: SIGKILL, a segfault, the OOM killer) is
started again under the same run id, up to `controller.max_restarts` times. The new one finds
the run's newest state in its hosts' node memory (`monarch_sky.control.memory_restore`), or its
checkpoint, and trains on. It is started ahead, warm: its imports done (seconds of them), it
waits for the standby's word, so a loss costs no interpreter start. A stop signal sent to the
standby goes to the controller, and nothing is started again after it. If the standby itself dies, its controller dies with it (as both
would with their node); a `sky launch` cluster has standbys on the other nodes for that
(`sky/bootstrap.sh`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from monarch_sky.hosts.base import LOST_AT_ENV, LOST_IPS_ENV, parse_address, reachable

CHILD_ENV = "MONARCH_SKY_CONTROLLER_CHILD"  # set in the controller a standby runs
NEW_RUN_ENV = "MONARCH_SKY_NEW_RUN"  # its first controller of a run id the standby made up: nothing to go on from
WAITS_ENV = "MONARCH_SKY_CONTROLLER_WAITS"  # a warm controller: it waits for its standby's word first

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WORKER_GONE_AFTER = 3  # this node's worker missed that many probes in a row: the run ended here


def is_controller_child() -> bool:
    return os.environ.get(CHILD_ENV) == "1"


def is_new_run() -> bool:
    return os.environ.get(NEW_RUN_ENV) == "1"


def stand_by(argv: list[str], run_id: str, new_run: bool, max_restarts: int) -> int:
    """Run `monarch-sky <argv> run_id=<run_id>` as the controller, again whenever it is lost.
    `new_run`: the run id was made up here, so the first controller has nothing to go on from."""
    command = [sys.executable, "-m", "monarch_sky", *argv, f"run_id={run_id}"]
    env = {**os.environ, CHILD_ENV: "1"}
    stopping: list[int] = []
    child: subprocess.Popen | None = None

    def warm() -> subprocess.Popen:  # the next controller, waiting for the word
        return subprocess.Popen(command, env={**env, NEW_RUN_ENV: "0", WAITS_ENV: "1"}, stdin=subprocess.PIPE)

    def forward(signum, _frame) -> None:
        stopping.append(signum)
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    child = subprocess.Popen(command, env={**env, NEW_RUN_ENV: "1" if new_run else "0"})
    ready = warm() if max_restarts > 0 else None
    restarts = 0
    try:
        while True:
            code = child.wait()
            lost = code < 0 and not stopping
            if not lost:
                return code if code >= 0 else 128 - code
            name = signal.Signals(-code).name
            if restarts >= max_restarts or ready is None:
                print(f"monarch-sky standby: the controller of run {run_id} was lost ({name}) and "
                      f"controller.max_restarts={max_restarts} are spent; run it again with run_id={run_id} "
                      "to go on from its hosts' node memory", file=sys.stderr, flush=True)
                return 128 - code
            restarts += 1
            print(f"monarch-sky standby: the controller of run {run_id} was lost ({name}); the next one "
                  f"({restarts}/{max_restarts}) goes on from the hosts' node memory", flush=True)
            child, ready = _wake(ready, command, env), (warm() if restarts < max_restarts else None)
    finally:
        if ready is not None and ready.poll() is None:
            ready.kill()
            ready.wait()


def _wake(ready: subprocess.Popen, command: list[str], env: dict[str, str]) -> subprocess.Popen:
    """Tell the warm controller to go on; if it died meanwhile (its pipe is broken), start a cold
    one in its place with the same word, so a dead standby-in-waiting costs an interpreter start,
    not the run."""
    lost_at = f"{time.time():.3f}"
    try:
        ready.stdin.write(f"{lost_at}\n".encode())
        ready.stdin.close()
        return ready
    except (OSError, ValueError):  # BrokenPipeError: it is gone, or closed its end
        if ready.poll() is None:
            ready.kill()
        ready.wait(timeout=30)
        print(f"monarch-sky standby: the warm controller had ended (exit {ready.returncode}); starting a cold one",
              flush=True)
        return subprocess.Popen(command, env={**env, NEW_RUN_ENV: "0", LOST_AT_ENV: lost_at})


def wait_for_the_word() -> None:
    """In a warm controller (imports done): wait until the standby says the one before it was
    lost (when: the line it sends), or leave quietly if the standby goes (the run ended)."""
    if os.environ.get(WAITS_ENV) != "1":
        return
    try:
        line = sys.stdin.readline()
    except KeyboardInterrupt:  # Ctrl-C reached the whole process group: the active one handles it
        os._exit(0)
    if not line.strip():
        os._exit(0)
    os.environ[LOST_AT_ENV] = line.strip()


def die_with_standby() -> None:
    """In the controller a standby started: die when the standby does (Linux), as a
    controller dies with its node; else an orphan would train on unwatched."""
    if not is_controller_child() or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the standby died before the line above
        os._exit(128 + signal.SIGKILL)


# ---- the controller's door, and the standbys on the other nodes ------------------------


def open_door(ip: str, port: int) -> None:
    """Listen on `ip:port` for as long as this process lives: the standbys on the other nodes
    knock there to know that this node's controller (or its standby) is alive. A second
    controller on the node cannot open it (the port is taken) and stops there."""
    server = socket.create_server((ip, port))

    def answer() -> None:
        while True:
            conn, _ = server.accept()
            conn.close()

    threading.Thread(target=answer, name="controller-door", daemon=True).start()


def watch_and_take_over(doors: list[str], local_worker: str, after_s: float, argv: list[str],
                        mark: str | None = None) -> int:
    """A standby controller on another node: once a door of `doors` (the controllers' before
    this node, e.g. node 0's) has answered, take the run over when none answers for `after_s`
    times the number of doors, by running `monarch-sky <argv>` here; give up (exit 0) when this
    node's own worker ends, which is how a run that finished tells its nodes. The wait grows
    with the node's place in line, so the first node after the lost one takes over and opens its
    own door before the next one's wait runs out. A controller that takes over finds the run's
    state in the surviving nodes' memory and claims them (the fence: they then refuse the older
    controller's word)."""
    after_s *= max(1, len(doors))
    watched = [parse_address(d, "door") for d in doors]
    worker = parse_address(local_worker, "worker")
    seen = False
    silent_since = None
    worker_missed = 0
    while True:
        worker_missed = 0 if reachable(worker.ip, worker.port, 2.0) else worker_missed + 1
        if worker_missed >= WORKER_GONE_AFTER:  # one miss may be a busy node, not a finished run
            return 0  # this node's worker is done: the run ended (or this node is on its way out)
        if any(reachable(d.ip, d.port, 1.0) for d in watched):
            seen, silent_since = True, None
        elif seen:
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since >= after_s:
                break
        time.sleep(1.0)
    print(f"monarch-sky standby: no controller answers at {', '.join(doors)} for {after_s:g}s: "
          "this node takes the run over", flush=True)
    os.environ[LOST_AT_ENV] = f"{time.time():.3f}"  # when it was seen lost (the previous record says since when)
    os.environ[LOST_IPS_ENV] = ",".join(d.ip for d in watched)  # none answers: the new controller passes them over
    if mark:
        open(mark, "w").close()
    os.execv(sys.executable, [sys.executable, "-m", "monarch_sky", *argv])
