#!/usr/bin/env python3
"""Measure TorchFT's heal transports on this machine: GB/s per transport, printed as JSON.

Two local processes: rank 0 sends a CPU state of --gb GB (fp32 tensors shaped like a model
shard plus its two AdamW moments) over TorchFT's HTTPTransport, then over PGTransport on
gloo; rank 1 receives it and checks it bit for bit. The transfer is
tools/gpu_check_heal.py's `run_case` (the GPU check measures fixed sizes); this picks the
size and prints the rates that `RATES` in monarch_sky/heal_budget.py is built from.

  .venv/bin/python tools/heal_rate.py [--gb 2] [--transports http,pg_gloo] [--timeout-s 600]

Needs about 3x --gb of free memory (the state, the received copy, and one regenerated
tensor at a time to compare with). Prints one line, e.g.
  {"gb": 2.0, "http": {"gb_per_s": 0.9, "seconds": 2.2, "equal": true}, "pg_gloo": {...}}
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_check_common import (append_jsonl, error_text, quiet_cpu, read_jsonl,  # noqa: E402
                              spawn, stop, tail, usable_hostname, wait_all)
from gpu_check_heal import MIB, merge, run_case  # noqa: E402

TRANSPORTS = ("http", "pg_gloo")


def worker(rank: int, store_port: int, mib: int, transports: list[str], out_path: str, timeout_s: float) -> None:
    from datetime import timedelta

    import torch
    from torch.distributed import TCPStore

    usable_hostname()
    quiet_cpu("cpu")
    store = TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
    for kind in transports:
        try:
            row = run_case(rank, store, store_port, kind, mib, torch.device("cpu"), timeout_s)
        except Exception as exc:  # noqa: BLE001 - recorded, and the next transport still runs
            row = {"error": error_text(exc, 1500)}
        append_jsonl(out_path, {"case": kind, "rank": rank, **row})
        gc.collect()
    os._exit(0)  # torchft threads must not hold the process open


def measure(gb: float, transports: list[str], timeout_s: float) -> dict:
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=timeout_s))
    mib = max(1, round(gb * 1e9 / MIB))
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "rows.jsonl")
        logs = [os.path.join(tmp, f"rank{r}.log") for r in (0, 1)]
        procs = [spawn("heal_rate:worker", dict(rank=r, store_port=store.port, mib=mib, transports=transports,
                                                out_path=out_path, timeout_s=timeout_s),
                       logs[r], env={"OMP_NUM_THREADS": "1"}) for r in (0, 1)]
        try:
            finished = wait_all(procs, time.time() + timeout_s * (len(transports) + 1))
        finally:
            stop(procs)
        cases = merge(read_jsonl(out_path))
        result = {"gb": round(mib * MIB / 1e9, 3), **{k: cases.get(k, {"error": "no result"}) for k in transports}}
        if not finished or any("error" in v or "sender_error" in v for v in result.values() if isinstance(v, dict)):
            result["log_tails"] = [tail(path, 1500) for path in logs]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=2.0, help="state size per rank, GB (1e9 bytes)")
    p.add_argument("--transports", default=",".join(TRANSPORTS))
    p.add_argument("--timeout-s", type=float, default=600.0, help="per transfer")
    args = p.parse_args()
    transports = [t for t in args.transports.split(",") if t]
    unknown = set(transports) - set(TRANSPORTS)
    if unknown:
        p.error(f"--transports: unknown {', '.join(sorted(unknown))}; allowed: {', '.join(TRANSPORTS)}")
    print(json.dumps(measure(args.gb, transports, args.timeout_s)))


if __name__ == "__main__":
    main()
