"""`make bench` / `monarch-sky bench`: run the arms, interleaved, and write the verdict.

Each round runs every arm once, in the order given, so the machine's drift hits all arms
alike; with several rounds an arm's numbers are the medians over its rounds, and each ratio
is taken per round (the arms of one round paired) and reported as the median with its
min-max (`ratio_spread`). The bench folder gets `bench.json` (keys `settings`, `arms`,
`ratios`, `ratio_spread`), `bench.md` and the plots
(`monarch_sky.bench.report`); the table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from monarch_sky.bench import arms as arms_mod
from monarch_sky.bench import metrics
from monarch_sky.bench.outside_chaos import KINDS
from monarch_sky.record.jsonl import read_jsonl

REPO = Path(__file__).resolve().parents[2]
PROGRESS_EVERY_S = 30.0
RATIOS = {  # name -> (arm, arm, field): the first arm's field over the second's
    "goodput C/D": ("C", "D", "goodput"),
    "goodput C'/C": ("C_spare", "C", "goodput"),  # what one hot spare host buys
    "goodput C/E": ("C", "E", "goodput"),
    "goodput C/E'": ("C", "E_best", "goodput"),
    "work_rate C/D": ("C", "D", "work_rate"),
    "work_rate C/E'": ("C", "E_best", "work_rate"),
    "time_to_target D/C": ("D", "C", "time_to_target_s"),
    "time_to_target E/C": ("E", "C", "time_to_target_s"),
    "time_to_target E'/C": ("E_best", "C", "time_to_target_s"),
    "goodput C/E' (diloco)": ("C_diloco", "E_best_diloco", "goodput"),
    "work_rate C/E' (diloco)": ("C_diloco", "E_best_diloco", "work_rate"),
    "time_to_target E'/C (diloco)": ("E_best_diloco", "C_diloco", "time_to_target_s"),
    "step_time A_step/B": ("A_step", "B", "median_step_s"),
    "step_time A_diloco/B": ("A_diloco", "B", "median_step_s"),
    "goodput A_step/B": ("A_step", "B", "goodput"),
    "first_step A_step/B": ("A_step", "B", "first_step_s"),
    "first_step A_step/E'": ("A_step", "E_best", "first_step_s"),
    "step_time A_step/E'": ("A_step", "E_best", "median_step_s"),  # TorchFT's per-step protocol is in both
    "group_step A_diloco/E' (diloco)": ("A_diloco", "E_best_diloco", "group_step_s"),
    "steady_step A_diloco/E' (diloco)": ("A_diloco", "E_best_diloco", "steady_step_s"),
    "steady_step A_step/B": ("A_step", "B", "steady_step_s"),
    "steady_step A_step/E'": ("A_step", "E_best", "steady_step_s"),
    "step_time A_diloco/E' (diloco)": ("A_diloco", "E_best_diloco", "median_step_s"),
    "goodput A_diloco/E' (diloco)": ("A_diloco", "E_best_diloco", "goodput"),
    "first_step A_diloco/E' (diloco)": ("A_diloco", "E_best_diloco", "first_step_s"),
    "time_to_target A_diloco/E' (diloco)": ("A_diloco", "E_best_diloco", "time_to_target_s"),
    "between_steps A_step/B": ("A_step", "B", "between_steps_s"),
}


@dataclass
class BenchSettings:
    steps: int = 150
    replicas: int = 3
    procs: int = 2
    seed: int = 1
    every_s: float = 20.0
    kinds: list[str] = field(default_factory=lambda: ["kill", "segfault", "stop", "host"])
    ckpt_interval: int = 10
    provision_delay_s: float = 3.0
    max_restarts: int = 20
    arms: list[str] = field(default_factory=lambda: ["A_step", "B", "C", "C_spare", "D", "E", "E_best", "A_diloco"])
    rounds: int = 1
    arm_timeout_s: float = 540.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = BenchSettings()
    parser.add_argument("--steps", type=int, default=d.steps, help="training steps per arm")
    parser.add_argument("--replicas", type=int, default=d.replicas, help="replica groups")
    parser.add_argument("--procs", type=int, default=d.procs, help="processes per replica group")
    parser.add_argument("--seed", type=int, default=d.seed, help="training and chaos seed")
    parser.add_argument("--every-s", type=float, default=d.every_s, help="mean seconds between faults")
    parser.add_argument("--kinds", default=",".join(d.kinds), help=f"fault kinds, from {','.join(KINDS)}")
    parser.add_argument("--ckpt-interval", type=int, default=d.ckpt_interval, help="arm D: steps between checkpoints")
    parser.add_argument("--arms", default=",".join(d.arms), help=f"arms to run, from {','.join(arms_mod.LABELS)}")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="runs of every arm, interleaved")
    parser.add_argument("--arm-timeout-s", type=float, default=d.arm_timeout_s, help="an arm is stopped after this")
    parser.add_argument("--out", default="runs", help="folder the bench folder goes in")


def settings_from(args: argparse.Namespace) -> BenchSettings:
    s = BenchSettings(
        steps=args.steps, replicas=args.replicas, procs=args.procs, seed=args.seed, every_s=args.every_s,
        kinds=[k.strip() for k in args.kinds.split(",") if k.strip()], ckpt_interval=args.ckpt_interval,
        arms=[a.strip() for a in args.arms.split(",") if a.strip()], rounds=args.rounds,
        arm_timeout_s=args.arm_timeout_s,
    )
    for kind in s.kinds:
        if kind not in KINDS:
            raise SystemExit(f"--kinds: '{kind}' can't be injected into every arm; use some of {','.join(KINDS)} "
                             "(comms and hang need monarch-sky's in-process injector: try them with `monarch-sky train`)")
    for arm in s.arms:
        if arm not in arms_mod.LABELS:
            raise SystemExit(f"--arms: unknown arm '{arm}'; allowed: {','.join(arms_mod.LABELS)}")
    if s.replicas < 2 and any(a in s.arms for a in arms_mod.CHAOS_ARMS):
        raise SystemExit("--replicas: the chaos arms need at least 2 replica groups to heal from")
    return s


def run_bench(s: BenchSettings, out: Path) -> Path:
    bench_dir = out / f"bench-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    bench_dir.mkdir(parents=True)
    results: dict[str, list[dict]] = {key: [] for key in s.arms}
    for round_index in range(s.rounds):
        for key in s.arms:
            name = key if s.rounds == 1 else f"{key}-r{round_index}"
            print(f"[bench] round {round_index + 1}/{s.rounds}: {arms_mod.LABELS[key]}", flush=True)
            result = run_arm(key, name, s, bench_dir)
            print(f"[bench]   {_one_line(result)}", flush=True)
            results[key].append(result)
    bench = {
        "bench_id": bench_dir.name,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "settings": asdict(s),
        "arms": {key: _median_of(runs) for key, runs in results.items()},
    }
    bench["ratio_spread"] = ratio_spread(results)
    bench["ratios"] = {name: spread and spread["median"] for name, spread in bench["ratio_spread"].items()}
    (bench_dir / "bench.json").write_text(json.dumps(bench, indent=2) + "\n")
    return bench_dir


def run_arm(key: str, name: str, s: BenchSettings, bench_dir: Path) -> dict:
    plan = arms_mod.plan(key, name, s, bench_dir, REPO)
    started = time.time()
    for launch in plan.launches:
        launch.start()
    deadline = time.monotonic() + s.arm_timeout_s
    next_report = time.monotonic() + PROGRESS_EVERY_S
    try:
        while any(w.exit_code() is None for w in plan.workers) and time.monotonic() < deadline:
            for launch in plan.launches:
                launch.tick()
            if plan.chaos is not None:
                plan.chaos.tick()
            if time.monotonic() >= next_report:
                next_report += PROGRESS_EVERY_S
                print(f"[bench]   {_progress(plan, s, started)}", flush=True)
            time.sleep(0.25)
    finally:
        ended = time.time()
        for launch in plan.launches:
            launch.kill()
    codes = [w.exit_code() for w in plan.workers]
    return _arm_result(key, plan, s, started, ended, codes)


def _arm_result(key: str, plan, s: BenchSettings, started: float, ended: float, codes: list) -> dict:
    # In time order: a DiLoCo group's inner steps are written together, when their call returns.
    lines = sorted(read_jsonl(plan.dir / "steps.jsonl"), key=lambda line: line["wall"])
    result = {"label": arms_mod.LABELS[key], "dir": plan.dir.name, "started_wall": started,
              "exit_code": max((c if c is not None else 124) for c in codes)}
    result.update(metrics.arm_stats(lines, started, ended, s.steps))
    if plan.chaos is not None:
        plan.chaos.write()
        single = key == "D"
        times = [(f["kind"], metrics.fault_times(f, lines, single)) for f in plan.chaos.faults]
        if plan.chaos.excluded:  # kinds its stack cannot see: drawn for it, never injected
            result["excluded_faults"] = {"kinds": list(plan.chaos.excluded), "skipped": plan.chaos.skipped}
    else:
        times = _monarch_fault_times(plan.dir, lines)
    result["faults"] = metrics.by_kind(times)
    return result


def _monarch_fault_times(run_dir: Path, lines: list[dict]) -> list[tuple[str, dict]]:
    """monarch-sky's own fault records, plus when the run step was regained."""
    summary_path = run_dir / "summary.json"
    if not summary_path.exists():
        return []
    records = json.loads(summary_path.read_text()).get("faults", [])
    injected = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "fault_injected"]
    with open(run_dir / "faults.jsonl", "w") as out:
        for event in injected:
            out.write(json.dumps({"wall": event["wall"], "kind": event["kind"], "replica": event["replica"]}) + "\n")
    times = []
    for record, event in zip(records, injected):
        regained = metrics.fault_times({"wall": event["wall"], "replica": record["replica"]}, lines, False)["regained_s"]
        times.append((record["kind"], {"detected_s": record["detected_s"], "resumed_s": record["survivors_resumed_s"],
                                       "rejoined_s": record["rejoined_s"], "regained_s": regained}))
    return times


def ratios(arms: dict[str, dict]) -> dict[str, float | None]:
    """Each ratio whose two arms ran (None where one has no such number)."""
    out = {}
    for name, (num, den, fld) in RATIOS.items():
        if num not in arms or den not in arms:
            continue
        a, b = arms[num].get(fld), arms[den].get(fld)
        out[name] = round(a / b, 3) if a is not None and b else None
    return out


def ratio_spread(results: dict[str, list[dict]]) -> dict[str, dict | None]:
    """Each ratio per round, the arms of one round paired: median, min, max and the values."""
    rounds = min((len(runs) for runs in results.values()), default=0)
    per_round = [ratios({key: runs[i] for key, runs in results.items()}) for i in range(rounds)]
    out: dict[str, dict | None] = {}
    for name in (per_round[0] if per_round else {}):
        values = [r[name] for r in per_round if r[name] is not None]
        out[name] = {"median": round(statistics.median(values), 3), "min": min(values), "max": max(values),
                     "rounds": values} if values else None
    return out


def _median_of(runs: list[dict]) -> dict:
    if len(runs) == 1:
        return runs[0]
    merged = dict(runs[-1])
    for fld, value in runs[-1].items():
        values = [r[fld] for r in runs if isinstance(r.get(fld), (int, float)) and not isinstance(r.get(fld), bool)]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and values:
            merged[fld] = round(statistics.median(values), 4)
    merged["rounds"] = runs
    return merged


def _progress(plan, s: BenchSettings, started: float) -> str:
    lines = read_jsonl(plan.dir / "steps.jsonl")
    step = max(metrics.first_commits(lines), default=0)
    faults = f", {len(plan.chaos.faults)} faults injected" if plan.chaos is not None else ""
    return f"{plan.key}: step {step}/{s.steps} after {time.time() - started:.0f}s{faults}"


def _one_line(r: dict) -> str:
    return (f"exit {r['exit_code']}, {r['committed_steps']} steps in {r['wall_s']:.0f}s, "
            f"goodput {r['goodput']}, time to target {r['time_to_target_s']}, work rate {r['work_rate']}")
