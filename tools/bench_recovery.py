"""Benchmark: how much a warm standby and a hot spare host shorten recovery (`make bench-recovery`).

Four arms, BENCH_RUNS runs each, interleaved so all see the same machine:
- kill/standby: a process kill healed on the group's warm standby (`ft.standby=true`);
- kill/cold: the same kill with a cold respawn (processes, imports, trainer build);
- host/spare: a host loss healed on a warm spare host (`hosts.spares=1`);
- host/replace: the same loss waiting for a new host (`hosts.provision_delay_s`) and a cold spawn.
It reports the median seconds from the fault until the group rejoined (weights from a peer) and
the ratios cold/standby, replace/spare and spare - standby. Results go to bench-recovery.json.
BENCH_ARMS picks arms (comma-separated names).
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
JOB = ["replicas=2", "steps=160", "wandb.mode=disabled", "hosts.provision_delay_s=3"]
ARMS = {
    "kill/standby": ["faults=kill@20:1", "ft.standby=true"],
    "kill/cold": ["faults=kill@20:1", "ft.standby=false"],
    "host/spare": ["faults=host@20:1", "hosts.spares=1"],
    "host/replace": ["faults=host@20:1", "hosts.spares=0"],
}


def one_run(run_dir: str, arm: str, index: int) -> dict:
    run_id = f"bench-{arm.replace('/', '-')}-{index}"
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_sky", "train", *JOB, *ARMS[arm],
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


def ratio(medians: dict, slow: str, fast: str) -> str:
    if slow in medians and fast in medians:
        return f"{slow} / {fast} = {medians[slow] / medians[fast]:.1f}x"
    return ""


def main() -> None:
    arms = os.environ.get("BENCH_ARMS", ",".join(ARMS)).split(",")
    results: dict[str, list[dict]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as run_dir:
        for i in range(RUNS):
            for arm in arms:
                fault = one_run(run_dir, arm, i)
                results[arm].append(fault)
                print(f"run {i} {arm:13}: detected {fault['detected_s']:.2f}s, "
                      f"rejoined {fault['rejoined_s']:.2f}s after the fault", flush=True)
    medians = {k: statistics.median(f["rejoined_s"] for f in v) for k, v in results.items()}
    print(f"\nmedian seconds from fault to rejoined ({RUNS} runs each): "
          + ", ".join(f"{k} {v:.2f}" for k, v in medians.items()))
    lines = [ratio(medians, "kill/cold", "kill/standby"), ratio(medians, "host/replace", "host/spare")]
    if "host/spare" in medians and "kill/standby" in medians:
        lines.append(f"host/spare - kill/standby = {medians['host/spare'] - medians['kill/standby']:+.2f}s")
    print("\n".join(line for line in lines if line))
    (REPO / "bench-recovery.json").write_text(json.dumps({"runs": results, "median_rejoined_s": medians}, indent=2))


if __name__ == "__main__":
    main()
