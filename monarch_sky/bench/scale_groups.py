"""`make bench-scale-groups`: what monarch-sky's own loop costs as real replica groups grow.

Where `bench.scale` simulates up to 1024 groups against the lighthouse alone, this runs the
whole product: `monarch-sky train` with N real groups of one process each (the tiny recipe),
the real controller, lighthouse, warm standbys and TorchFT managers, and one kill of the last
group a third of the way in. Per N, from the run record:

- build_s: the run began -> every group's trainer built (spawns and imports, N at once);
- first_step_s: training started (right after the build) -> the first step all N committed together (TorchFT's
  first quorum, the process groups' first configure, one step);
- standby_s: training started -> every group's first warm standby ready (N more spawns and
  imports, in the background below the trainers' priority);
- step_s: the median time between steps all N committed, before the fault;
- detected_s, survivors_resumed_s, rejoined_s: the kill's times (`summary.json` faults).

On one machine the N groups share its cores, so step_s grows with N from compute alone; read
the fault times against it (a survivor resumes within a step or two when the loop keeps up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from monarch_sky.bench.scale import group_counts, plot_series

STEPS = 30
KILL_AT = 10
FAULT_KEYS = ("detected_s", "survivors_resumed_s", "rejoined_s")


def measure(n: int, out: Path, timeout_s: float, repo: Path, settings: list[str] = ()) -> dict:
    """One run of N groups (`settings`: more KEY=VALUE for `monarch-sky train`); its row (with
    `failed` if the run did not end well)."""
    run_id = f"groups-{n}-{time.strftime('%Y%m%d-%H%M%S')}"  # an existing run id would resume that run
    cmd = [sys.executable, "-m", "monarch_sky", "train", f"replicas={n}", "procs_per_replica=1", f"steps={STEPS}",
           f"faults=kill@{KILL_AT}:{n - 1}", "wandb.mode=disabled", f"run_dir={out}", f"run_id={run_id}", *settings]
    log = out / f"{run_id}.log"
    began = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=repo, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return {"groups": n, "failed": f"no end within {timeout_s:g}s (see {log})"}
    row = {"groups": n, "wall_s": round(time.monotonic() - began, 1)}
    if rc != 0:
        return {**row, "failed": f"exit {rc} (see {log})"}
    return {**row, **read_run(out / run_id, n)}


def read_run(run: Path, n: int) -> dict:
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    steps = [json.loads(line) for line in (run / "steps.jsonl").read_text().splitlines()]
    summary = json.loads((run / "summary.json").read_text())
    began = next(e["wall"] for e in events if e["event"] == "run_started")
    built = max(e["wall"] for e in events if e["event"] == "replica_started" and e["generation"] == 0)
    training = next(e["wall"] for e in events if e["event"] == "training_started")
    together = _steps_all_committed(steps, n)
    [fault] = summary["faults"]
    before_fault = [wall for step, wall in together if step < KILL_AT]
    gaps = [b - a for a, b in zip(before_fault, before_fault[1:])]
    return {
        "build_s": round(built - began, 2),
        "standby_s": _standbys_ready(events, n, training),
        "first_step_s": round(together[0][1] - training, 2),
        "step_s": round(statistics.median(gaps), 3) if gaps else None,
        **{key: fault[key] for key in FAULT_KEYS},
        "digests_equal": len(set(summary["final_param_digest"].values())) == 1,
    }


def _standbys_ready(events: list[dict], n: int, training: float) -> float | None:
    ready = {}
    for e in events:
        if e["event"] == "standby_ready":
            ready.setdefault(e["replica"], e["wall"])
    return round(max(ready.values()) - training, 2) if len(ready) == n else None


def _steps_all_committed(steps: list[dict], n: int) -> list[tuple[int, float]]:
    """(step, wall of its last group's commit) for steps all N groups committed in one quorum."""
    walls: dict[int, list[float]] = {}
    for s in steps:
        if s["committed"] and s.get("participants") == n:
            walls.setdefault(s["step"], []).append(s["wall"])
    return sorted((step, max(w)) for step, w in walls.items() if len(w) == n)


def describe(r: dict) -> str:
    if "failed" in r:
        return f"{r['groups']:3d} groups: FAILED ({r['failed']})"
    standbys = "not all ready" if r["standby_s"] is None else f"{r['standby_s']:.1f}s"
    return (f"{r['groups']:3d} groups: built in {r['build_s']:.1f}s, first step together {r['first_step_s']:.2f}s "
            f"after, standbys ready {standbys} after, "
            f"step {r['step_s']}s; kill detected {r['detected_s']}s, survivors resumed {r['survivors_resumed_s']}s, "
            f"rejoined {r['rejoined_s']}s; digests {'equal' if r['digests_equal'] else 'DIFFER'}")


def plot(rows: list[dict], path: Path) -> None:
    series = (("build_s", "groups built"), ("standby_s", "standbys warmed"), ("first_step_s", "first step together"),
              ("step_s", "step"), ("detected_s", "kill detected"), ("survivors_resumed_s", "survivors resumed"),
              ("rejoined_s", "rejoined"))
    plot_series(rows, series, "replica groups (real, 1 process each)", path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="monarch-sky bench-scale-groups", description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", default="2,4,8,16", help="real group counts (default: %(default)s)")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="bound on each run (default: 1800)")
    p.add_argument("--out", default="runs/bench-scale-groups", help="folder for the runs, scale-groups.json and .png")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting for every run, as `monarch-sky train` takes it (repeatable)")
    args = p.parse_args(argv)
    counts = group_counts(p, args.groups, "2,4,8")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parents[2]
    rows = []
    for n in counts:
        print(f"[scale-groups] {n} groups: running ({STEPS} steps, a kill at step {KILL_AT})", flush=True)
        rows.append(measure(n, out, args.timeout_s, repo, args.set))
        print(f"[scale-groups] {describe(rows[-1])}", flush=True)
    record = {"steps": STEPS, "kill_at": KILL_AT, "settings": args.set, "rows": rows}
    (out / "scale-groups.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(rows, out / "scale-groups.png")
    print(f"[scale-groups] {out / 'scale-groups.json'}, {out / 'scale-groups.png'}")
    return 0 if all("failed" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
