"""`make bench-controller`: what keeping the run in node memory costs when nothing fails, and what
it saves when the controller is lost, against going back to a checkpoint.

Cost: monarch-sky without faults at `snapshot.every_steps` 0 (none), 10 (the default) and 1,
rounds interleaved; each arm's median step over the steps after the first 10, as a ratio to no
snapshots in the same round (the copy runs beside the next step: on 2 shared cores it competes
for them; the wait the training thread saw is reported apart).

Loss: the controller lost at step `--lose-at` in three ways of coming back:
  memory      monarch-sky's standby starts another controller, which goes on from node memory
  checkpoint  the same, node memory off, a monarch-sky checkpoint every `--ckpt-min` minutes
  D           TorchTitan alone, a checkpoint every `--ckpt-steps` steps, under torchrun
              --max-restarts (what the product replaces): rank 0 SIGKILLed at the same step,
              torchrun restarts the whole job, which resumes from the newest checkpoint
For each: seconds from the loss to the first step trained again, and the steps trained twice.

    python -m monarch_sky.bench.controller_loss [--rounds 3] [--out runs/bench-controller]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COST_EVERY = (0, 10, 1)
LOSS_ARMS = ("memory", "checkpoint", "D")
WARM_STEPS = 10  # steps left out of a median: the first ones compile and warm caches


def job(s, steps: int) -> list[str]:
    return [f"replicas={s.replicas}", f"procs_per_replica={s.procs}", f"steps={steps}", "seed=0",
            "ft.standby=false", "wandb.mode=disabled"]


def monarch(out: Path, name: str, args: list[str], timeout_s: float) -> dict:
    """One `monarch-sky train` run to its end; its summary and steps."""
    cmd = [sys.executable, "-m", "monarch_sky", "train", f"run_dir={out}", f"run_id={name}", *args]
    with open(out / f"{name}.log", "w") as log:
        code = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
    if code != 0:
        raise RuntimeError(f"{name} exited {code}: see {out / f'{name}.log'}")
    return json.loads((out / name / "summary.json").read_text())


def step_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def median_step_s(lines: list[dict]) -> float:
    return statistics.median(x["seconds"] for x in lines if x["committed"] and x["step"] > WARM_STEPS)


def cost_round(s, out: Path, rnd: int) -> dict:
    times = {}
    for every in COST_EVERY:
        name = f"cost-every{every}-r{rnd}"
        summary = monarch(out, name, [*job(s, s.cost_steps), "faults=none", f"snapshot.every_steps={every}"], 900)
        memory = summary["node_memory"]
        times[every] = {"step_s": median_step_s(step_lines(out / name / "steps.jsonl")),
                        "copy_s": memory["copy_s_median"], "wait_s_per_step": memory["wait_s_per_step"]}
    return times


def loss_round(s, out: Path, rnd: int) -> dict:
    fault = f"faults=controller@{s.lose_at}"
    arms = {
        "memory": [fault],
        "checkpoint": [fault, "snapshot.every_steps=0", f"checkpoint.every_min={s.ckpt_min}"],
    }
    result = {}
    for arm, extra in arms.items():
        lost = monarch(out, f"loss-{arm}-r{rnd}", [*job(s, s.loss_steps), *extra], 1200)["controller_lost"]
        result[arm] = {"training_again_s": lost["training_again_s"], "steps_lost": lost["steps_lost"],
                       "restored_from": lost["restored_from"]}
    result["D"] = torchrun_restart(s, out / f"loss-D-r{rnd}")
    return result


def torchrun_restart(s, arm_dir: Path) -> dict:
    """Arm D: kill rank 0 of TorchTitan's checkpointing job at `lose_at`; torchrun restarts it."""
    arm_dir.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={s.replicas * s.procs}",
           "--max-restarts=1", "-m", "monarch_sky.bench.titan_arm", "--arm", "ckpt", "--out", str(arm_dir),
           "--ckpt-interval", str(s.ckpt_steps), "--", *job(s, s.loss_steps), "faults=none"]
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONUNBUFFERED": "1"}
    steps = arm_dir / "steps.jsonl"
    with open(arm_dir / "torchrun.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        killed_at, deadline = None, time.monotonic() + 1200
        while proc.poll() is None and time.monotonic() < deadline:
            if killed_at is None and max((x["step"] for x in step_lines(steps) if x["committed"]), default=0) >= s.lose_at:
                pid = int((arm_dir / "pids" / "replica0-rank0.pid").read_text())
                os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
    lines = step_lines(steps)
    before = [x for x in lines if x["committed"] and x["wall"] <= killed_at]
    after = [x for x in lines if x["committed"] and x["wall"] > killed_at]
    if proc.returncode != 0 or not after:
        raise RuntimeError(f"arm D did not train again after the kill (exit {proc.returncode}): see {arm_dir}")
    return {"training_again_s": round(after[0]["wall"] - killed_at, 3),
            "steps_lost": max(x["step"] for x in before) - (after[0]["step"] - 1), "restored_from": "checkpoint"}


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def summarize(rounds: list[dict]) -> dict:
    cost = {}
    for every in COST_EVERY[1:]:
        cost[every] = {
            "step_ratio": spread([r["cost"][every]["step_s"] / r["cost"][0]["step_s"] for r in rounds]),
            "copy_s": spread([r["cost"][every]["copy_s"] for r in rounds]),
            "wait_s_per_step": spread([r["cost"][every]["wait_s_per_step"] for r in rounds]),
        }
    loss = {arm: {k: spread([r["loss"][arm][k] for r in rounds]) for k in ("training_again_s", "steps_lost")}
            for arm in LOSS_ARMS}
    return {"cost": cost, "loss": loss,
            "step_s_without_snapshots": spread([r["cost"][0]["step_s"] for r in rounds])}


def report(summary: dict) -> str:
    out = ["snapshot cost (no faults), ratio of the median step to no snapshots, median (min-max):"]
    for every, c in summary["cost"].items():
        r, w = c["step_ratio"], c["wait_s_per_step"]
        out.append(f"  every {every:>2} steps: step x{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}), "
                   f"copy {c['copy_s']['median'] * 1000:.1f} ms off the step, the step waited {w['median'] * 1000:.2f} ms")
    out.append("controller lost: seconds to training again, steps trained twice, median (min-max):")
    for arm, c in summary["loss"].items():
        t, n = c["training_again_s"], c["steps_lost"]
        out.append(f"  {arm:<11} {t['median']:6.1f} s ({t['min']:.1f}-{t['max']:.1f})   "
                   f"{n['median']:4.0f} steps ({n['min']:.0f}-{n['max']:.0f})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m monarch_sky.bench.controller_loss", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench-controller")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--cost-steps", type=int, default=100)
    p.add_argument("--loss-steps", type=int, default=60)
    p.add_argument("--lose-at", type=int, default=35)
    p.add_argument("--ckpt-min", type=float, default=0.04, help="checkpoint arm: minutes between checkpoints (~10 steps here)")
    p.add_argument("--ckpt-steps", type=int, default=10, help="arm D: steps between checkpoints")
    s = p.parse_args(argv)
    s.out.mkdir(parents=True, exist_ok=True)
    rounds = []
    for rnd in range(1, s.rounds + 1):
        print(f"round {rnd}/{s.rounds}: snapshot cost, then the controller lost three ways", flush=True)
        rounds.append({"cost": cost_round(s, s.out, rnd), "loss": loss_round(s, s.out, rnd)})
        (s.out / "bench-controller.json").write_text(json.dumps({"settings": vars(s) | {"out": str(s.out)},
                                                                  "rounds": rounds}, indent=1))
    summary = summarize(rounds)
    (s.out / "bench-controller.json").write_text(json.dumps({"settings": vars(s) | {"out": str(s.out)},
                                                              "rounds": rounds, "summary": summary}, indent=1))
    print(report(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
