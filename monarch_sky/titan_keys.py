"""TorchTitan's names for the settings monarch-sky has, and its TOML job files.

A TorchTitan user types `--training.steps 500`, `--optimizer.lr 3e-4`, `--model.flavor 8B` or
`--job.config_file llama3_8b.toml`. Each of TorchTitan's keys that monarch-sky has under another
name is read as ours (`translate`); one it does not have is answered with what to use instead
(a ConfigError naming both), never taken silently. A TOML file's keys go the same way, under
the command line's overrides.
"""

from __future__ import annotations

import logging
from pathlib import Path

from monarch_sky.validation import ConfigError

log = logging.getLogger(__name__)

# TorchTitan's key -> monarch-sky's.
SAME = {
    "training.steps": "steps",
    "training.seq_len": "training.seq_len",
    "training.local_batch_size": "training.local_batch_size",
    "training.seed": "seed",
    "debug.seed": "seed",
    "training.dataset": "data.dataset",
    "training.dataset_path": "data.dataset_path",
    "optimizer.lr": "training.lr",
    "lr_scheduler.warmup_steps": "training.warmup_steps",
    "model.tokenizer_path": "data.tokenizer_path",
    "model.hf_assets_path": "data.tokenizer_path",
    "job.dump_folder": "run_dir",
    "checkpoint.initial_load_path": "init.weights_path",
    "compile.enable": "training.compile",
    "activation_checkpoint.mode": "training.activation_checkpoint",
    "training.mixed_precision_param": "training.mixed_precision",
    "parallelism.tensor_parallel_degree": "training.tensor_parallel",
    "fault_tolerance.sync_steps": "ft.sync_steps",
    "fault_tolerance.min_replica_size": "ft.min_replicas",
    "fault_tolerance.group_size": "replicas",
    "parallelism.data_parallel_shard_degree": "procs_per_replica",  # -1, TorchTitan's "all of them": as is
}
# TorchTitan's llama3 flavors -> monarch-sky's recipes.
FLAVORS = {"debugmodel": "llama3_debug", "8B": "llama3_8b", "70B": "llama3_70b"}
# TorchTitan's keys monarch-sky sets itself or does not offer: what to do instead.
ANSWERS = {
    "parallelism.data_parallel_replicate_degree": "a replica group shards (FSDP) over its procs_per_replica GPUs "
                                                  "and TorchFT replicates across groups: set replicas (leave it at 1)",
    "parallelism.pipeline_parallel_degree": "pipeline parallelism is not offered; a group is FSDP over procs_per_replica",
    "parallelism.context_parallel_degree": "context parallelism is not offered; a group is FSDP over procs_per_replica",
    "checkpoint.initial_load_in_hf": "released weights load as Hugging Face safetensors (init.weights_path, "
                                     "init.weights_repo); a monarch-sky run's own checkpoints resume under its run_id",
    "checkpoint.initial_load_model_only": "released weights load the model only; optimizer state starts fresh",
    "checkpoint.interval": "monarch-sky's last-resort checkpoints are timed: checkpoint.every_min (its heals need none)",
    "model.name": "pick the model with recipe= (llama3_tiny, llama3_debug, llama3_8b, llama3_70b)",
    "metrics.enable_wandb": "W&B is always on: wandb.mode=auto|online|offline|disabled",
    "fault_tolerance.enable": "fault tolerance is what monarch-sky is: always on",
    "fault_tolerance.semi_sync_method": "ft.mode=diloco (or ft.mode=step, the default)",
}


def translate(overrides: list[str]) -> list[str]:
    """KEY=VALUE overrides with TorchTitan's keys made ours; a `job.config_file` TOML file's
    keys come first, so the command line's win."""
    out: list[str] = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "job.config_file":
            out = [*toml_overrides(value), *out]
        elif _is_titans(key):
            out += [ours] if (ours := _ours(key, value, source=key)) else []
        else:
            out.append(item)
    return out


def toml_overrides(path: str) -> list[str]:
    """A TorchTitan job file's settings as monarch-sky overrides (its keys, translated)."""
    import tomllib

    try:
        table = tomllib.loads(Path(path).expanduser().read_text())
    except FileNotFoundError:
        raise ConfigError(f"job.config_file: no file {path}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"job.config_file: {path} is not TOML: {e}") from None
    out, ignored = [], []
    for key, value in _flat(table):
        if _is_titans(key):
            out += [ours] if (ours := _ours(key, _text(value), source=f"{path}: {key}")) else []
        else:
            ignored.append(key)
    if ignored:
        log.warning("job.config_file %s: monarch-sky sets these itself or has no such setting, so they are not "
                    "used: %s", path, ", ".join(ignored))
    return out


def _is_titans(key: str) -> bool:
    """One of TorchTitan's names this module reads or answers."""
    return key in SAME or key in ANSWERS or key == "model.flavor"


def _ours(key: str, value: str, source: str) -> str | None:
    """Our KEY=VALUE for one of TorchTitan's settings; None when it asks for nothing new."""
    if key == "model.flavor":
        if value not in FLAVORS:
            raise ConfigError(f"{source}={value}: monarch-sky trains llama3 flavors {', '.join(FLAVORS)} "
                              f"(recipe={', recipe='.join(FLAVORS.values())}) and its own llama3_tiny")
        return f"recipe={FLAVORS[value]}"
    if key in SAME:
        return None if value == "-1" and key.endswith("_degree") else f"{SAME[key]}={value}"
    if key in ANSWERS:
        if _already_so(key, value):
            return None
        raise ConfigError(f"{source}: TorchTitan's setting; {ANSWERS[key]}")
    return f"{key}={value}"  # not TorchTitan's: validation names it


def _already_so(key: str, value: str) -> bool:
    """A value that asks for what monarch-sky does anyway (a degree of 1, fault tolerance on,
    the llama3 model)."""
    if key.endswith("_degree"):
        return value in ("1", "-1")
    return (key, value.lower()) in {("fault_tolerance.enable", "true"), ("model.name", "llama3"),
                                    ("checkpoint.initial_load_in_hf", "true"), ("checkpoint.initial_load_model_only", "true")}


def _flat(table: dict, prefix: str = "") -> list[tuple[str, object]]:
    items = []
    for key, value in table.items():
        if isinstance(value, dict):
            items += _flat(value, f"{prefix}{key}.")
        else:
            items.append((prefix + key, value))
    return items


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)
