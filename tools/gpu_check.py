#!/usr/bin/env python3
"""One-shot accelerator check of monarch-sky's training stack: TorchTitan, TorchFT, the heal.

Each phase runs in its own process group with its own timeout, so a failing or hanging phase
loses only itself. Results go to one JSON file (--out), rewritten after every phase; full logs
(the workers' too) go to a folder beside it.

  env           Python, torch, CUDA, NCCL, the GPU; whether torchft and torchtitan import, and
                which torch-version shims TorchTitan 0.3.0 (built for torch 2.13) needed.
  titan_debug   TorchTitan's llama3 debugmodel in bf16: step time, tokens/s, peak memory;
                FlexAttention compiled as TorchTitan runs it, against SDPA (gpu_check_titan.py).
  heal          `make bench-heal --device <dev>`: monarch-sky's tcp heal against raw TCP and
                TorchFT's http and gloo transports, the state on the device, checked bit for bit.
  ft_kill_heal  A real TorchFT recovery: a lighthouse, two replica groups training the debug
                llama3; one is SIGKILLed, restarted, and heals from the other (gpu_check_ft.py).
  titan_8b      As titan_debug with Llama3-8B's config cut to 4 layers (GPU only, run last: its
                FlexAttention autotuning is the slowest step).

Monarch is absent on purpose: its wheel (~290 MB, built against torch 2.13) cannot travel to
the device machine, whose torch is older. What touches the accelerator is TorchTitan's model,
TorchFT's collectives and the heal transports, and those run here.

Runs on CPU too (device auto-detected; --scale small there), to try every phase first:
  python tools/gpu_check.py [--out gpu_check.json] [--scale small|full] [--phases a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

TOOLS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TOOLS)
# name, target, timeout (s) at scale full, at scale small (0: not run at that scale)
PHASES = [
    ("env", "gpu_check:phase_env", 60, 120),
    ("titan_debug", "gpu_check_titan:phase_debug", 110, 240),
    ("heal", "gpu_check:phase_heal", 110, 180),
    ("ft_kill_heal", "gpu_check_ft:phase", 150, 300),
    ("titan_8b", "gpu_check_titan:phase_8b", 110, 0),
]
BUDGET_S = {"full": 345, "small": 900}
RESERVE_S = 20  # kept back for each phase still to come
HEAL_GB = {"full": "1,4", "small": "0.0625,0.25"}
HEAL_TRANSPORTS = "raw,tcp,tcp x2,http,pg_gloo"
PACKAGES = ("torch", "triton", "numpy", "torchft", "torchtitan", "torchdata", "tyro")


class Result(dict):
    """A phase's results, rewritten to `path` on every `set`: a killed phase keeps what it had."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def set(self, **values) -> None:
        self.update(values)
        with open(f"{self.path}.tmp", "w") as f:
            json.dump(self, f, indent=1, default=str)
        os.replace(f"{self.path}.tmp", self.path)


def say(msg: str) -> None:
    """A progress line; the driver echoes lines starting with '# ' to its console."""
    print(f"# {msg}", flush=True)


def error_text(exc: BaseException, limit: int = 3000) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-limit:]


def tail(path: str, limit: int = 3000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def spawn(target: str, kwargs: dict, log_path: str, *, pipe: bool = False,
          new_session: bool = False, env: dict | None = None) -> subprocess.Popen:
    """Run `module:function(**kwargs)` (a module in tools/) in a fresh interpreter; its output
    goes to `log_path`, or to a pipe when `pipe` (the caller then owns the logging)."""
    module, func = target.split(":")
    code = (f"import sys, json; sys.path.insert(0, {TOOLS!r}); import {module}; "
            f"{module}.{func}(**json.loads(sys.argv[1]))")
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(kwargs)], stdout=subprocess.PIPE if pipe else open(log_path, "ab"),
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=new_session,
        env={**os.environ, **(env or {})},
    )


def run_phase(target: str, result_path: str, **kwargs) -> None:
    """A phase process: runs `module:function(res, **kwargs)`; exits 1 on an exception."""
    import importlib

    module, func = target.split(":")
    res = Result(result_path)
    try:
        getattr(importlib.import_module(module), func)(res, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - recorded in the result, and the phase fails
        res.set(error=error_text(exc))
        print(res["error"], file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # torchft/inductor threads must not hold the phase open


def quiet_cpu(device: str) -> None:
    """On CPU (a shared, small machine) each worker uses one thread."""
    if device == "cpu":
        import torch

        torch.set_num_threads(1)


def phase_env(res: Result, **_) -> None:
    import importlib.metadata as md
    import platform

    import torch

    try:
        socket.getaddrinfo(socket.gethostname(), None)
        resolves = True
    except OSError:
        resolves = False  # the TorchFT phase then advertises 'localhost'
    res.set(python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
            cuda_available=torch.cuda.is_available(), cpus=os.cpu_count(), hostname_resolves=resolves)
    if torch.cuda.is_available():
        props, nccl = torch.cuda.get_device_properties(0), torch.cuda.nccl.version()
        res.set(gpu=props.name, gpu_count=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                gpu_mem_gib=round(props.total_memory / 2**30, 1),
                nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    res.set(packages=versions, imports=_import_checks())


def _import_checks() -> dict:
    import importlib

    out = {}
    for name in ("torchft.manager", "torchtitan.models.llama3"):
        try:
            shims = __import__("gpu_check_titan").apply_compat() if name.startswith("torchtitan") else None
            importlib.import_module(name)
            out[name.split(".")[0]] = {"ok": True, "shims": shims}
        except Exception as exc:  # noqa: BLE001
            out[name.split(".")[0]] = {"ok": False, "error": error_text(exc, 1500)}
    return out


def phase_heal(res: Result, device: str, scale: str, logdir: str, timeout_s: float, **_) -> None:
    """monarch-sky's own heal benchmark with the state on this device."""
    out = os.path.join(logdir, "heal")
    cmd = [sys.executable, "-m", "monarch_sky.bench.heal", "--device", device, "--gb", HEAL_GB[scale],
           "--transports", HEAL_TRANSPORTS, "--timeout-s", "60", "--out", out]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    say(" ".join(cmd[1:]))
    proc = subprocess.run(cmd, env=env, timeout=max(10.0, timeout_s - 10), stdout=sys.stdout, stderr=subprocess.STDOUT)
    with open(os.path.join(out, "bench-heal.json")) as f:
        rows = json.load(f)["rows"]
    res.set(exit_code=proc.returncode, rows=rows)


def _summary(name: str, result: dict) -> str:
    if name == "env":
        imports = result.get("imports", {})
        titan = imports.get("torchtitan", {})
        return (f"torch {result.get('torch')} cuda {result.get('torch_cuda')} nccl {result.get('nccl')} "
                f"{result.get('gpu', 'no GPU')}; torchft {'ok' if imports.get('torchft', {}).get('ok') else 'FAILED'}; "
                f"torchtitan {'ok' if titan.get('ok') else 'FAILED'} (shims: {titan.get('shims') or 'none'})")
    if name == "heal":
        return "; ".join(f"{r['gb']}GB {r['transport']} " + (f"{r['gb_per_s']}GB/s equal={r.get('equal')}"
                         if "gb_per_s" in r else "error") for r in result.get("rows", [])) or "no row"
    return __import__("gpu_check_ft" if name == "ft_kill_heal" else "gpu_check_titan").summarize(result)


def _echo(proc: subprocess.Popen, log_path: str, name: str) -> threading.Thread:
    """Copy a phase's output to its log; show its '# ' progress lines on the console."""
    def pump():
        with open(log_path, "ab") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if line.startswith(b"# "):
                    print(f"   [{name}] {line[2:].decode(errors='replace').rstrip()}", flush=True)
    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def run_one(name: str, target: str, timeout: float, args, logdir: str) -> dict:
    result_path, log_path = os.path.join(logdir, f"{name}.json"), os.path.join(logdir, f"{name}.log")
    env = {"PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": "1"} if args.device == "cpu" else {})}
    kwargs = dict(target=target, result_path=result_path, device=args.device, scale=args.scale,
                  logdir=logdir, flex_compile=args.flex_compile, timeout_s=timeout)
    start = time.time()
    proc = spawn("gpu_check:run_phase", kwargs, log_path, pipe=True, new_session=True, env=env)
    echo = _echo(proc, log_path, name)
    try:
        proc.wait(timeout=timeout)
        status = "ok" if proc.returncode == 0 else "error"
    except subprocess.TimeoutExpired:
        status = "timeout"
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the phase, its workers, any compile workers
    except ProcessLookupError:
        pass
    proc.wait()
    echo.join(timeout=5)
    try:
        with open(result_path) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError):
        result = {}
    entry = {"status": status, "seconds": round(time.time() - start, 1), "timeout_s": round(timeout), "result": result}
    if status != "ok":
        entry["log_tail"] = tail(log_path, 3000)
    return entry


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--scale", choices=["auto", "small", "full"], default="auto", help="full on a GPU, small on CPU")
    p.add_argument("--phases", default=",".join(name for name, *_ in PHASES))
    p.add_argument("--budget-s", type=float, default=None, help="total wall for all phases")
    p.add_argument("--flex-compile", choices=["titan", "plain"], default="titan",
                   help="titan phases: TorchTitan's max-autotune FlexAttention compile, or plain")
    args = p.parse_args()
    if unknown := set(args.phases.split(",")) - {name for name, *_ in PHASES}:
        p.error(f"--phases: unknown {', '.join(sorted(unknown))}; choose from {', '.join(n for n, *_ in PHASES)}")
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.scale == "auto":
        args.scale = "full" if args.device == "cuda" else "small"
    return args


def main() -> int:
    args = parse_args()
    logdir = os.path.splitext(os.path.abspath(args.out))[0] + "_logs"
    shutil.rmtree(logdir, ignore_errors=True)  # phases read their workers' files from here
    os.makedirs(logdir)
    budget, wanted = args.budget_s or BUDGET_S[args.scale], args.phases.split(",")
    todo = [(n, t, full if args.scale == "full" else small) for n, t, full, small in PHASES if n in wanted]
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "device": args.device,
              "scale": args.scale, "budget_s": budget, "logs": logdir, "phases": {}}
    start = time.time()

    def save():
        report["total_s"] = round(time.time() - start, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    print(f"gpu_check: device {args.device}, scale {args.scale}, budget {budget:.0f}s, logs in {logdir}", flush=True)
    for i, (name, target, nominal) in enumerate(todo):
        timeout = min(nominal, budget - (time.time() - start) - RESERVE_S * sum(1 for *_, t in todo[i + 1:] if t))
        if nominal == 0 or timeout < 15:
            report["phases"][name] = {"status": "skipped", "why": "not at this scale" if nominal == 0 else "budget"}
            print(f"-- {name}: skipped ({report['phases'][name]['why']})", flush=True)
            save()
            continue
        print(f"-- {name} (timeout {timeout:.0f}s)", flush=True)
        entry = report["phases"][name] = run_one(name, target, timeout, args, logdir)
        try:
            line = _summary(name, entry["result"])
        except Exception as exc:  # noqa: BLE001
            line = f"(no summary: {exc!r})"
        print(f"   {name}: {entry['status'].upper()} in {entry['seconds']}s: {line}", flush=True)
        save()
    statuses = [p["status"] for p in report["phases"].values()]
    counts = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
    print(f"gpu_check: {counts} in {time.time() - start:.0f}s; wrote {args.out}", flush=True)
    return 0 if all(s in ("ok", "skipped") for s in statuses) else 1


if __name__ == "__main__":
    sys.exit(main())
