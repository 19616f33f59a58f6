"""Every rule a job's settings must meet before anything starts.

Each mistake raises `ConfigError` with a message that starts with the field and says what
is allowed; the CLI turns it into exit code 2. No value that passes may hang a run.
"""

from __future__ import annotations

import math
import os
import re

from omegaconf import DictConfig, OmegaConf

from monarch_sky.faults.spec import CONTROLLER, KINDS, PROCESS_KINDS, SERVE, Fault
from monarch_sky.recipes import RECIPES


class ConfigError(ValueError):
    pass


CHOICES = {
    "ft.mode": ("step", "diloco"),
    "training.activation_checkpoint": ("auto", "full", "selective", "none"),
    "training.mixed_precision": ("auto", "bfloat16", "float32"),
    "ft.heal_transport": ("auto", "tcp", "rdma", "http"),
    "hosts.provider": ("local", "addresses", "skypilot"),
    "hosts.spare_warm_up": ("auto", "always", "never"),
    "wandb.mode": ("auto", "online", "offline", "disabled"),
    "checkpoint.async_mode": ("async", "async_with_pinned_mem"),
}
# Numeric bounds, checked in this order; a value must also be finite (no nan or inf).
AT_LEAST_ONE = (
    "replicas",
    "training.tensor_parallel",
    "procs_per_replica",
    "hosts_per_replica",
    "steps",
    "ft.sync_steps",
    "ft.min_replicas",
    "training.seq_len",
    "training.local_batch_size",
)
MORE_THAN_ZERO = (  # a zero timeout or tick fails every wait, or never ends one
    "training.lr",
    "ft.process_group_timeout_ms",
    "ft.rendezvous_timeout_ms",
    "ft.heartbeat_timeout_ms",
    "ft.quorum_tick_ms",
    "ft.join_timeout_ms",
    "ft.quorum_timeout_s",
    "ft.timeout_s",
    "timeouts.spawn_s",
    "timeouts.step_s",
    "timeouts.stop_s",
    "timeouts.hang_s",
    "hosts.provision_timeout_s",
    "hosts.dead_after_s",
    "hosts.dead_after_refused_s",
)
AT_LEAST_ZERO = (
    "seed",
    "training.warmup_steps",
    "ft.max_restarts",
    "hosts.provision_delay_s",
    "hosts.max_replacements",
    "hosts.spares",
    "chaos.every_s",
    "chaos.seed",
    "chaos.during_recovery",
    "checkpoint.every_min",
    "checkpoint.keep",
    "snapshot.every_steps",
    "controller.max_restarts",
    "hosts.controller_port",
)
BOUNDS = (
    (AT_LEAST_ONE, ">= 1", lambda v: v >= 1),
    (MORE_THAN_ZERO, "> 0", lambda v: v > 0),
    (AT_LEAST_ZERO, ">= 0", lambda v: v >= 0),
)
MIN_HEARTBEAT_TIMEOUT_MS = 200  # two of TorchFT's 100 ms heartbeat intervals
RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # a plain file name: no '/', no '..'


def validate(config: DictConfig) -> None:
    for keys, bound, ok in BOUNDS:
        for key in keys:
            value = OmegaConf.select(config, key)
            if not (math.isfinite(value) and ok(value)):
                finite = "" if math.isfinite(value) else "a finite number "
                raise ConfigError(f"{key}: must be {finite}{bound}, got {value}")
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(config, key)
        if value not in allowed:
            yaml = " (YAML reads on/off/yes/no as a boolean)" if str(value) in ("True", "False") else ""
            raise ConfigError(f"{key}: '{value}' is not one of {', '.join(allowed)}{yaml}")
    if config.training.warmup_steps > config.steps:
        raise ConfigError(
            f"training.warmup_steps: {config.training.warmup_steps} is more than steps={config.steps}; "
            f"set training.warmup_steps to at most {config.steps}"
        )
    if config.run_id is not None and not RUN_ID.fullmatch(config.run_id):
        raise ConfigError(
            f"run_id: '{config.run_id}' is not a plain name; use letters, digits, '.', '_', '-' "
            "(not starting with '.'), at most 128 characters"
        )
    if config.ft.quorum_timeout_s >= config.timeouts.step_s:
        raise ConfigError(
            f"ft.quorum_timeout_s: {config.ft.quorum_timeout_s} must be below timeouts.step_s="
            f"{config.timeouts.step_s:g}, so TorchFT gives up on a quorum before the controller gives up on the step"
        )
    if config.ft.heartbeat_timeout_ms < MIN_HEARTBEAT_TIMEOUT_MS:
        raise ConfigError(
            f"ft.heartbeat_timeout_ms: {config.ft.heartbeat_timeout_ms} is too short; TorchFT's managers "
            f"heartbeat every 100 ms, so use at least {MIN_HEARTBEAT_TIMEOUT_MS}"
        )
    if config.ft.min_replicas > config.replicas:
        raise ConfigError(
            f"ft.min_replicas: {config.ft.min_replicas} is more than replicas={config.replicas}"
        )
    if config.ft.mode == "diloco" and config.steps % config.ft.sync_steps:
        raise ConfigError(
            f"ft.sync_steps: steps={config.steps} is not a multiple of ft.sync_steps="
            f"{config.ft.sync_steps}; in diloco mode the run must end on a sync"
        )
    _validate_hosts(config)
    _validate_data(config.data, config.recipe, RECIPES[config.recipe].vocab_size)
    _validate_init(config)
    _validate_tensor_parallel(config)
    _validate_checkpoint(config.checkpoint)


def _validate_checkpoint(checkpoint: DictConfig) -> None:
    if checkpoint.keep == 1:
        raise ConfigError(
            "checkpoint.keep: 1 would purge the only complete checkpoint while the newest is still "
            "being written; use 0 (keep all) or at least 2"
        )
    if checkpoint.folder is not None:
        if not checkpoint.folder.strip():
            raise ConfigError("checkpoint.folder: empty; name a folder every node sees, or leave it unset")
        if "://" in checkpoint.folder:
            raise ConfigError(
                f"checkpoint.folder: '{checkpoint.folder}' is a URI; mount the bucket on every node "
                "(SkyPilot file_mounts) and give the mounted path"
            )


def _validate_data(data: DictConfig, recipe: str, model_vocab: int) -> None:
    from monarch_sky.common import hub_assets

    if not data.tokenizer_path and not data.tokenizer_repo:
        raise ConfigError("data.tokenizer_path: empty; name a tokenizer folder, or a hub repo in data.tokenizer_repo")
    problem = hub_assets.tokenizer_problem(data)
    if problem and not hub_assets.fetched_later(data):  # a hub tokenizer: `train` needs it, a preview does not
        raise ConfigError(problem)
    if data.dataset not in hub_assets.DATASETS:
        raise ConfigError(f"data.dataset: '{data.dataset}' is not one of {', '.join(hub_assets.DATASETS)}")
    if data.dataset_path is not None and not os.path.exists(os.path.expanduser(data.dataset_path)):
        raise ConfigError(f"data.dataset_path: no such file or directory '{data.dataset_path}'")
    if data.dataset == hub_assets.LOCAL_TEXT and (problem := hub_assets.local_text_problem(data.dataset_path)):
        raise ConfigError(problem)
    vocab = hub_assets.tokenizer_vocab(data)
    if vocab is not None and vocab > model_vocab:
        raise ConfigError(f"data.tokenizer_path: the tokenizer makes {vocab} token ids, but recipe {recipe}'s model "
                          f"embeds {model_vocab}; use the model's own tokenizer (its data.tokenizer_repo)")


def _validate_tensor_parallel(config: DictConfig) -> None:
    from monarch_sky.model_shapes import tensor_parallel_problem

    if problem := tensor_parallel_problem(config):
        raise ConfigError(problem)


def _validate_init(config: DictConfig) -> None:
    from monarch_sky.common import released_weights

    init = config.init
    if init.weights_path is not None and not os.path.isdir(os.path.expanduser(init.weights_path)):
        raise ConfigError(f"init.weights_path: no such folder '{init.weights_path}'; give a folder of Hugging Face "
                          "safetensors, or leave it unset to train from scratch")
    if released_weights.fetched_later(init) and not released_weights.present(init):
        return  # the hub's weights: `train` needs them, a preview does not
    from monarch_sky.model_shapes import weights_problem

    if problem := weights_problem(config):
        raise ConfigError(problem)


def _validate_hosts(config: DictConfig) -> None:
    from monarch_sky.hosts.base import HostError, parse_address

    hosts = config.hosts
    if hosts.provider == "local":
        return
    if not hosts.controller_ip:
        raise ConfigError(f"hosts.controller_ip: required with hosts.provider={hosts.provider} (this node's IP)")
    if hosts.provider == "skypilot":
        _validate_sky_replacements(hosts)
    needed = config.replicas * config.hosts_per_replica
    if len(hosts.addresses) < needed:
        per = f" x hosts_per_replica={config.hosts_per_replica}" if config.hosts_per_replica > 1 else ""
        raise ConfigError(
            f"hosts.addresses: {len(hosts.addresses)} given, but replicas={config.replicas}{per} "
            f"needs {needed} worker addresses (IP:PORT), one per host of each replica group"
        )
    for address in hosts.addresses:
        try:
            parse_address(address, name="check")
        except HostError as e:
            raise ConfigError(f"hosts.addresses: {e}") from None


def _validate_sky_replacements(hosts: DictConfig) -> None:
    from monarch_sky.hosts.base import HostError
    from monarch_sky.hosts.sky import sky_cli_problem, this_cluster

    if not (hosts.recipe_yaml and os.path.isfile(hosts.recipe_yaml)):
        raise ConfigError(f"hosts.recipe_yaml: '{hosts.recipe_yaml}' is not a file; replacements launch from it")
    try:
        this_cluster()
    except HostError as e:
        raise ConfigError(f"hosts.provider=skypilot: {e}") from None
    problem = sky_cli_problem(hosts.sky_cli)
    if problem:
        raise ConfigError(
            f"hosts.sky_cli: {problem}. Replacements need SkyPilot on this node, logged in to your "
            "API server: install skypilot[kubernetes]==0.14.1 in its own venv, `sky api login -e URL`, "
            "and set hosts.sky_cli to its `sky`; or run with HOST_REPLACEMENT=none"
        )


def _validate_serve(fault: Fault, stepped: set, replicas: int, chaos: bool) -> None:
    if fault.kind not in PROCESS_KINDS:
        raise ConfigError(f"faults: '{fault}' aims at the processes that serve a heal; use a process kind "
                          f"({', '.join(PROCESS_KINDS)}), e.g. kill@{SERVE}:{fault.replica}")
    if replicas < 3:
        raise ConfigError(f"faults: '{fault}' takes down the group a rejoiner heals from, and with replicas="
                          f"{replicas} it is the only one: the run would lose its state; use replicas=3 or more")
    if not (stepped - {fault.replica}) and not chaos:
        other = (fault.replica + 1) % replicas
        raise ConfigError(f"faults: '{fault}' waits for another replica to heal from replica {fault.replica}, but "
                          f"nothing makes one fail; add a fault before it (e.g. kill@20:{other}) or turn chaos on")


def validate_faults(config: DictConfig, faults: list[Fault]) -> None:
    if any(f.kind == "host" for f in faults) and config.hosts.provider != "local":
        raise ConfigError(
            f"faults: host faults can only be injected with hosts.provider=local, not {config.hosts.provider}"
        )
    killing = [str(f) for f in faults if f.kind == CONTROLLER]
    if killing and config.checkpoint.every_min <= 0 and config.snapshot.every_steps <= 0:
        raise ConfigError(f"faults: {killing[0]} kills the controller, and with neither node memory snapshots nor "
                          "checkpoints its restart would train from step 0; set snapshot.every_steps (e.g. 10) "
                          "or checkpoint.every_min, or drop the fault")
    chaos = config.chaos
    stepped = {f.replica for f in faults if not f.during}  # replicas a step fault makes fail
    for fault in faults:
        if fault.during == SERVE:
            _validate_serve(fault, stepped, config.replicas, chaos.every_s > 0)
        elif fault.during and fault.replica not in stepped and chaos.every_s <= 0:
            raise ConfigError(
                f"faults: '{fault}' waits for replica {fault.replica} to recover from a failure, but nothing "
                f"makes it fail; add a fault before it (e.g. kill@20:{fault.replica}) or turn chaos on (chaos.every_s)"
            )
    unknown = [k for k in chaos.kinds if k not in KINDS]
    if unknown:
        raise ConfigError(f"chaos.kinds: unknown kind {unknown[0]}; allowed: {', '.join(KINDS)}")
    if chaos.during_recovery > 1:
        raise ConfigError(f"chaos.during_recovery: {chaos.during_recovery:g} is a share of the chaos draws: "
                          "pick 0 (off) to 1 (every draw that finds a group recovering)")
    if chaos.every_s > 0 and not chaos.kinds:
        raise ConfigError("chaos.kinds: empty; name at least one kind, or set chaos.every_s=0")
    if chaos.every_s > 0 and config.replicas < 2:
        raise ConfigError(f"chaos.every_s: replicas={config.replicas} leaves nobody to heal from; use replicas>=2")
    if chaos.every_s > 0 and "host" in chaos.kinds and config.hosts.provider != "local":
        raise ConfigError(
            f"chaos.kinds: host faults need hosts.provider=local, not {config.hosts.provider}; drop host from chaos.kinds"
        )
