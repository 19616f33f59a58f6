#!/usr/bin/env python3
"""What a last-resort checkpoint costs here, and the interval that keeps it near 1%.

1. Trains the tiny recipe through the real controller with `checkpoint.every_min` set, and
   compares, in that same run, the steps right after each save with the others: the save's
   pause (every group waits for the saving one at the next quorum) plus any slowdown while
   TorchTitan's background thread writes the files.
2. Times, in this process, DCP's staging of a --gb CPU state (what TorchTitan's `async` mode
   does on the step loop: a copy of the state to host memory) and a DCP write of it: the
   per-GB rates the big recipes are scaled with.
3. Prints one JSON object: the measured numbers, and N (minutes between checkpoints) for
   about 1% of the throughput: for the tiny model as measured, for llama3_8b and llama3_70b
   (8 ranks a group, state per rank from monarch_sky/control/heal_budget.py) as
   fixed cost + state per rank / staging rate, each assumption named in the output.

  .venv/bin/python tools/checkpoint_cost.py [--steps 80] [--every-min 0.1] [--gb 1] [--out cost.json]

About 2-4 minutes on 2 cores; needs about 2x --gb of free memory and disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

WINDOW = 3  # steps after a save that its pause and its background write may slow
WARMUP = 5  # first steps left out of the baseline (imports, allocator, first quorum)
BIG = ("llama3_8b", "llama3_70b")
RANKS = 8


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def analyze(events: list[dict], steps: list[dict], window: int = WINDOW, warmup: int = WARMUP) -> dict:
    """Per save: the saving group's blocking seconds, and the extra wall time of the
    `window` steps after it over the median step gap of the steps far from any save."""
    saves = [e for e in events if e["event"] == "checkpoint_staged"]
    if not saves:
        raise ValueError("no checkpoint was saved: run longer or with a smaller --every-min")
    saver = saves[0]["replica"]
    wall = {s["step"]: s["wall"] for s in steps if s["replica"] == saver and s["committed"]}
    gaps = {step: wall[step] - wall[step - 1] for step in wall if step - 1 in wall}
    near = {s["step"] + k for s in saves for k in range(1, window + 1)}
    baseline = [g for step, g in gaps.items() if step not in near and step > warmup]
    if len(baseline) < 5:
        raise ValueError("too few steps away from saves for a baseline: run longer or save less often")
    base = statistics.median(baseline)
    extra = [
        sum(gaps[s["step"] + k] - base for k in range(1, window + 1) if s["step"] + k in gaps)
        for s in saves if all(s["step"] + k in gaps for k in range(1, window + 1))
    ]
    after = [gaps[step] for step in near if step in gaps]
    return {
        "saves": len(saves),
        "blocking_s": round(statistics.median(e["blocking_s"] for e in saves), 4),
        "blocking_s_max": round(max(e["blocking_s"] for e in saves), 4),
        "save_call_s": round(statistics.median(e["waited_s"] for e in saves), 4),
        "step_gap_s": round(base, 4),
        "step_ratio_after_save": round(statistics.mean(after) / base, 3) if after else None,
        "extra_s_per_save": round(statistics.median(extra), 4) if extra else None,
    }


def run_tiny(steps: int, every_min: float, workdir: Path) -> dict:
    run_id = f"checkpoint-cost-{os.getpid()}"
    cmd = [sys.executable, "-m", "monarch_sky", "train", f"run_dir={workdir}", f"run_id={run_id}",
           "replicas=2", "procs_per_replica=2", f"steps={steps}", "faults=none", "ft.standby=false",
           f"checkpoint.every_min={every_min}", "wandb.mode=disabled"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    path = workdir / run_id
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    summary = json.loads((path / "summary.json").read_text())
    measured = analyze(read_jsonl(path / "events.jsonl"), read_jsonl(path / "steps.jsonl"))
    return {"steps": steps, "every_min": every_min, "wall_s": summary["wall_s"],
            "checkpoints_written": summary["checkpoints_written"], **measured}


def staging_rates(gb: float, workdir: Path) -> dict:
    """DCP's default stager (what `async` mode runs on the step loop) and a DCP write."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    torch.manual_seed(0)
    tensors = 48  # a model shard's state is many tensors
    state = {f"t{i}": torch.randn(int(gb * 1e9 / 4 / tensors)) for i in range(tensors)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    stage_s, write_s = [], []
    for attempt in range(3):
        stager = DefaultStager(StagingOptions(False, False, False, False))
        began = time.perf_counter()
        staged = stager.stage(state)
        stage_s.append(time.perf_counter() - began)
        stager.close()
        began = time.perf_counter()
        dcp.save(staged, checkpoint_id=str(workdir / f"write-{attempt}"), no_dist=True)
        os.sync()
        write_s.append(time.perf_counter() - began)
        del staged
    return {"gb": round(nbytes / 1e9, 3), "stage_gb_per_s": round(nbytes / 1e9 / statistics.median(stage_s), 3),
            "write_gb_per_s": round(nbytes / 1e9 / statistics.median(write_s), 3)}


def derive(tiny: dict, rates: dict) -> dict:
    from monarch_sky.common.checkpoints import interval_min
    from monarch_sky.control.heal_budget import state_bytes_per_rank
    from monarch_sky.recipes import RECIPES

    tiny_cost = max(tiny["extra_s_per_save"] or 0.0, tiny["save_call_s"])
    fixed = tiny["save_call_s"]  # the tiny state stages in milliseconds: the rest is fixed cost
    out = {"llama3_tiny": {"save_cost_s": round(tiny_cost, 3), "every_min": round(interval_min(tiny_cost), 2)}}
    for recipe in BIG:
        per_rank = state_bytes_per_rank(RECIPES[recipe].params, RANKS)
        cost = fixed + per_rank / 1e9 / rates["stage_gb_per_s"]
        write_min = per_rank * RANKS / 1e9 / rates["write_gb_per_s"] / 60  # one group's files, one writer
        out[recipe] = {"gb_per_rank": round(per_rank / 1e9, 1), "save_cost_s": round(cost, 1),
                       "every_min": round(interval_min(cost), 1), "write_min_at_measured_rate": round(write_min, 1)}
    out["assumptions"] = [
        "a save pauses all groups for the saving group's staging: every group waits for it at the next quorum",
        "`async` mode stages GPU state into pageable host memory on the step loop; its rate is taken as "
        "this machine's DCP staging rate, each of a group's 8 ranks copying its own shard in parallel",
        "fixed cost per save: the tiny run's save call (planning, gc, the call itself)",
        "the background write must end before the next save starts (TorchTitan waits for it); "
        "write_min_at_measured_rate is one group's files at this disk's rate: a bucket is usually slower",
        "a GPU's compute is not slowed by the background write; on CPU (tiny) it is, and that is measured",
    ]
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--every-min", type=float, default=0.1, help="checkpoint interval of the tiny run")
    p.add_argument("--gb", type=float, default=1.0, help="state size for the staging and write rates")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as tmp:
        tiny = run_tiny(args.steps, args.every_min, Path(tmp))
        rates = staging_rates(args.gb, Path(tmp))
    result = {"measured_on": f"{os.cpu_count()} CPUs", "tiny_run": tiny, "rates": rates, "derived": derive(tiny, rates)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
