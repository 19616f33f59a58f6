"""Bad input: exit code 2 and one message naming the field and what is allowed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, cli_env
from monarch_sky.config import ConfigError, load_job
from monarch_sky.faults.spec import Fault, FaultSpecError, parse_faults

BAD = [
    (["replicas=0"], ["replicas", ">= 1"]),
    (["steps=0"], ["steps", ">= 1"]),
    (["replicas=abc"], ["replicas", "not a whole number"]),
    (["recipe=gpt5"], ["recipe", "gpt5", "llama3_tiny"]),
    (["bogus=1"], ["bogus", "unknown config key", "replicas"]),
    (["ft.bogus=1"], ["ft.bogus", "unknown config key", "sync_steps"]),
    (["faults=kill@20"], ["faults", "KIND@STEP:REPLICA"]),
    (["faults=kill@x:1"], ["faults", "integers"]),
    (["faults=meteor@20:1"], ["faults", "meteor", "kill", "segfault"]),
    (["replicas=2", "faults=kill@20:2"], ["faults", "replica 2", "0..1"]),
    (["steps=30", "faults=kill@40:1"], ["faults", "step 40", "steps=30"]),
    (["replicas=2", "faults=kill@rejoin:1"], ["faults", "kill@rejoin:1", "nothing makes it fail", "chaos.every_s"]),
    (["faults=controller@20:1"], ["faults", "controller@STEP", "no replica"]),
    (["replicas=2", "faults=kill@20:1,kill@serve:0"], ["faults", "kill@serve:0", "replicas=2", "replicas=3"]),
    (["replicas=3", "faults=kill@20:0,kill@serve:0"], ["faults", "kill@serve:0", "nothing makes one fail", "kill@20:1"]),
    (["replicas=3", "faults=kill@20:1,host@serve:0"], ["faults", "host@serve:0", "process kind", "kill@serve:0"]),
    (["replicas=2", "faults=controller@20", "snapshot.every_steps=0"], ["faults", "controller@20", "snapshot.every_steps", "checkpoint.every_min"]),
    (["chaos.every_s=5", "chaos.kinds=[kill,controller]"], ["chaos.kinds", "controller", "kill"]),
    (["ft.mode=async"], ["ft.mode", "step", "diloco"]),
    (["ft.mode=diloco", "steps=25", "ft.sync_steps=10"], ["ft.sync_steps", "multiple"]),
    (["ft.min_replicas=4"], ["ft.min_replicas", "replicas=3"]),
    (["replicas"], ["replicas", "KEY=VALUE"]),
    (["hosts.provider=cloud9"], ["hosts.provider", "local", "addresses", "skypilot"]),
    (["hosts.provider=addresses"], ["hosts.controller_ip", "required"]),
    (["hosts.provider=addresses", "hosts.controller_ip=10.0.0.1", "hosts.addresses=[10.0.0.1:1]"],
     ["hosts.addresses", "replicas=3"]),
    (["hosts.provider=addresses", "hosts.controller_ip=10.0.0.1", "hosts.addresses=[a:1,b:1,c:1]", "replicas=2",
      "hosts_per_replica=2"], ["hosts.addresses", "3 given", "hosts_per_replica=2", "needs 4"]),
    (["hosts_per_replica=0"], ["hosts_per_replica", ">= 1"]),
    (["hosts.provider=addresses", "hosts.controller_ip=10.0.0.1", "hosts.addresses=[a:1,b:2,c]"],
     ["hosts.addresses", "IP:PORT"]),
    (["hosts.provider=skypilot", "hosts.controller_ip=10.0.0.1", "hosts.addresses=[a:1,b:1,c:1]"],
     ["hosts.recipe_yaml"]),
    (["hosts.provider=addresses", "hosts.controller_ip=10.0.0.1", "hosts.addresses=[a:1,b:1,c:1]",
      "faults=host@10:1"], ["faults", "hosts.provider=local"]),
    (["hosts.provider=skypilot", "hosts.controller_ip=10.0.0.1", "hosts.addresses=[a:1,b:1,c:1]",
      "hosts.recipe_yaml=recipes/llama.yaml"], ["SKYPILOT_CLUSTER_INFO", "inside a SkyPilot task"]),
    (["chaos.every_s=5", "chaos.kinds=[kill,meteor]"], ["chaos.kinds", "meteor", "comms"]),
    (["chaos.every_s=-1"], ["chaos.every_s", ">= 0"]),
    (["replicas=1", "chaos.every_s=5"], ["chaos.every_s", "nobody to heal from"]),
    (["chaos.every_s=5", "chaos.kinds=[]"], ["chaos.kinds", "empty"]),
    (["chaos.during_recovery=2"], ["chaos.during_recovery", "0 (off) to 1"]),
    (["timeouts.hang_s=0"], ["timeouts.hang_s", "> 0"]),
    (["ft.heartbeat_timeout_ms=150"], ["ft.heartbeat_timeout_ms", "at least 200"]),
    (["faults=hang@5:1,stop@6:0,comms@7:2,teleport@8:1"], ["faults", "teleport", "hang", "stop", "comms"]),
    *[([f"{key}={value}"], [key, "> 0"]) for key, value in [
        ("timeouts.spawn_s", 0), ("timeouts.step_s", 0), ("timeouts.stop_s", -1),
        ("timeouts.step_s", "nan"), ("timeouts.step_s", "inf"),
        ("ft.process_group_timeout_ms", 0), ("ft.heartbeat_timeout_ms", 0),
        ("ft.quorum_tick_ms", -5), ("ft.join_timeout_ms", 0),
        ("hosts.provision_timeout_s", 0), ("hosts.dead_after_s", 0), ("training.lr", 0),
    ]],
    *[([f"{key}=-1"], [key, ">= 0"]) for key in [
        "ft.max_restarts", "training.warmup_steps", "hosts.provision_delay_s",
        "hosts.max_replacements", "hosts.spares", "seed",
    ]],
    (["training.seq_len=0"], ["training.seq_len", ">= 1"]),
    (["training.local_batch_size=0"], ["training.local_batch_size", ">= 1"]),
    (["steps=20", "training.warmup_steps=50"], ["training.warmup_steps", "50 is more than steps=20"]),
    (["data.dataset_path=/no/such/data"], ["data.dataset_path", "/no/such/data"]),
    (["replicas=1", "faults=kill@5:0"], ["faults", "kill@5:0", "nobody to heal from", "faults=none"]),
    (["replicas=1", "faults=host@5:0"], ["faults", "replicas>=2"]),
    (["run_id=../escape"], ["run_id", "plain name"]),
    (["run_id=a/b"], ["run_id", "plain name"]),
    (["run_id=.hidden"], ["run_id", "not starting with '.'"]),
    (["run_id=" + "x" * 129], ["run_id", "128"]),
    (["checkpoint.every_min=-1"], ["checkpoint.every_min", ">= 0"]),
    (["checkpoint.every_min=nan"], ["checkpoint.every_min", "finite"]),
    (["checkpoint.keep=1"], ["checkpoint.keep", "0 (keep all) or at least 2"]),
    (["checkpoint.keep=-2"], ["checkpoint.keep", ">= 0"]),
    (["checkpoint.async_mode=sync"], ["checkpoint.async_mode", "async", "async_with_pinned_mem"]),
    (["ft.heal_transport=nccl"], ["ft.heal_transport", "nccl", "auto", "tcp", "rdma", "http"]),
    (["hosts.spare_warm_up=on"], ["hosts.spare_warm_up", "auto", "always", "never", "YAML reads on/off"]),
    (["checkpoint.folder=s3://bucket/ck"], ["checkpoint.folder", "mount the bucket"]),
]


@pytest.mark.parametrize("overrides,words", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_cli_rejects_bad_config_before_spawning(tmp_path, overrides, words):
    proc = subprocess.run(
        [sys.executable, "-m", "monarch_sky", "train", f"run_dir={tmp_path}", *overrides],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    message = proc.stderr.strip()
    assert len(message.splitlines()) == 1, message
    for word in words:
        assert word in message, f"{word!r} not in {message!r}"
    assert list(tmp_path.iterdir()) == [], "nothing may be created before the config is valid"


def test_defaults_are_the_local_demo():
    job = load_job([])
    assert (job.config.replicas, job.config.procs_per_replica, job.config.steps) == (3, 2, 100)
    assert job.faults == [Fault("kill", 40, 1)], "one kill mid-run into replica 1"


def test_auto_fault_follows_the_run_length():
    assert load_job(["steps=50"]).faults == [Fault("kill", 20, 1)]
    assert load_job(["replicas=1"]).faults == []
    assert load_job(["faults=none"]).faults == []


def test_plain_run_ids_are_accepted():
    assert load_job(["run_id=ok-name_1.2"]).config.run_id == "ok-name_1.2"
    assert load_job(["run_id=" + "x" * 128]).config.run_id == "x" * 128


def test_edge_values_that_cannot_hang_are_accepted():
    job = load_job(["steps=20", "training.warmup_steps=20", "ft.max_restarts=0", "hosts.max_replacements=0",
                    "hosts.provision_delay_s=0", "data.dataset=c4_test", "data.dataset_path=null",
                    "hosts.dead_after_s=0.5"])
    assert job.config.training.warmup_steps == 20 and job.config.data.dataset_path is None
    assert job.config.hosts.dead_after_s == 0.5
    assert load_job([]).config.hosts.dead_after_s == 2.0


def test_overrides_reach_nested_settings():
    job = load_job(["ft.mode=diloco", "ft.sync_steps=5", "training.lr=0.01", "replicas=2"])
    assert job.config.ft.mode == "diloco"
    assert job.config.ft.sync_steps == 5
    assert job.config.training.lr == 0.01


def test_fault_spec_round_trips_and_sorts_by_step():
    faults = parse_faults("segfault@40:0,kill@20:1")
    assert faults == [Fault("kill", 20, 1), Fault("segfault", 40, 0)]
    assert ",".join(map(str, faults)) == "kill@20:1,segfault@40:0"


@pytest.mark.parametrize("spec", ["kill", "kill@", "kill@1:", "@1:1", "kill@0:1", "kill@1:-1", "kill@1:1:1",
                                  "kill@rejoin:-1", "kill@heal:1", "meteor@rejoin:1", "controller@0",
                                  "controller@rejoin", "controller"])
def test_malformed_fault_specs_raise(spec):
    with pytest.raises(FaultSpecError):
        parse_faults(spec)


def test_a_compound_fault_aims_at_the_next_rejoin_and_round_trips():
    faults = parse_faults("host@rejoin:1,kill@20:1,kill@rejoin:1")
    assert faults == [Fault("kill", 20, 1), Fault("host", 0, 1, "rejoin"), Fault("kill", 0, 1, "rejoin")]
    assert ",".join(map(str, faults)) == "kill@20:1,host@rejoin:1,kill@rejoin:1", "phase faults keep their order"
    assert load_job(["replicas=2", "steps=50", "chaos.every_s=5", "faults=kill@rejoin:0"]).faults[0].during == "rejoin"
    assert load_job(["replicas=3", "steps=50", "faults=kill@20:2,kill@serve:0"]).faults[1].during == "serve"


def test_a_controller_fault_takes_no_replica_and_may_run_on_one_group():
    job = load_job(["replicas=1", "steps=50", "checkpoint.every_min=0.5", "faults=controller@30,controller@10"])
    assert job.faults == [Fault("controller", 10, None), Fault("controller", 30, None)]
    assert ",".join(map(str, job.faults)) == "controller@10,controller@30"


def test_config_error_is_a_value_error_with_the_field():
    with pytest.raises(ConfigError, match="^procs_per_replica: must be >= 1"):
        load_job(["procs_per_replica=0"])


def test_local_text_names_what_it_needs(tmp_path):
    assert load_job([]).config.data.dataset == "local_text", "the shipped stories are local text"
    with pytest.raises(ConfigError, match="data.dataset_path: local_text reads your own text"):
        load_job(["data.dataset=local_text", "data.dataset_path=null"])
    (tmp_path / "notes.md").write_text("# not text records\n")
    with pytest.raises(ConfigError, match=r"data.dataset_path: .* holds no .jsonl"):
        load_job(["data.dataset=local_text", f"data.dataset_path={tmp_path}"])


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused(tmp_path):
    vocab = {f"t{i}": i for i in range(600)}  # the tiny model embeds 512 ids
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab}, "added_tokens": []}))
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ConfigError, match="data.tokenizer_path: the tokenizer makes 600 token ids, but recipe "
                                          "llama3_tiny's model embeds 512"):
        load_job(["recipe=llama3_tiny", f"data.tokenizer_path={tmp_path}"])


def test_torchtitans_names_never_shadow_a_key_of_ours():
    from monarch_sky import titan_keys
    from monarch_sky.config_help import key_table

    ours = {key for key, _, _ in key_table()}
    shadowed = [k for k in (*titan_keys.SAME, *titan_keys.ANSWERS) if k in ours and titan_keys.SAME.get(k) != k]
    assert shadowed == [], f"TorchTitan's names that are also ours, read as something else: {shadowed}"


def test_torchtitans_training_settings_reach_the_trainers_torchtitan_config():
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    from monarch_sky.recipes import RECIPES, TrainerSpec

    def built(platform: str, *overrides: str):
        job = load_job(list(overrides)).config
        return RECIPES[job.recipe].build_trainer(TrainerSpec.from_job(job, 0, "", platform))

    chosen = built("cpu", "compile.enable=true", "activation_checkpoint.mode=selective",
                   "training.mixed_precision_param=bfloat16")
    assert chosen.compile.enable and isinstance(chosen.activation_checkpoint, SelectiveAC.Config)
    assert chosen.training.mixed_precision_param == "bfloat16"
    gpu, cpu = built("rocm"), built("cpu")  # auto: what each host is best at
    assert isinstance(gpu.activation_checkpoint, FullAC.Config) and gpu.training.mixed_precision_param == "bfloat16"
    assert cpu.activation_checkpoint is None and cpu.training.mixed_precision_param == "float32"
    assert not cpu.compile.enable
    with pytest.raises(ConfigError, match="training.activation_checkpoint: 'memory_budget' is not one of auto, full"):
        load_job(["activation_checkpoint.mode=memory_budget"])


def test_a_tensor_parallel_degree_must_split_the_host_and_the_heads():
    with pytest.raises(ConfigError, match="training.tensor_parallel: 3 does not divide procs_per_replica=4"):
        load_job(["procs_per_replica=4", "training.tensor_parallel=3"])
    # llama3_tiny has 8 heads: 16 GPUs of a host cannot split them
    with pytest.raises(ConfigError, match="tiny's 8 attention heads and 8 key/value heads; pick a divisor of 8"):
        load_job(["procs_per_replica=16", "training.tensor_parallel=16"])
    assert load_job(["procs_per_replica=4", "training.tensor_parallel=2"]).config.training.tensor_parallel == 2
