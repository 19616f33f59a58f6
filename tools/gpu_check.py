#!/usr/bin/env python3
"""One-shot accelerator check of monarch-sky's training stack: TorchTitan and TorchFT.

Each phase runs in its own subprocess with its own timeout, so a failing or hanging phase
loses only itself. Results go to one JSON file (--out), rewritten after every phase; full
logs (including the worker processes') go to a folder beside it.

  env           Python, torch, CUDA, NCCL, the GPU; whether torchft and torchtitan import, and
                which torch-version shims TorchTitan 0.3.0 (built for torch 2.13) needed.
  titan_debug   TorchTitan's llama3 debugmodel in bf16: forward+backward+AdamW step time,
                tokens/s, peak memory; FlexAttention compiled as TorchTitan runs it, vs SDPA.
  heal_rates    TorchFT's heal transports between two processes: HTTPTransport, PGTransport
                over gloo, and over NCCL (which may refuse two ranks on one GPU). GB/s per
                size, and a bit-exact check of what arrived.
  ft_kill_heal  A real TorchFT recovery: a lighthouse, two replica groups training the debug
                llama3; replica 1 is SIGKILLed, restarted, and heals from replica 0 over the
                network. Detection, rejoin and heal times; final parameter digests.
  titan_8b      As titan_debug with Llama3-8B's config cut to 4 layers (GPU only; run last, as
                its FlexAttention autotuning is the slowest step).

Monarch is absent on purpose: its wheel (~290 MB, built against torch 2.13) cannot travel to
the GPU machine, which has torch 2.11. Monarch only spawns and supervises the processes; what
touches the accelerator is TorchTitan's model and TorchFT's collectives and transports.

Runs on CPU as well (device auto-detected; --scale small there), to try every phase first:
  python tools/gpu_check.py [--out gpu_check.json] [--scale small|full] [--phases a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_common import Result, error_text, spawn, tail  # noqa: E402

# name, target, timeout (s) at scale full, at scale small (0: not run at that scale)
PHASES = [
    ("env", "gpu_check:phase_env", 60, 120),
    ("titan_debug", "gpu_check_titan:phase_debug", 110, 240),
    ("heal_rates", "gpu_check_heal:phase", 110, 180),
    ("ft_kill_heal", "gpu_check_ft:phase", 150, 300),
    ("titan_8b", "gpu_check_titan:phase_8b", 110, 0),
]
BUDGET_S = {"full": 345, "small": 900}
RESERVE_S = 20  # kept back for each phase still to come
PACKAGES = ("torch", "triton", "numpy", "torchft", "torchtitan", "spmd_types", "torch_checkpointing",
            "torchdata", "tyro", "typeguard", "opentelemetry-sdk", "opentelemetry-exporter-otlp-proto-http",
            "protobuf", "googleapis-common-protos", "typing_extensions")


def phase_env(res: Result, **_) -> None:
    import importlib.metadata as md
    import platform

    import torch

    res.set(python=platform.python_version(), executable=sys.executable, torch=torch.__version__,
            torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
            cpus=os.cpu_count())
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        nccl = torch.cuda.nccl.version()
        res.set(gpu=props.name, gpu_count=torch.cuda.device_count(), capability=f"{props.major}.{props.minor}",
                gpu_mem_gib=round(props.total_memory / 2**30, 1),
                nccl=".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            versions[name] = None
    res.set(packages=versions, imports=_import_checks(), network=_network_checks())


def _import_checks() -> dict:
    out = {}
    try:
        import torchft
        import torchft.manager  # noqa: F401

        out["torchft"] = {"ok": True, "file": torchft.__file__}
    except Exception as exc:  # noqa: BLE001
        out["torchft"] = {"ok": False, "error": error_text(exc, 1500)}
    raw = subprocess.run([sys.executable, "-c", "import torchtitan.models.llama3"],
                         capture_output=True, text=True, timeout=90)
    out["torchtitan_unpatched"] = {"ok": raw.returncode == 0, "error": raw.stderr[-1500:] or None}
    try:
        from gpu_check_titan import apply_compat

        shims = apply_compat()
        import torchtitan.models.llama3  # noqa: F401

        out["torchtitan"] = {"ok": True, "shims": shims, "file": torchtitan.__file__}
    except Exception as exc:  # noqa: BLE001
        out["torchtitan"] = {"ok": False, "error": error_text(exc, 1500)}
    return out


def _network_checks() -> dict:
    import socket

    out = {"hostname": socket.gethostname()}
    try:
        socket.getaddrinfo(out["hostname"], None)
        out["hostname_resolves"] = True
    except OSError:
        out["hostname_resolves"] = False  # the phases then advertise 'localhost'
    try:  # TorchFT's manager and HTTP transport bind [::]
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::", 0))
        out["ipv6_bind"] = True
    except OSError as exc:
        out["ipv6_bind"] = repr(exc)
    return out


def _summary(name: str, result: dict) -> str:
    if name == "env":
        imports = result.get("imports", {})
        titan = imports.get("torchtitan", {})
        return (f"torch {result.get('torch')} cuda {result.get('torch_cuda')} nccl {result.get('nccl')} "
                f"{result.get('gpu', 'no GPU')}; torchft {'ok' if imports.get('torchft', {}).get('ok') else 'FAILED'}; "
                f"torchtitan {'ok' if titan.get('ok') else 'FAILED'} (shims: {titan.get('shims') or 'none'})")
    module = {"titan_debug": "gpu_check_titan", "titan_8b": "gpu_check_titan",
              "heal_rates": "gpu_check_heal", "ft_kill_heal": "gpu_check_ft"}[name]
    return __import__(module).summarize(result)


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
    proc = spawn("gpu_check_common:run_phase", kwargs, log_path, pipe=True, new_session=True, env=env)
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
    entry = {"status": status, "seconds": round(time.time() - start, 1), "timeout_s": round(timeout),
             "result": result}
    if status != "ok":
        entry["log_tail"] = tail(log_path, 3000)
    return entry


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--scale", choices=["auto", "small", "full"], default="auto",
                   help="full on a GPU, small (tiny sizes) on CPU")
    p.add_argument("--phases", default=",".join(name for name, *_ in PHASES))
    p.add_argument("--budget-s", type=float, default=None, help="total wall for all phases")
    p.add_argument("--flex-compile", choices=["titan", "plain"], default="titan",
                   help="titan phases: TorchTitan's max-autotune FlexAttention compile, or plain")
    args = p.parse_args()
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
    budget = args.budget_s or BUDGET_S[args.scale]
    wanted = args.phases.split(",")
    todo = [(n, t, full if args.scale == "full" else small) for n, t, full, small in PHASES if n in wanted]
    report = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:], "device": args.device,
              "scale": args.scale, "budget_s": budget, "logs": logdir, "phases": {}}
    start = time.time()

    def save():
        report["total_s"] = round(time.time() - start, 1)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)

    save()
    print(f"gpu_check: device {args.device}, scale {args.scale}, budget {budget:.0f}s, logs in {logdir}", flush=True)
    for i, (name, target, nominal) in enumerate(todo):
        left = budget - (time.time() - start) - RESERVE_S * sum(1 for *_, t in todo[i + 1:] if t)
        timeout = min(nominal, left)
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
