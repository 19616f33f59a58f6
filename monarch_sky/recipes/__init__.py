"""Recipes: named TorchTitan training setups plus the job settings they default to.

A recipe is cheap to look up (the CLI validates `recipe=` before anything is spawned);
only `build_trainer` imports torchtitan, and it runs inside the replica processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from monarch_sky.common import hub_assets, released_weights
from monarch_sky.common.checkpoints import CheckpointSpec
from monarch_sky.recipes import llama3, qwen3


@dataclass(frozen=True)
class TrainerSpec:
    """Everything a replica group needs to build its TorchTitan trainer."""

    recipe: str
    replica: int  # index of this replica group
    replicas: int  # number of replica groups (TorchTitan's FT group_size: the data split)
    procs_per_replica: int  # per host
    steps: int
    seed: int
    training: dict[str, Any]  # seq_len, local_batch_size, lr, warmup_steps
    data: dict[str, Any]  # tokenizer_path (resolved), tokenizer_repo, dataset, dataset_path
    ft: dict[str, Any]  # mode, sync_steps, process_group_timeout_ms, ...
    dump_folder: str
    platform_kind: str  # "cpu" | "rocm" | "cuda"; "" = what the replica's own host has
    checkpoint: CheckpointSpec | None = None  # the last resort; None: no checkpointer at all
    hosts_per_replica: int = 1
    run_id: str = ""  # names the run's node memory (monarch_sky.common.node_memory)
    snapshot_every: int = 0  # committed steps between snapshots to node memory; 0: none
    restore_step: int | None = None  # load this step from node memory at setup (never when rejoining)
    init_weights: str | None = None  # a folder of HF safetensors to start from (None: random weights)

    @property
    def ranks(self) -> int:
        """Processes in the group (`config.ranks_per_group` of the job it came from)."""
        return self.procs_per_replica * self.hosts_per_replica

    @classmethod
    def from_job(
        cls, cfg, replica: int, dump_folder: str, platform_kind: str = "", checkpoint: CheckpointSpec | None = None,
        restore_step: int | None = None,
    ) -> "TrainerSpec":
        """The spec for replica group `replica` of a validated job config."""
        return cls(
            recipe=cfg.recipe,
            replica=replica,
            replicas=cfg.replicas,
            procs_per_replica=cfg.procs_per_replica,
            steps=cfg.steps,
            seed=cfg.seed,
            training=dict(cfg.training),
            data=hub_assets.resolved(cfg.data),
            ft=dict(cfg.ft),
            dump_folder=dump_folder,
            platform_kind=platform_kind,
            hosts_per_replica=cfg.hosts_per_replica,
            checkpoint=checkpoint,
            run_id=cfg.run_id or "",
            snapshot_every=cfg.snapshot.every_steps,
            restore_step=restore_step,
            init_weights=released_weights.weights_path(cfg.init),
        )

    def on_host(self, kind: str) -> "TrainerSpec":
        """The spec a trainer builds from on a host whose platform is `kind`: a spec the
        controller left open ("") takes the host's; one that names a platform keeps it."""
        return self if self.platform_kind else replace(self, platform_kind=kind)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    build_trainer: Callable[[TrainerSpec], Any]
    params: int  # the model's parameter count (tests/control/test_heal_budget.py builds the model to check)
    largest_param: int  # its largest parameter tensor's elements (the embedding: vocabulary x width)
    vocab_size: int  # token ids its embedding takes: a tokenizer that makes more cannot train it
    job_defaults: dict[str, Any] = field(default_factory=dict)


def hub_data(tokenizer_repo: str) -> dict[str, Any]:
    """A real model's data: its own tokenizer (fetched on each node during setup, see
    `monarch_sky.common.hub_assets`) and C4, streamed from the hub."""
    return {"tokenizer_path": None, "tokenizer_repo": tokenizer_repo, "dataset": "c4", "dataset_path": None}


# Minutes between last-resort checkpoints for about 1% of the throughput: a save pauses
# training for its staging, 12 bytes a parameter per rank (12.0 GB for 8B, 105.8 GB for 70B,
# 8 ranks) at the 0.97-1.28 GB/s DCP staged here (tools/checkpoint_cost.py,
# docs/checkpoints.md): 10-13 s and 83-109 s a save, every 16-21 and 138-181 min.
CHECKPOINT_EVERY_MIN = {"llama3_8b": 20.0, "llama3_70b": 180.0}
CHECKPOINT_MIN_PER_BILLION = CHECKPOINT_EVERY_MIN["llama3_8b"] / 8.0  # other sizes: in proportion (the save's staging is)


def _qwen3(name: str, size: str, build, params: int, largest: int, procs: int, lr: float) -> "Recipe":
    """A real Qwen3 size: its own tokenizer and C4, like the llama3 ones."""
    return Recipe(
        name=name,
        description=f"Qwen3 {size} (dense), FSDP over {procs} GPUs per replica group",
        build_trainer=build,
        params=params,
        largest_param=largest,
        vocab_size=151_936,
        job_defaults={
            "replicas": 2,
            "procs_per_replica": procs,
            "steps": 1000,
            "training": {"seq_len": 4096, "local_batch_size": 1, "lr": lr, "warmup_steps": 200},
            "data": hub_data(f"Qwen/Qwen3-{size}"),
            "checkpoint": {"every_min": max(5.0, float(round(CHECKPOINT_MIN_PER_BILLION * params / 1e9)))},
        },
    )

# The CPU models' run: 3 groups of 2 processes, one killed mid-run (`faults=auto`).
TINY_DEFAULTS = {
    "replicas": 3,
    "procs_per_replica": 2,
    "steps": 100,
    "faults": "auto",
    "training": {"seq_len": 128, "local_batch_size": 4, "lr": 3e-3, "warmup_steps": 5},
}

RECIPES: dict[str, Recipe] = {
    "llama3_tiny": Recipe(
        name="llama3_tiny",
        description="4-layer, 128-dim llama3 for CPU runs and tests (the local default)",
        build_trainer=llama3.tiny,
        params=935_040,
        largest_param=65_536,
        vocab_size=512,
        job_defaults=TINY_DEFAULTS,
    ),
    "llama3_debug": Recipe(
        name="llama3_debug",
        description="TorchTitan's llama3 debug model (6 layers, 256 dim): smoke tests on any node",
        build_trainer=llama3.debug,
        params=6_163_712,
        largest_param=524_288,
        vocab_size=2048,
        job_defaults={
            "replicas": 2,
            "procs_per_replica": 1,
            "steps": 50,
            "training": {"seq_len": 256, "local_batch_size": 2, "lr": 8e-4, "warmup_steps": 5},
        },
    ),
    "llama3_8b": Recipe(
        name="llama3_8b",
        description="Llama 3 8B, FSDP over 8 GPUs per replica group",
        build_trainer=llama3.llama3_8b,
        params=8_030_261_248,
        largest_param=525_336_576,
        vocab_size=128_256,
        job_defaults={
            "replicas": 2,
            "procs_per_replica": 8,
            "steps": 1000,
            "training": {"seq_len": 8192, "local_batch_size": 1, "lr": 3e-4, "warmup_steps": 200},
            "data": hub_data("meta-llama/Llama-3.1-8B"),
            "checkpoint": {"every_min": CHECKPOINT_EVERY_MIN["llama3_8b"]},
        },
    ),
    "llama3_70b": Recipe(
        name="llama3_70b",
        description="Llama 3 70B, FSDP over 8 GPUs per replica group (MI300X/MI325X/MI355X memory)",
        build_trainer=llama3.llama3_70b,
        params=70_553_706_496,
        largest_param=1_050_673_152,
        vocab_size=128_256,
        job_defaults={
            "replicas": 2,
            "procs_per_replica": 8,
            "steps": 1000,
            "training": {"seq_len": 8192, "local_batch_size": 1, "lr": 1.5e-4, "warmup_steps": 200},
            "data": hub_data("meta-llama/Llama-3.1-70B"),
            "checkpoint": {"every_min": CHECKPOINT_EVERY_MIN["llama3_70b"]},
        },
    ),
    "qwen3_tiny": Recipe(
        name="qwen3_tiny",
        description="4-layer, 128-dim Qwen3 (QK norm, tied embeddings) for CPU runs and tests",
        build_trainer=qwen3.tiny,
        params=853_248,
        largest_param=65_536,
        vocab_size=512,
        job_defaults=TINY_DEFAULTS,
    ),
    "qwen3_0_6b": _qwen3("qwen3_0_6b", "0.6B", qwen3.qwen3_0_6b, 596_049_920, 155_582_464, procs=8, lr=3e-4),
    "qwen3_8b": _qwen3("qwen3_8b", "8B", qwen3.qwen3_8b, 8_190_735_360, 622_329_856, procs=8, lr=3e-4),
    "qwen3_32b": _qwen3("qwen3_32b", "32B", qwen3.qwen3_32b, 32_762_123_264, 777_912_320, procs=8, lr=1.5e-4),
}
