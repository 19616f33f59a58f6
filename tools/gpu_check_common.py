"""Helpers shared by tools/gpu_check.py and its phases: result files, subprocesses, logs.

Module top levels here and in the phase modules import no torch, so the driver stays light.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback

TOOLS = os.path.dirname(os.path.abspath(__file__))


class Result(dict):
    """A phase's results, rewritten to `path` on every `set`: a killed phase keeps what it had."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def set(self, **values) -> None:
        self.update(values)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self, f, indent=1, default=str)
        os.replace(tmp, self.path)


def say(msg: str) -> None:
    """A progress line; the driver echoes lines starting with '# ' to its console."""
    print(f"# {msg}", flush=True)


def error_text(exc: BaseException, limit: int = 3000) -> str:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return text[-limit:]


def tail(path: str, limit: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def spawn(target: str, kwargs: dict, log_path: str, *, pipe: bool = False,
          new_session: bool = False, env: dict | None = None) -> subprocess.Popen:
    """Run `module:function(**kwargs)` (a module in tools/) in a fresh interpreter.

    Output goes to `log_path`, or to a pipe when `pipe` (the caller then owns the logging).
    """
    module, func = target.split(":")
    code = (f"import sys, json; sys.path.insert(0, {TOOLS!r}); import {module}; "
            f"{module}.{func}(**json.loads(sys.argv[1]))")
    out = subprocess.PIPE if pipe else open(log_path, "ab")
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(kwargs)], stdout=out, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=new_session, env={**os.environ, **(env or {})},
    )


def run_phase(target: str, result_path: str, **kwargs) -> None:
    """Entry point of a phase subprocess: runs `module:function(res, **kwargs)`, its results
    going to `result_path`; exits 1 on an exception."""
    import importlib

    module, func = target.split(":")
    res = Result(result_path)
    try:
        getattr(importlib.import_module(module), func)(res, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - everything is recorded, nothing swallowed silently
        res.set(error=error_text(exc))
        print(res["error"], file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # torchft/inductor threads must not hold the phase open


def stop(procs) -> None:
    """SIGKILL the given Popen objects that are still running, and reap them."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def wait_all(procs, deadline: float) -> bool:
    """Wait until every process exited or `deadline` (time.time()) passes; True if all exited."""
    while time.time() < deadline:
        if all(p.poll() is not None for p in procs):
            return True
        time.sleep(0.1)
    return all(p.poll() is not None for p in procs)


def read_jsonl(path: str) -> list[dict]:
    rows = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # a line still being written
    except OSError:
        pass
    return rows


def append_jsonl(path: str, row: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()


def usable_hostname() -> str:
    """TorchFT advertises socket.gethostname() to peers; use 'localhost' if it does not resolve."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
        return name
    except OSError:
        socket.gethostname = lambda: "localhost"
        return "localhost"


def quiet_cpu(device: str) -> None:
    """On CPU (a shared, small machine) each worker uses one thread."""
    if device == "cpu":
        import torch

        torch.set_num_threads(1)


def log_to_stdout() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, stream=sys.stdout,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
