"""The benchmark's arms: what each one launches, and its fault injection.

A   monarch-sky, no faults (`ft.mode=step`, and `A_diloco` with `ft.mode=diloco`)
B   TorchTitan alone: one torchrun, HSDP over the same processes, no TorchFT, no faults
C   monarch-sky under the chaos schedule (its own injector)
C'  (key C_spare) C with one hot spare host (`hosts.spares=1`): a lost host's group moves onto
    it at once instead of waiting for a new host
D   TorchTitan with periodic checkpoints under `torchrun --max-restarts`: any fault
    restarts the whole job from the last checkpoint; a host fault requeues the job
E   TorchFT without Monarch, as TorchTitan documents it: a lighthouse started by hand and
    one torchrun with restarts per replica group, healing from a peer group
E'  (key E_best) E at its best: the same launches, with what monarch-sky's trainer registers
    with TorchFT instead of TorchTitan's checkpointer (`titan_arm.heal_at_its_best`). It
    differs from C only in orchestration: torchrun restarts a dead group in place; nothing
    notices a stopped or hung one, so those kinds are left out of its schedule (and
    reported as excluded), and a lost host's group comes back only with its relaunch.
C and E' also run in `ft.mode=diloco` (keys C_diloco, E_best_diloco; not in the default
list): E' then trains with TorchTitan's own DiLoCo loop.
D, E and E' take the same schedule from `OutsideChaos`. Every arm trains the same recipe,
seed and length, and writes `steps.jsonl` into its folder.
"""

from __future__ import annotations

import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path

from monarch_sky.bench.launch import Launch, free_port
from monarch_sky.bench.outside_chaos import OutsideChaos
from monarch_sky.config import FTSettings
from monarch_sky.replica.heal_wire import HEAL_SECRET_ENV

LABELS = {
    "A_step": "A: monarch-sky, no faults (step)",
    "A_diloco": "A: monarch-sky, no faults (diloco)",
    "B": "B: TorchTitan alone (HSDP), no faults",
    "C": "C: monarch-sky, chaos",
    "C_spare": "C': monarch-sky, chaos, one hot spare host",
    "D": "D: checkpoint + torchrun restart, chaos",
    "E": "E: TorchFT + torchrun, no Monarch, chaos",
    "E_best": "E': TorchFT + torchrun at its best, no Monarch, chaos",
    "C_diloco": "C: monarch-sky, chaos (diloco)",
    "E_best_diloco": "E': TorchFT + torchrun at its best, no Monarch, chaos (diloco)",
}
UNSEEN_BY_TORCHRUN = ("stop", "hang")  # a frozen or hung rank never exits: torchrun waits on it
MONARCH_ARMS = ("A_step", "A_diloco", "C", "C_spare", "C_diloco")
CHAOS_ARMS = ("C", "C_spare", "C_diloco", "D", "E", "E_best", "E_best_diloco")
DILOCO_ARMS = ("A_diloco", "C_diloco", "E_best_diloco")


@dataclass
class ArmPlan:
    key: str
    dir: Path
    launches: list[Launch]  # the last ones are the arm's work; a lighthouse comes first
    chaos: OutsideChaos | None
    workers: list[Launch]  # the launches whose exit ends the arm


def job_overrides(s, key: str) -> list[str]:
    return [f"ft.mode={'diloco' if key in DILOCO_ARMS else 'step'}",
        f"replicas={s.replicas}", f"procs_per_replica={s.procs}", f"steps={s.steps}",
        f"seed={s.seed}", "faults=none", "wandb.mode=disabled",
        f"ft.max_restarts={s.max_restarts}", f"hosts.max_replacements={s.max_restarts}",
        f"hosts.provision_delay_s={s.provision_delay_s}",
    ]


def plan(key: str, name: str, s, bench_dir: Path, repo: Path) -> ArmPlan:
    """Arm `key`'s launches, its folder `bench_dir/name`."""
    arm_dir = bench_dir / name
    arm_dir.mkdir(parents=True, exist_ok=True)
    # torch 2.13's torchrun keeps one rendezvous store across restarts without per-attempt
    # keys: restarted workers would read the dead ones' addresses (see bench/titan_arm.py).
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def launch(name: str, cmd: list[str], extra: dict[str, str] | None = None) -> Launch:
        return Launch(name, cmd, {**env, **(extra or {})}, arm_dir / f"{name}.log", repo)

    if key in MONARCH_ARMS:
        work = [launch("train", _monarch_cmd(key, name, s, bench_dir))]
        return ArmPlan(key, arm_dir, work, None, work)
    if key in ("B", "D"):
        job = launch("torchrun", _torchrun(s.replicas * s.procs, key, arm_dir, s))
        chaos = OutsideChaos(arm_dir, s, lambda _replica: job, single_job=True) if key == "D" else None
        return ArmPlan(key, arm_dir, [job], chaos, [job])
    if key in ("E", "E_best", "E_best_diloco"):
        port = free_port()
        lighthouse = launch("lighthouse", _lighthouse_cmd(port, s))
        extra = {"TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
        excluded: tuple[str, ...] = ()
        if key != "E":
            extra[HEAL_SECRET_ENV] = secrets.token_hex(32)
            excluded = UNSEEN_BY_TORCHRUN
        groups = [
            launch(f"replica{r}", _torchrun(s.procs, key, arm_dir, s, replica=r), extra) for r in range(s.replicas)
        ]
        chaos = OutsideChaos(arm_dir, s, lambda replica: groups[replica], single_job=False, excluded=excluded)
        return ArmPlan(key, arm_dir, [lighthouse, *groups], chaos, groups)
    raise ValueError(f"arms: unknown arm '{key}'; allowed: {', '.join(LABELS)}")


def _monarch_cmd(key: str, name: str, s, bench_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "monarch_sky", "train", *job_overrides(s, key),
           f"run_dir={bench_dir}", f"run_id={name}"]
    if key in CHAOS_ARMS:
        cmd += [f"chaos.every_s={s.every_s}", f"chaos.kinds=[{','.join(s.kinds)}]", f"chaos.seed={s.seed}",
                f"hosts.spares={int(key == 'C_spare')}"]
    return cmd


def _torchrun(nproc: int, key: str, arm_dir: Path, s, replica: int | None = None) -> list[str]:
    arm = {"B": "alone", "D": "ckpt", "E": "torchft", "E_best": "torchft_best", "E_best_diloco": "torchft_best"}[key]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    if key != "B":
        cmd.append(f"--max-restarts={s.max_restarts}")
    cmd += ["-m", "monarch_sky.bench.titan_arm", "--arm", arm, "--out", str(arm_dir)]
    if key != "B":  # E heals from peers: no checkpoints, as in monarch-sky
        cmd += ["--ckpt-interval", str(s.ckpt_interval if key == "D" else 0)]
    if replica is not None:
        cmd += ["--replica", str(replica)]
    return [*cmd, "--", *job_overrides(s, key)]


def _lighthouse_cmd(port: int, s) -> list[str]:
    lighthouse = Path(sys.executable).parent / "torchft_lighthouse"
    ft = FTSettings()  # the lighthouse settings monarch-sky's controller uses by default
    return [str(lighthouse), "--bind", f"127.0.0.1:{port}", "--min_replicas", str(ft.min_replicas),
            "--join_timeout_ms", str(ft.join_timeout_ms), "--quorum_tick_ms", str(ft.quorum_tick_ms),
            "--heartbeat_timeout_ms", str(ft.heartbeat_timeout_ms)]
