"""Job settings: an omegaconf structured config, recipe defaults, dotlist overrides.

`load_job(["replicas=2", "steps=60"])` merges, in order: the defaults below, the chosen
recipe's `job_defaults`, then the overrides. Every mistake raises `ConfigError` with a
message naming the field and what is allowed; nothing is spawned before this passes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from monarch_sky.faults.spec import CONTROLLER, Fault, FaultSpecError, check_faults, parse_faults
from monarch_sky import titan_keys
from monarch_sky.recipes import RECIPES
from monarch_sky.validation import ConfigError, validate, validate_faults

ASSETS = Path(__file__).resolve().parent / "assets"


EXIT_CONFIG = 2  # exit code for a config error


@dataclass
class TrainingSettings:
    seq_len: int = MISSING  # tokens per sample
    local_batch_size: int = MISSING  # samples per process and step
    lr: float = MISSING  # peak learning rate (AdamW)
    warmup_steps: int = MISSING  # linear warm-up steps
    compile: bool = False  # torch.compile the model and loss (TorchTitan's compile.enable)
    activation_checkpoint: str = "auto"  # auto (full on GPUs, none on CPU) | full | selective | none
    tensor_parallel: int = 1  # ranks of a group each layer is split over (TorchTitan's TP); FSDP shards over the rest
    mixed_precision: str = "auto"  # FSDP's parameter dtype: auto (bfloat16 on GPUs, float32 on CPU) | bfloat16 | float32


@dataclass
class DataSettings:
    tokenizer_path: Optional[str] = str(ASSETS / "tokenizer")  # None: where tokenizer_repo was fetched to
    tokenizer_repo: Optional[str] = None  # the hub repository `monarch-sky fetch-tokenizer` fetches
    dataset: str = "local_text"  # your own text at dataset_path; "c4", "fineweb_edu" stream from the Hub
    dataset_path: Optional[str] = str(ASSETS / "data")  # local text, or a local copy of a hub dataset (None: the Hub's)


@dataclass
class InitSettings:
    """Where the weights start: random (the default: training from scratch) or released ones."""

    weights_repo: Optional[str] = None  # a hub model (safetensors) `monarch-sky fetch-weights` fetches, e.g. meta-llama/Llama-3.1-8B
    weights_path: Optional[str] = None  # a local folder of Hugging Face safetensors (wins over weights_repo)


@dataclass
class FTSettings:
    mode: str = "step"  # "step": every step all-reduced across groups; "diloco"
    sync_steps: int = 10  # diloco: steps between syncs
    min_replicas: int = 1  # fewest replica groups a step may commit with
    process_group_timeout_ms: int = 5000  # a collective with a dead peer fails after this
    rendezvous_timeout_ms: int = 1000  # a quorum's cross-group (gloo) group waits this long for a member that died joining it
    # The lighthouse drops a silent group after this; TorchFT's managers beat every 100 ms.
    heartbeat_timeout_ms: int = 300
    quorum_tick_ms: int = 100  # the lighthouse forms a quorum at most this often
    join_timeout_ms: int = 10000  # the lighthouse waits this long for every group before a smaller quorum
    quorum_timeout_s: int = 60  # a group waiting this long for a TorchFT quorum fails its step
    timeout_s: int = 60  # TorchFT's manager timeout: each read of a heal transfer, should_commit
    # How a rejoining group gets its state: "tcp" (snapshot, striped streams: heal_tcp.py), "rdma"
    # (the snapshot read through Monarch's RDMABuffer: heal_rdma.py), "http" (TorchFT's default),
    # "auto" (rdma where Monarch sees ibverbs, else tcp)
    heal_transport: str = "auto"
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
    provider: str = "local"  # local | addresses | skypilot (see monarch_sky/hosts/choice.py)
    addresses: list[str] = field(default_factory=list)  # addresses: worker IP:PORT per host
    controller_ip: Optional[str] = None  # addresses: the IP the hosts reach the controller on
    controller_port: int = 0  # a port on controller_ip that answers while the controller lives (other nodes' standbys watch it); 0: none
    recipe_yaml: Optional[str] = None  # skypilot: the recipe replacements are launched from
    cluster_prefix: Optional[str] = None  # skypilot: replacement cluster names (default from run id)
    sky_cli: str = "sky"  # skypilot: the SkyPilot command to run
    provision_delay_s: float = 3.0  # local: how long a replacement host takes to "boot"
    provision_timeout_s: float = 600.0  # give up on a replacement host after this
    max_replacements: int = 3  # local: replacement hosts available to the run
    spares: int = 0  # hosts kept up in no group (warm where a group is one host); a lost host's group takes one
    spare_warm_up: str = "auto"  # a warm spare's step on dummy data, compiling the recipe's kernels: auto (GPUs) | always | never
    dead_after_s: float = 2.0  # a host that does not answer its probes is dead after this long
    dead_after_refused_s: float = 0.2  # one whose worker refuses connections (it is gone): two refusals this far apart


@dataclass
class ChaosSettings:
    every_s: float = 0.0  # mean seconds between random faults (exponential gaps); 0: off
    kinds: list[str] = field(default_factory=lambda: ["kill", "segfault", "comms", "hang", "stop", "host"])  # what chaos draws from
    seed: int = 0  # the chaos schedule's own seed
    during_recovery: float = 0.0  # share of draws that, finding a group recovering, hit its heal instead


@dataclass
class CheckpointSettings:
    """The last resort when no group is left to heal from (see monarch_sky/common/checkpoints.py)."""

    every_min: float = 0.0  # minutes between checkpoints; 0: none (the local default)
    folder: Optional[str] = None  # None: <run_dir>/<run_id>/checkpoints; every node must see it
    keep: int = 3  # newest checkpoints kept (0: all); TorchTitan purges the older ones
    async_mode: str = "async"  # TorchTitan's: "async" (staged on the step loop) or "async_with_pinned_mem"


@dataclass
class ControllerSettings:
    standby: bool = True  # `train` stands by: a lost controller is started again under the run id (monarch_sky/standby.py)
    max_restarts: int = 3  # controllers started again after a loss, per `train`


@dataclass
class SnapshotSettings:
    """Each rank's committed state kept in its node's memory, so the run outlives its processes
    (see monarch_sky/common/node_memory.py)."""

    every_steps: int = 10  # committed steps between snapshots (DiLoCo: rounded up to a sync); 0: none


@dataclass
class WandbSettings:
    mode: str = "auto"  # auto: online if wandb finds your key (WANDB_API_KEY, `wandb login`); online, offline, disabled
    project: str = "monarch-sky"  # W&B project
    entity: Optional[str] = None  # W&B team or user (None: your default)


@dataclass
class JobConfig:
    recipe: str = "llama3_tiny"  # the model and its defaults: llama3_tiny (CPU), llama3_debug, llama3_8b, llama3_70b
    replicas: int = 3  # replica groups; TorchFT keeps them in step, a failed one heals from a peer
    procs_per_replica: int = 2  # processes (GPUs) per host of a replica group
    hosts_per_replica: int = 1  # hosts one replica group spans (FSDP across them)
    steps: int = 100  # committed training steps to reach
    seed: int = 0  # model init and data order
    faults: str = ""  # KIND@STEP:REPLICA,... (kill segfault comms hang stop host), controller@STEP, none, or auto (a kill at 40%)
    run_dir: str = "runs"  # run records go to <run_dir>/<run_id>/
    run_id: Optional[str] = None  # None: <recipe>-<time>-<hex>; an existing one resumes that run
    training: TrainingSettings = field(default_factory=TrainingSettings)
    data: DataSettings = field(default_factory=DataSettings)
    init: InitSettings = field(default_factory=InitSettings)
    ft: FTSettings = field(default_factory=FTSettings)
    timeouts: TimeoutSettings = field(default_factory=TimeoutSettings)
    hosts: HostSettings = field(default_factory=HostSettings)
    chaos: ChaosSettings = field(default_factory=ChaosSettings)
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    snapshot: SnapshotSettings = field(default_factory=SnapshotSettings)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    wandb: WandbSettings = field(default_factory=WandbSettings)


@dataclass
class Job:
    """A validated job: the config plus the parsed fault schedule."""

    config: DictConfig
    faults: list[Fault]

    @property
    def faults_text(self) -> str:
        return ", ".join(map(str, self.faults)) or "none"

    def to_dict(self) -> dict[str, Any]:
        return OmegaConf.to_container(self.config, resolve=True)


def ranks_per_group(cfg) -> int:
    """Processes in one replica group: FSDP shards the model over all of them, across its hosts."""
    return cfg.procs_per_replica * cfg.hosts_per_replica


def heal_transport(kind: str) -> str:
    """The transport whose rate budgets the heal. "auto": tcp's (the fastest here, `make bench-heal`;
    where a trainer sees ibverbs it runs rdma, budgeted at the same GPU rate)."""
    return "tcp" if kind == "auto" else kind


def load_job(overrides: list[str], config_file: str | None = None) -> Job:
    """The job from, in increasing precedence: the defaults, the recipe's, `config_file`
    (YAML, the same keys nested) and the KEY=VALUE `overrides` (TorchTitan's keys read as ours,
    `titan_keys`)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"'{item}' is not KEY=VALUE (for example replicas=2)")
    overrides = titan_keys.translate(overrides)
    schema = OmegaConf.structured(JobConfig)
    from_file = _load_file(config_file) if config_file else OmegaConf.create()
    cli = _parse_dotlist(overrides)
    recipe_name = cli.get("recipe", from_file.get("recipe", schema.recipe))
    if recipe_name not in RECIPES:
        raise ConfigError(f"recipe: unknown recipe '{recipe_name}'; allowed: {', '.join(RECIPES)}")
    try:
        config = OmegaConf.merge(schema, RECIPES[recipe_name].job_defaults, from_file, cli)
        OmegaConf.to_container(config, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(_describe(e)) from None
    validate(config)
    if config.faults == "auto":
        config.faults = auto_fault(config.replicas, config.steps)
    try:
        faults = parse_faults(config.faults)
        check_faults(faults, config.replicas, config.steps)
    except FaultSpecError as e:
        raise ConfigError(f"faults: {e}") from None
    at_groups = [f for f in faults if f.kind != CONTROLLER]
    if at_groups and config.replicas == 1:
        raise ConfigError(
            f"faults: {','.join(map(str, at_groups))} with replicas=1 leaves nobody to heal from; "
            "use replicas>=2 or faults=none"
        )
    validate_faults(config, faults)
    return Job(config, faults)


def auto_fault(replicas: int, steps: int) -> str:
    """The demo default: one kill into replica 1 at 40% of the run (none on 1 replica)."""
    if replicas < 2 or steps < 3:
        return ""
    return f"kill@{max(1, steps * 2 // 5)}:1"


def _load_file(path: str) -> DictConfig:
    """A YAML file of config keys, nested (`ft: {mode: diloco}`) or dotted (`ft.mode: diloco`)."""
    import yaml

    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config: no file {path}") from None
    except yaml.YAMLError as e:  # its message names the line
        raise ConfigError(f"--config: {path} is not YAML: {' '.join(str(e).split())}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config: {path} must hold keys and values (replicas: 2), not a list or a value")
    nested = OmegaConf.create()
    for key, value in loaded.items():
        try:
            OmegaConf.update(nested, str(key), value, force_add=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"--config: {path}: {_describe(e)}") from None
    return nested


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
    wrong = re.match(r"Value '(.*)' (?:of type '\w+' could not be converted to (Integer|Float)|is not a valid bool)", msg)
    if wrong and key:
        value, kind = wrong.groups()
        want = {"Integer": "a whole number; write it as {key}=500 (digits only: 1e3 is a float)",
                "Float": "a number; write it as {key}=0.5 or {key}=3e-4"}.get(kind, "true or false; write it as {key}=true")
        return f"{key}: '{value}' is not " + want.format(key=key)
    return f"{key}: {msg}" if key else msg


def _keys_at(parent: str) -> list[str]:
    node = OmegaConf.structured(JobConfig)
    if parent:
        node = OmegaConf.select(node, parent)
    return list(node.keys()) if isinstance(node, DictConfig) else []


def resolved_yaml(job: Job) -> str:
    """The job as `monarch-sky config` prints it and the run record keeps it (config.yaml)."""
    return OmegaConf.to_yaml(job.config) + f"# faults injected: {job.faults_text}\n"
