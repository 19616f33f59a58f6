"""Job settings: an omegaconf structured config, recipe defaults, dotlist overrides.

`load_job(["replicas=2", "steps=60"])` merges, in order: the defaults below, the chosen
recipe's `job_defaults`, then the overrides. Every mistake raises `ConfigError` with a
message naming the field and what is allowed; nothing is spawned before this passes.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from monarch_sky.faults import KINDS, Fault, FaultSpecError, check_faults, parse_faults
from monarch_sky.recipes import RECIPES

ASSETS = Path(__file__).resolve().parent / "assets"


EXIT_CONFIG = 2  # exit code for a config error


class ConfigError(ValueError):
    pass


@dataclass
class TrainingSettings:
    seq_len: int = MISSING
    local_batch_size: int = MISSING
    lr: float = MISSING
    warmup_steps: int = MISSING


@dataclass
class DataSettings:
    tokenizer_path: str = str(ASSETS / "tokenizer")
    dataset: str = "c4_test"  # torchtitan's local-json loader; "c4" streams from the Hub
    dataset_path: Optional[str] = str(ASSETS / "data")


@dataclass
class FTSettings:
    mode: str = "step"  # "step": every step all-reduced across groups; "diloco"
    sync_steps: int = 10  # diloco: steps between syncs
    min_replicas: int = 1  # fewest replica groups a step may commit with
    process_group_timeout_ms: int = 5000  # a collective with a dead peer fails after this
    heartbeat_timeout_ms: int = 1000  # lighthouse drops a silent replica after this
    quorum_tick_ms: int = 100
    join_timeout_ms: int = 10000
    quorum_timeout_s: int = 60  # a group waiting this long for a TorchFT quorum fails its step
    max_restarts: int = 3  # respawns of one replica group before it is given up
    standby: bool = True  # keep a warm spare process set per group: recovery skips imports


@dataclass
class TimeoutSettings:
    spawn_s: float = 300.0  # procs up + trainer built (imports dominate on CPU)
    step_s: float = 180.0  # one training step, quorum and healing included
    stop_s: float = 30.0  # stopping a process mesh
    hang_s: float = 2.0  # a trainer silent this long during a long step is hung


@dataclass
class HostSettings:
    provider: str = "local"  # local | addresses | skypilot (see monarch_sky/hosts.py)
    addresses: list[str] = field(default_factory=list)  # addresses: worker IP:PORT per host
    controller_ip: Optional[str] = None  # addresses: the IP the hosts reach the controller on
    recipe_yaml: Optional[str] = None  # skypilot: the recipe replacements are launched from
    cluster_prefix: Optional[str] = None  # skypilot: replacement cluster names (default from run id)
    sky_cli: str = "sky"  # skypilot: the SkyPilot command to run
    provision_delay_s: float = 3.0  # local: how long a replacement host takes to "boot"
    provision_timeout_s: float = 600.0  # give up on a replacement host after this
    max_replacements: int = 3  # local: replacement hosts available to the run
    # a host is declared dead after its worker refused connections for this long (consecutive probes)
    dead_after_s: float = 2.0


@dataclass
class ChaosSettings:
    every_s: float = 0.0  # mean seconds between random faults (exponential gaps); 0: off
    kinds: list[str] = field(default_factory=lambda: ["kill", "segfault", "comms", "hang", "stop", "host"])
    seed: int = 0


@dataclass
class WandbSettings:
    mode: str = "auto"  # auto: online if WANDB_API_KEY is set, else offline; or disabled
    project: str = "monarch-sky"
    entity: Optional[str] = None


@dataclass
class JobConfig:
    recipe: str = "llama3_tiny"
    replicas: int = 3
    procs_per_replica: int = 2
    steps: int = 100
    seed: int = 0
    faults: str = ""
    run_dir: str = "runs"
    run_id: Optional[str] = None
    training: TrainingSettings = field(default_factory=TrainingSettings)
    data: DataSettings = field(default_factory=DataSettings)
    ft: FTSettings = field(default_factory=FTSettings)
    timeouts: TimeoutSettings = field(default_factory=TimeoutSettings)
    hosts: HostSettings = field(default_factory=HostSettings)
    chaos: ChaosSettings = field(default_factory=ChaosSettings)
    wandb: WandbSettings = field(default_factory=WandbSettings)


@dataclass
class Job:
    """A validated job: the config plus the parsed fault schedule."""

    config: DictConfig
    faults: list[Fault]

    def to_dict(self) -> dict[str, Any]:
        return OmegaConf.to_container(self.config, resolve=True)


CHOICES = {
    "ft.mode": ("step", "diloco"),
    "hosts.provider": ("local", "addresses", "skypilot"),
    "wandb.mode": ("auto", "online", "offline", "disabled"),
}
# Numeric bounds, checked in this order; a value must also be finite (no nan or inf).
AT_LEAST_ONE = (
    "replicas",
    "procs_per_replica",
    "steps",
    "ft.sync_steps",
    "ft.min_replicas",
    "training.seq_len",
    "training.local_batch_size",
)
MORE_THAN_ZERO = (  # a zero timeout or tick fails every wait, or never ends one
    "training.lr",
    "ft.process_group_timeout_ms",
    "ft.heartbeat_timeout_ms",
    "ft.quorum_tick_ms",
    "ft.join_timeout_ms",
    "ft.quorum_timeout_s",
    "timeouts.spawn_s",
    "timeouts.step_s",
    "timeouts.stop_s",
    "timeouts.hang_s",
    "hosts.provision_timeout_s",
    "hosts.dead_after_s",
)
AT_LEAST_ZERO = (
    "seed",
    "training.warmup_steps",
    "ft.max_restarts",
    "hosts.provision_delay_s",
    "hosts.max_replacements",
    "chaos.every_s",
    "chaos.seed",
)
BOUNDS = (
    (AT_LEAST_ONE, ">= 1", lambda v: v >= 1),
    (MORE_THAN_ZERO, "> 0", lambda v: v > 0),
    (AT_LEAST_ZERO, ">= 0", lambda v: v >= 0),
)
RUN_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")  # a plain file name: no '/', no '..'


def load_job(overrides: list[str]) -> Job:
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"'{item}' is not KEY=VALUE (for example replicas=2)")
    schema = OmegaConf.structured(JobConfig)
    cli = _parse_dotlist(overrides)
    recipe_name = cli.get("recipe", schema.recipe)
    if recipe_name not in RECIPES:
        raise ConfigError(f"recipe: unknown recipe '{recipe_name}'; allowed: {', '.join(RECIPES)}")
    try:
        config = OmegaConf.merge(schema, RECIPES[recipe_name].job_defaults, cli)
        OmegaConf.to_container(config, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e)) from None
    _validate(config)
    if config.faults == "auto":
        config.faults = auto_fault(config.replicas, config.steps)
    try:
        faults = parse_faults(config.faults)
        check_faults(faults, config.replicas, config.steps)
    except FaultSpecError as e:
        raise ConfigError(f"faults: {e}") from None
    if faults and config.replicas == 1:
        raise ConfigError(
            f"faults: {','.join(map(str, faults))} with replicas=1 leaves nobody to heal from; "
            "use replicas>=2 or faults=none"
        )
    check_fault_support(config, faults)
    return Job(config, faults)


def auto_fault(replicas: int, steps: int) -> str:
    """The demo default: one kill into replica 1 at 40% of the run (none on 1 replica)."""
    if replicas < 2 or steps < 3:
        return ""
    return f"kill@{max(1, steps * 2 // 5)}:1"


def _parse_dotlist(overrides: list[str]) -> DictConfig:
    try:
        return OmegaConf.from_dotlist(overrides)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e)) from None


def _describe(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None) or getattr(e, "key", None)
    msg = getattr(e, "msg", str(e)).splitlines()[0]
    if "Key '" in msg and "not in" in msg:
        parent = key.rpartition(".")[0] if key else ""
        allowed = _keys_at(parent)
        return f"{key}: unknown config key; allowed keys{' under ' + parent if parent else ''}: {', '.join(allowed)}"
    if "Missing mandatory value" in msg:
        return f"{key}: no value; set it with {key}=VALUE"
    return f"{key}: {msg}" if key else msg


def _keys_at(parent: str) -> list[str]:
    node = OmegaConf.structured(JobConfig)
    if parent:
        node = OmegaConf.select(node, parent)
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _validate(config: DictConfig) -> None:
    for keys, bound, ok in BOUNDS:
        for key in keys:
            value = OmegaConf.select(config, key)
            if not (math.isfinite(value) and ok(value)):
                finite = "" if math.isfinite(value) else "a finite number "
                raise ConfigError(f"{key}: must be {finite}{bound}, got {value}")
    for key, allowed in CHOICES.items():
        value = OmegaConf.select(config, key)
        if value not in allowed:
            raise ConfigError(f"{key}: '{value}' is not one of {', '.join(allowed)}")
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
    if not os.path.isdir(config.data.tokenizer_path):
        raise ConfigError(f"data.tokenizer_path: no such directory '{config.data.tokenizer_path}'")
    if config.data.dataset_path is not None and not os.path.exists(config.data.dataset_path):
        raise ConfigError(f"data.dataset_path: no such file or directory '{config.data.dataset_path}'")


def _validate_hosts(config: DictConfig) -> None:
    from monarch_sky.hosts import HostError, parse_address

    hosts = config.hosts
    if hosts.provider == "local":
        return
    if not hosts.controller_ip:
        raise ConfigError(f"hosts.controller_ip: required with hosts.provider={hosts.provider} (this node's IP)")
    if hosts.provider == "skypilot" and not (hosts.recipe_yaml and os.path.isfile(hosts.recipe_yaml)):
        raise ConfigError(f"hosts.recipe_yaml: '{hosts.recipe_yaml}' is not a file; replacements launch from it")
    if len(hosts.addresses) < config.replicas:
        raise ConfigError(
            f"hosts.addresses: {len(hosts.addresses)} given, but replicas={config.replicas} "
            "needs one worker address (IP:PORT) per replica group"
        )
    for address in hosts.addresses:
        try:
            parse_address(address, name="check")
        except HostError as e:
            raise ConfigError(f"hosts.addresses: {e}") from None


def check_fault_support(config: DictConfig, faults: list[Fault]) -> None:
    if any(f.kind == "host" for f in faults) and config.hosts.provider != "local":
        raise ConfigError(
            f"faults: host faults can only be injected with hosts.provider=local, not {config.hosts.provider}"
        )
    chaos = config.chaos
    unknown = [k for k in chaos.kinds if k not in KINDS]
    if unknown:
        raise ConfigError(f"chaos.kinds: unknown kind {unknown[0]}; allowed: {', '.join(KINDS)}")
    if chaos.every_s > 0 and not chaos.kinds:
        raise ConfigError("chaos.kinds: empty; name at least one kind, or set chaos.every_s=0")
    if chaos.every_s > 0 and config.replicas < 2:
        raise ConfigError(f"chaos.every_s: replicas={config.replicas} leaves nobody to heal from; use replicas>=2")
    if chaos.every_s > 0 and "host" in chaos.kinds and config.hosts.provider != "local":
        raise ConfigError(
            f"chaos.kinds: host faults need hosts.provider=local, not {config.hosts.provider}; drop host from chaos.kinds"
        )
