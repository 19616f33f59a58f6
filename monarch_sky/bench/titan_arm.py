"""Benchmark arms without Monarch: monarch-sky's model, data and recipe in TorchTitan's own loop.

The config is built as a monarch-sky replica builds it (same platform preparation, the
recipe's `build_trainer`), changed per arm, and run with `trainer.train()`:

alone (B)    plain `torchtitan.trainer.Trainer`, no TorchFT, no checkpoints: HSDP over all
             replicas*procs_per_replica ranks (replicate=replicas, shard=procs_per_replica).
               torchrun --standalone --nproc_per_node=R*P -m monarch_sky.bench.titan_arm \
                   --arm alone --out DIR -- replicas=R procs_per_replica=P steps=N ...
ckpt (D)     alone plus TorchTitan's periodic async DCP checkpoints (--ckpt-interval) in
             DIR/torchtitan/checkpoint, resumed from on start. Under
             `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts=K ... --arm ckpt`
             a dead rank makes torchrun restart all workers, which resume from the last one.
torchft (E)  TorchTitan's FaultTolerantTrainer + TorchFT, one torchrun per replica group; its
             TorchFT checkpoint manager lets a restarted group heal live from a peer group.
               torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 1 --join_timeout_ms 10000 &
               TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
                   torchrun --standalone --nproc_per_node=P --max-restarts=K \
                   -m monarch_sky.bench.titan_arm --arm torchft --replica I --out DIR -- ...
             ft.mode=step only.
torchft_best (E')  E at its best, still without Monarch: no TorchTitan checkpointer; instead
             what monarch-sky's trainer registers with TorchFT (`heal_at_its_best`). The same
             torchrun and lighthouse commands, with one MONARCH_SKY_HEAL_SECRET for all groups.
             ft.mode=step or diloco (TorchTitan's own DiLoCo, as its TorchFT config ships it).

Each process writes DIR/pids/replica{R}-rank{K}.pid at start (for a fault injector); each
group's rank 0 (alone/ckpt: global rank 0, replica -1) appends one JSON line per iteration to
DIR/steps.jsonl: wall, replica, step, committed, seconds, loss, participants
(`titan_step_log.StepLog`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

ARMS = ("alone", "ckpt", "torchft", "torchft_best")
FT_ARMS = ("torchft", "torchft_best")


def parse_args(argv: list[str] | None = None):
    p = argparse.ArgumentParser(
        prog="torchrun ... -m monarch_sky.bench.titan_arm",
        description="Train monarch-sky's recipe with TorchTitan alone, with checkpoints, or with TorchFT.",
    )
    p.add_argument("--arm", required=True, choices=ARMS)
    p.add_argument("--out", required=True, type=Path, help="folder for pids/, steps.jsonl, torchtitan/")
    p.add_argument("--replica", type=int, help="torchft, torchft_best: this torchrun's replica group index")
    p.add_argument("--ckpt-interval", type=int, default=20,
                   help="ckpt, torchft: steps between checkpoints (torchft: 0 = none, heal from peers only)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="monarch-sky job overrides (after --)")
    args = p.parse_args(argv)
    from monarch_sky.config import load_job
    from monarch_sky.validation import ConfigError

    try:
        cfg = load_job([*args.overrides, "faults=none"]).config
    except ConfigError as e:
        p.error(str(e))
    if problem := _problem(args, cfg):
        p.error(problem)
    return args, cfg


def _problem(args, cfg) -> str | None:
    env, ft = os.environ, args.arm in FT_ARMS
    want = cfg.procs_per_replica if ft else cfg.replicas * cfg.procs_per_replica
    if "RANK" not in env:
        return "run me under torchrun (no RANK in the environment)"
    if int(env["WORLD_SIZE"]) != want:
        return f"--arm {args.arm} needs --nproc_per_node={want} for this job, torchrun started {env['WORLD_SIZE']}"
    if ft != (args.replica is not None):
        return f"--replica is required with --arm {'/'.join(FT_ARMS)}, and only allowed there"
    if ft and not 0 <= args.replica < cfg.replicas:
        return f"--replica {args.replica}: must be in [0, {cfg.replicas})"
    if ft and not env.get("TORCHFT_LIGHTHOUSE"):
        return f"--arm {args.arm} needs TORCHFT_LIGHTHOUSE=http://HOST:PORT of a running torchft_lighthouse"
    if args.arm != "torchft_best" and cfg.ft.mode != "step":
        return f"--arm {args.arm} supports ft.mode=step only, not {cfg.ft.mode} (torchft_best runs diloco too)"
    if int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torch 2.13's torchrun keeps one rendezvous TCPStore across restarts and workers' keys
        # carry no attempt prefix: restarted gloo ranks (and TorchFT's manager clients) read the
        # dead workers' addresses and never connect.
        return "--max-restarts needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment"
    if args.ckpt_interval < 0 or (args.arm == "ckpt" and args.ckpt_interval == 0):
        return f"--ckpt-interval {args.ckpt_interval}: must be at least 1 (torchft: 0 = no checkpoints)"
    return None


def write_pid(out: Path, replica: int, rank: int) -> None:
    path = out / "pids" / f"replica{replica}-rank{rank}.pid"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(f"{os.getpid()}\n")
    os.replace(tmp, path)  # an injector never reads a half-written file


def prepare_process(cfg):
    """What a monarch-sky replica process gets (context.proc_env, replica.warm, GroupTrainer),
    plus two shims Trainer.train needs and monarch-sky never reaches: after step 1 it calls
    `set_pg_timeouts`, which calls `torch.distributed.set_timeout` (absent from torch 2.13:
    it has `_set_pg_timeout`) after `barrier(device_ids=[current_device()])`, which rejects
    the CPU device module's answer "cpu"."""
    from monarch_sky.common import platform as platform_mod
    from monarch_sky.control.context import trainer_env
    from monarch_sky.replica.heal_wire import HEAL_SECRET_ENV
    from monarch_sky.replica.trainer import import_torchtitan

    shared_secret = os.environ.get(HEAL_SECRET_ENV)  # E': one for all groups, from the bench
    os.environ.update(trainer_env(cfg, platform_mod.detect()))
    if shared_secret:
        os.environ[HEAL_SECRET_ENV] = shared_secret
    platform_mod.advertise_host()
    plat = import_torchtitan()
    import torch
    from torch.distributed import distributed_c10d
    from torchtitan.tools import utils

    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = distributed_c10d._set_pg_timeout
    if plat.is_cpu:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        utils.device_module.current_device = lambda: 0
    return plat


def arm_config(args, cfg, plat):
    from monarch_sky.recipes import RECIPES, TrainerSpec

    spec = TrainerSpec.from_job(cfg, args.replica or 0, str(args.out / "torchtitan"), plat.kind)
    config = RECIPES[cfg.recipe].build_trainer(spec)  # a FaultTolerantTrainer.Config
    if args.arm == "torchft":
        # The recipe's FT settings as they are (replica_id, group_size=replicas, gloo on CPU,
        # timeouts, min replicas). Enabling TorchTitan's TorchFT checkpoint manager is what
        # registers model, optimizer, scheduler and step with TorchFT for live healing.
        from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager

        config.checkpoint = _checkpoint(TorchFTCheckpointManager.Config, args.ckpt_interval)
        return config
    if args.arm == "torchft_best":
        return config  # the recipe's: TorchTitan's checkpointer off (see heal_at_its_best)
    return _plain_config(config, cfg, args.ckpt_interval if args.arm == "ckpt" else 0)


def heal_at_its_best(trainer, cfg, plat) -> None:
    """E': register with TorchFT what monarch-sky's trainer registers, without Monarch.

    - the rank-local heal state (`monarch_sky.replica.healing`): TorchTitan's registers
      `model.state_dict()`, whose fused-QKV hook runs a collective on TorchFT's quorum thread
      (torchft #343, torchtitan #4209);
    - TorchTitan's step counter (its loop counts its own steps; its checkpointer, off here,
      would carry it);
    - monarch-sky's heal transport (`ft.heal_transport`), as C uses it: a restarted group
      (torchrun's restart count) maps its receive buffer while it builds, and any rank rebuilds
      received DTensors (DiLoCo's outer momentum) on its parameters' mesh;
    - the wait for the step's quorum before `should_commit` (a torchft 0.2.0 bug, see
      `healing.register_with_torchft`);
    - C's CPU priority policy for trainers;
    - on gloo, the failed process group freed at a step's first error (`platform.close_links_on_error`);
    - DiLoCo: a healing group's pseudo-gradient zeroed (`contribute_nothing_when_healed`).
    """
    from monarch_sky.common import cpu_priority
    from monarch_sky.common import platform as platform_mod
    from monarch_sky.replica import heal_transport
    from monarch_sky.replica.healing import register_with_torchft

    manager = trainer.ft_manager.manager
    transport = heal_transport.install(manager, cfg.ft.heal_transport, cfg.ft.timeout_s)
    params = [p for m in trainer.model_parts for p in m.parameters()]
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    heal_transport.prepare_receive(transport, params, cfg.ft.mode == "diloco", restarted)
    register_with_torchft(manager, trainer)
    manager.register_state_dict_fn("titan_step", lambda s: setattr(trainer, "step", s["step"]),
                                   lambda: {"step": trainer.step})
    cpu_priority.yield_cpu_to_recovery(plat.kind)
    if plat.backend == "gloo":
        platform_mod.close_links_on_error(manager)
    if cfg.ft.mode == "diloco":
        contribute_nothing_when_healed(manager)


def contribute_nothing_when_healed(manager) -> None:
    """E' in DiLoCo: what `GroupTrainer._contribute_nothing` does for monarch-sky. A group
    heals inside a sync, before its pseudo-gradient is taken; with the peer's parameters just
    loaded it would send the peer's pseudo-gradient again and count that peer twice. After
    DiLoCo registers its own state (inside TorchTitan's `train()`), a last entry resets a
    healing group's parameters to the healed originals: its pseudo-gradient is zero."""
    import contextlib

    from torchtitan.experiments.torchft import trainer as ft_trainer

    from monarch_sky.replica.trainer import REJOIN_KEY

    semi_sync_training = ft_trainer.maybe_semi_sync_training

    @contextlib.contextmanager
    def with_reset(*args, **kwargs):
        with semi_sync_training(*args, **kwargs) as diloco:
            def reset(_state: dict) -> None:
                for fragment in diloco._fragments:  # torchft has no public accessor
                    fragment.restore_parameters()

            manager.register_state_dict_fn(REJOIN_KEY, reset, dict)
            yield diloco

    ft_trainer.maybe_semi_sync_training = with_reset


def _recast(cls, config):
    """`config` as an instance of its base class `cls` (the fields `cls` has)."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if f.init})


def _checkpoint(cls, interval: int):
    # Async (a thread writes the DCP files, over a gloo group) works on CPU and is TorchTitan's
    # pick for cheap periodic saves; "async_with_pinned_mem" needs CUDA. The last step's save is
    # full too (as in TorchTitan's TorchFT config): a worker restarted after a model-only one
    # fails to resume from it, on every restart.
    return cls(enable=True, interval=interval or 10**9, async_mode="async", last_save_model_only=False)


def _plain_config(config, cfg, interval: int):
    """TorchTitan's plain Trainer: no fault_tolerance section at all (FT off). Not the
    FaultTolerantTrainer with FT disabled: its TorchFT optimizer container needs a live
    manager, and its __init__ is an older copy of Trainer's (no spmd backend switch, no
    dataloader snapshots for checkpoint resumption)."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.trainer import Trainer

    plain = _recast(Trainer.Config, config)
    plain.optimizer = _recast(OptimizersContainer.Config, config.optimizer)
    plain.parallelism = dataclasses.replace(config.parallelism, data_parallel_replicate_degree=cfg.replicas,
                                            data_parallel_shard_degree=cfg.procs_per_replica)
    plain.checkpoint = _checkpoint(CheckpointManager.Config, interval) if interval else CheckpointManager.Config()
    return plain


def check_layout(trainer, replica: int) -> None:
    """alone/ckpt: the pid file's replica (rank // procs_per_replica) is the rank's HSDP replica."""
    mesh = trainer.parallel_dims.get_optional_mesh("dp_replicate")
    actual = mesh.get_local_rank() if mesh is not None else 0
    if actual != replica:
        raise RuntimeError(f"rank {os.environ['RANK']} is in HSDP replica {actual}, not {replica}")


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(argv)
    rank, ft = int(os.environ["RANK"]), args.arm in FT_ARMS
    replica = args.replica if ft else rank // cfg.procs_per_replica  # replicate is the outer mesh dim
    write_pid(args.out, replica, rank if ft else rank % cfg.procs_per_replica)
    plat = prepare_process(cfg)
    import torch
    from torchtitan.tools.logging import init_logger

    from monarch_sky.bench.titan_step_log import StepLog
    from monarch_sky.common import platform as platform_mod

    init_logger()
    trainer = arm_config(args, cfg, plat).build()
    try:
        if plat.backend == "gloo":
            platform_mod.force_sum_reduction(trainer.model_parts)  # the replicas' CPU shim: gloo has no PREMUL_SUM
        if args.arm == "torchft_best":
            heal_at_its_best(trainer, cfg, plat)
        if not ft:
            check_layout(trainer, replica)
        StepLog(trainer, args.out / "steps.jsonl", replica if ft else -1, rank == 0, cfg.replicas,
                diloco=cfg.ft.mode == "diloco")
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
