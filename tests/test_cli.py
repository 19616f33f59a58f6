"""The command line a newcomer meets: help that lists the keys and loads no torch, `config`
to print and check settings, a YAML file under the overrides, flags read as KEY=VALUE, W&B
finding a `wandb login` key, a crash's traceback kept in the run record."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, cli_env, new_tag
from monarch_sky.hosts import tls
from monarch_sky.record import progress

SKY_PYTHON = REPO / ".venv-sky" / "bin" / "python"


def cli(*args: str, env: dict | None = None, timeout_s: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "monarch_sky", *args], cwd=REPO, env={**cli_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout_s)


def modules_after(*argv: str) -> dict:
    """Run the CLI in a fresh interpreter and list which heavy modules it imported."""
    probe = (
        "import json, sys\nfrom monarch_sky.cli import main\n"
        f"try:\n    main({list(argv)!r})\nexcept SystemExit:\n    pass\n"
        "heavy = ('torch', 'torchtitan', 'torchft', 'monarch', 'wandb')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {"loaded": json.loads(proc.stdout.strip().splitlines()[-1]), "output": proc.stdout}


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"], ["config", "--help"], ["tls-ca"]])
def test_help_and_the_ca_load_no_torch_and_no_monarch(argv):
    probed = modules_after(*argv)
    assert probed["loaded"] == [], f"{argv} imported {probed['loaded']}"


def test_train_help_lists_every_config_key_with_its_default():
    from monarch_sky.config_help import key_table

    out = cli("train", "--help").stdout
    keys = key_table()
    assert len(keys) > 40
    for key, default, _ in keys:
        assert f"  {key}={default}" in out, f"{key} missing from train --help"
    assert "replicas=3" in out and "training.lr=0.003" in out, "the default recipe's own values"


def test_config_help_lists_the_keys_it_promises():
    out = cli("config", "--help")
    assert out.returncode == 0 and "(keys below)" in out.stdout
    assert "  replicas=" in out.stdout and "chaos.kinds=[kill," in out.stdout
    kinds = next(line for line in out.stdout.splitlines() if "chaos.kinds=" in line)
    assert kinds.split("]", 1)[1].strip(), "every key says what it is"


def test_config_prints_the_resolved_config_which_reads_back_as_the_same_job(tmp_path):
    out = cli("config", "replicas=2", "steps=40", "ft.mode=diloco", "ft.sync_steps=10")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["replicas"] == 2 and printed["ft"]["mode"] == "diloco" and printed["faults"] == "kill@16:1"
    assert printed["training"]["seq_len"] == 128, "the recipe's defaults are resolved"
    saved = tmp_path / "job.yaml"
    saved.write_text(out.stdout)
    again = cli("config", "--config", str(saved))
    assert again.returncode == 0 and yaml.safe_load(again.stdout) == printed


def test_a_cloud_recipe_previews_on_a_fresh_machine_with_no_token(tmp_path):
    # The README and `--help` give `config recipe=llama3_8b` to preview the cloud settings: its
    # tokenizer is fetched at setup on the nodes, so only `train` needs it.
    env = {**cli_env(), "HOME": str(tmp_path), "MONARCH_SKY_CACHE": str(tmp_path / "cache")}
    env.pop("HF_TOKEN", None)
    out = cli("config", "recipe=llama3_8b", env=env)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["data"]["tokenizer_repo"] == "meta-llama/Llama-3.1-8B"
    assert "`train` here would refuse" in out.stderr and "fetch-tokenizer meta-llama/Llama-3.1-8B" in out.stderr
    refused = cli("train", "recipe=llama3_8b", env=env)
    assert refused.returncode == 2 and "fetch-tokenizer meta-llama/Llama-3.1-8B" in refused.stderr, refused.stderr


def test_config_file_sits_under_the_overrides_and_over_the_recipe(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("replicas: 2\nsteps: 30\ntraining:\n  lr: 0.01\nft.sync_steps: 5\n")
    printed = yaml.safe_load(cli("config", "--config", str(job), "steps=60").stdout)
    assert (printed["replicas"], printed["steps"], printed["training"]["lr"]) == (2, 60, 0.01)
    assert printed["ft"]["sync_steps"] == 5 and printed["training"]["seq_len"] == 128


@pytest.mark.parametrize("argv,says", [
    (["config", "replicas=0"], ["replicas", ">= 1"]),
    (["config", "--config", "/nonexistent/job.yaml"], ["--config", "no file"]),
    (["config", "--training.stepz", "10"], ["training.stepz", "unknown config key", "seq_len"]),
    (["train", "--bogus"], ["unrecognized arguments: --bogus", "KEY=VALUE"]),
    (["bench", "stepz=3"], ["unrecognized arguments: --stepz", "KEY=VALUE"]),
    (["config", "steps=abc"], ["steps: 'abc' is not a whole number", "steps=500"]),
    (["config", "steps=1e3"], ["steps:", "is not a whole number", "1e3 is a float"]),
    (["config", "training.lr=fast"], ["training.lr: 'fast' is not a number", "training.lr=3e-4"]),
    (["config", "ft.standby=maybe"], ["ft.standby: 'maybe' is not true or false", "ft.standby=true"]),
])
def test_bad_settings_exit_2_naming_the_field(argv, says):
    out = cli(*argv)
    assert out.returncode == 2, out.stdout + out.stderr
    for text in says:
        assert text in out.stderr, (text, out.stderr)


def test_flags_in_torchtitan_style_are_read_as_key_value(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text("- a list\n")
    assert "must hold keys" in cli("config", "--config", str(job)).stderr
    printed = yaml.safe_load(cli("config", "--replicas", "2", "--training.lr=0.02", "--procs-per-replica", "1").stdout)
    assert (printed["replicas"], printed["training"]["lr"], printed["procs_per_replica"]) == (2, 0.02, 1)


def test_torchtitans_own_names_are_read_as_ours():
    out = cli("config", "--training.steps", "500", "--optimizer.lr", "1e-3", "--lr_scheduler.warmup_steps", "7",
              "--model.flavor", "8B", "--parallelism.data_parallel_shard_degree", "-1",
              "--parallelism.tensor_parallel_degree", "4")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert (printed["recipe"], printed["steps"], printed["procs_per_replica"]) == ("llama3_8b", 500, 8)
    assert (printed["training"]["lr"], printed["training"]["warmup_steps"]) == (1e-3, 7)
    assert printed["training"]["tensor_parallel"] == 4


def test_a_torchtitan_setting_monarch_sky_does_not_offer_is_answered_with_what_to_use():
    out = cli("config", "--parallelism.pipeline_parallel_degree", "2")
    assert out.returncode == 2
    assert "parallelism.pipeline_parallel_degree: TorchTitan's setting" in out.stderr and "procs_per_replica" in out.stderr
    assert cli("config", "--parallelism.pipeline_parallel_degree", "1").returncode == 0, "1 asks for nothing new"


def test_a_torchtitan_job_file_is_read_under_the_command_line(tmp_path):
    toml = tmp_path / "llama3_debug.toml"  # the shape of TorchTitan's own train_configs
    toml.write_text('[job]\ndump_folder = "./outputs"\ndescription = "debug"\n[model]\nname = "llama3"\n'
                    'flavor = "debugmodel"\n[optimizer]\nname = "AdamW"\nlr = 8e-4\n[training]\n'
                    'local_batch_size = 8\nseq_len = 2048\nsteps = 10\n[parallelism]\n'
                    'data_parallel_replicate_degree = 1\ndata_parallel_shard_degree = -1\n[metrics]\nlog_freq = 1\n')
    out = cli("config", "--job.config_file", str(toml), "--training.steps", "20")
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert (printed["recipe"], printed["steps"], printed["run_dir"]) == ("llama3_debug", 20, "./outputs")
    assert (printed["training"]["lr"], printed["training"]["seq_len"], printed["training"]["local_batch_size"]) == \
        (8e-4, 2048, 8)
    assert "not used: job.description, optimizer.name, metrics.log_freq" in out.stderr
    missing = cli("config", "--job.config_file", str(tmp_path / "none.toml"))
    assert missing.returncode == 2 and "job.config_file: no file" in missing.stderr


def test_the_ca_runs_from_a_python_with_only_cryptography(tmp_path):
    """SkyPilot's venv has cryptography and none of monarch-sky's stack: the recipes' header
    command makes the CA there, and its exports are a CA a node can issue from."""
    out = subprocess.run([str(SKY_PYTHON), "-m", "monarch_sky.hosts.tls"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, env={"PATH": os.environ["PATH"]})
    assert out.returncode == 0, out.stderr
    env = dict(line.removeprefix("export ").split("=", 1) for line in out.stdout.splitlines())
    assert set(env) == {tls.CA_ENV, tls.CA_KEY_ENV}
    assert base64.b64decode(env[tls.CA_ENV]).startswith(b"-----BEGIN CERTIFICATE")
    issued = tls.node_env(str(tmp_path / "certs"), ["127.0.0.1"], environ=env)
    assert (tmp_path / "certs" / "cert.pem").read_text() and set(issued) == set(tls.HYPERACTOR_ENV.values())


WANDB_PROBE = "from monarch_sky.record.tracking import wandb_mode; print(wandb_mode('auto'))"


@pytest.mark.parametrize("netrc,expected", [(True, "online"), (False, "offline")])
def test_wandb_auto_is_online_with_the_key_wandb_login_keeps(tmp_path, netrc, expected):
    if netrc:
        (tmp_path / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {'a1' * 20}\n")
        (tmp_path / ".netrc").chmod(0o600)
    env = {k: v for k, v in cli_env().items() if not k.startswith(("WANDB_", "NETRC"))}  # wandb's defaults: ~/.netrc
    out = subprocess.run([sys.executable, "-c", WANDB_PROBE], cwd=REPO, env={**env, "HOME": str(tmp_path)},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == expected, out.stderr


def test_a_controller_crash_leaves_its_traceback_in_the_run_record(tmp_path):
    tag = new_tag()
    out = subprocess.run(
        [sys.executable, "tests/providers.py", "broken", f"run_dir={tmp_path}", f"run_id={tag}", "replicas=2",
         "steps=6", "procs_per_replica=1"],
        cwd=REPO, env=cli_env(tag), capture_output=True, text=True, timeout=300,
    )
    log = tmp_path / tag / "controller.log"
    assert out.returncode != 0 and f"(traceback: {log})" in out.stdout, out.stdout + out.stderr
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "controller_ip broke (test)" in text
    summary = json.loads((tmp_path / tag / "summary.json").read_text())
    assert summary["outcome"]["status"] == "failed" and summary["wandb"]["mode"] == "offline"


def test_progress_off_a_terminal_is_a_line_per_interval_with_rate_and_eta():
    import io

    now = [0.0]
    stream = io.StringIO()
    display = progress.Display(1000, stream, log_every_s=30, clock=lambda: now[0])
    for step in range(1, 1001):
        now[0] = step * 0.5  # 2 steps/s: 500 s in all
        display.status(step, 1.0, 100.0, 3, 3, 3, 0, 0)
    lines = stream.getvalue().splitlines()
    assert 500 / 30 <= len(lines) <= 500 / 30 + 2, len(lines)
    assert "step     1/1000" in lines[0] and "step  1000/1000" in lines[-1]
    middle = lines[len(lines) // 2]
    assert "2.00 step/s" in middle and "eta 0" in middle


def test_eta_is_unknown_until_steps_are_made():
    rate = progress.StepRate()
    assert rate.add(5, 100.0) == 0.0 and progress.eta_s(5, 10, 0.0) is None
    assert rate.add(15, 105.0) == 2.0 and progress.eta_s(15, 25, 2.0) == 5.0


def test_a_tls_run_refuses_torchfts_unauthenticated_http_heal(tmp_path):
    # TorchFT's HTTP transport unpickles (weights_only=False) what answers at a peer's address.
    certs = {var: str(tmp_path / what) for what, var in tls.HYPERACTOR_ENV.items()}
    out = cli("train", f"run_dir={tmp_path}", "ft.heal_transport=http", env=certs)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "ft.heal_transport=http" in out.stderr and "use tcp or rdma" in out.stderr
    assert not list(tmp_path.glob("*/events.jsonl")), "nothing may start"
