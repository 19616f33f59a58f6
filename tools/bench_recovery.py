"""Benchmark: how much a warm standby shortens recovery (`make bench`).

Runs the same job with one kill, BENCH_RUNS times with `ft.standby=true` and as many with
`ft.standby=false` (cold respawn: processes, imports, trainer build), interleaved so both see
the same machine, and reports the median seconds from the kill until the group rejoined
(weights from a peer), plus the ratio cold / standby. Results also go to bench-recovery.json.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RUNS = int(os.environ.get("BENCH_RUNS", "3"))
JOB = ["replicas=2", "steps=160", "faults=kill@20:1", "wandb.mode=disabled"]


def one_run(run_dir: str, standby: bool, index: int) -> dict:
    run_id = f"bench-{'standby' if standby else 'cold'}-{index}"
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_sky", "train", *JOB, f"ft.standby={str(standby).lower()}",
         f"run_dir={run_dir}", f"run_id={run_id}", f"seed={index}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{run_id} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    summary = json.loads((Path(run_dir) / run_id / "summary.json").read_text())
    [fault] = summary["faults"]
    if fault["recovered_from"] != "peer":
        raise SystemExit(f"{run_id}: the replica did not rejoin from a peer: {fault}")
    return fault


def main() -> None:
    results: dict[str, list[dict]] = {"standby": [], "cold": []}
    with tempfile.TemporaryDirectory() as run_dir:
        for i in range(RUNS):
            for standby in (True, False):
                fault = one_run(run_dir, standby, i)
                results["standby" if standby else "cold"].append(fault)
                print(f"run {i} {'standby' if standby else 'cold   '}: detected {fault['detected_s']:.2f}s, "
                      f"rejoined {fault['rejoined_s']:.2f}s after the kill", flush=True)
    medians = {k: statistics.median(f["rejoined_s"] for f in v) for k, v in results.items()}
    print(f"\nmedian seconds from kill to rejoined ({RUNS} runs each): "
          f"standby {medians['standby']:.2f}, cold {medians['cold']:.2f}, "
          f"cold/standby = {medians['cold'] / medians['standby']:.1f}x")
    (REPO / "bench-recovery.json").write_text(json.dumps({"runs": results, "median_rejoined_s": medians}, indent=2))


if __name__ == "__main__":
    main()
