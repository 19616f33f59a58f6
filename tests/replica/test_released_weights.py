"""A run that starts from released weights: a Hugging Face checkpoint (safetensors) made here.

- Every group starts from exactly the checkpoint's weights (its digest right after the load is
  the digest of the model the checkpoint was written from), trains, and a group killed after a
  commit heals from a peer instead of loading them again; the run ends with equal digests.
- A checkpoint of another model, or a folder without one, stops at config time naming
  init.weights_path and the tensors that do not fit.
- From the hub: a preview validates before the weights are fetched, `train` refuses until
  `monarch-sky fetch-weights` has fetched them, and only the weights' files arrive.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, train
from fake_hub import FakeHub

from monarch_sky.common import test_hooks

REPO_ID = "acme/tiny-llama"


def write_checkpoint(folder: Path, recipe: str = "llama3_tiny", seed: int = 7) -> str:
    """`recipe`'s model with weights of its own, saved as Hugging Face safetensors in two shards;
    returns the digest a one-rank group holding those weights reports."""
    from safetensors.torch import save_file

    from monarch_sky.config import load_job
    from monarch_sky.model_shapes import meta_build
    from monarch_sky.replica.digest import combine, shard_digest

    _meta, config = meta_build(load_job([f"recipe={recipe}"]).config)
    model = config.model_spec.model.build()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    hf = config.model_spec.state_dict_adapter(config.model_spec.model, None).to_hf(model.state_dict())
    names = sorted(hf)
    folder.mkdir(parents=True)
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        save_file({n: hf[n].contiguous() for n in part}, str(folder / f"model-0000{i + 1}-of-00002.safetensors"))
    (folder / "config.json").write_text('{"model_type": "llama"}')
    return combine([shard_digest([model])])


def test_every_group_starts_from_the_released_weights_and_a_rejoiner_heals_instead(tmp_path):
    weights = tmp_path / "weights"
    digest = write_checkpoint(weights)
    run = train(tmp_path / "run", "replicas=2", "procs_per_replica=1", "steps=16", "faults=kill@6:1",
                f"init.weights_path={weights}", env={test_hooks.STEP_PAUSE_ENV: "0.25"})  # time to rejoin
    assert run.returncode == 0, run.output[-3000:]
    init = run.summary["initial_weights"]
    assert init["source"] == str(weights)
    assert {r: load["digest"] for r, load in init["loads"].items()} == {"0": digest, "1": digest}
    loads = [e for e in run.events if e["event"] == "initial_weights"]
    assert sorted(e["replica"] for e in loads) == [0, 1], "the group killed after a commit healed, not reloaded"
    [fault] = run.summary["faults"]
    assert fault["recovered_from"] == "peer"
    assert run.summary["committed_steps"] == 16
    assert len(set(run.summary["final_param_digest"].values())) == 1


def test_a_run_from_scratch_says_so_and_loads_nothing(tmp_path):
    from monarch_sky.common import released_weights
    from monarch_sky.config import load_job

    init = load_job([]).config.init
    assert released_weights.weights_path(init) is None
    assert released_weights.source(init) == "random weights (from scratch)"


def test_weights_of_another_model_or_none_stop_at_config_time_naming_the_fix(tmp_path):
    from monarch_sky.config import ConfigError, load_job

    qwen = tmp_path / "qwen"
    write_checkpoint(qwen, recipe="qwen3_tiny")
    with pytest.raises(ConfigError) as e:
        load_job(["recipe=llama3_tiny", f"init.weights_path={qwen}"])
    assert str(e.value).startswith(f"init.weights_path: {qwen} is not a checkpoint of recipe llama3_tiny's model")
    assert "fix: use the weights of the model the recipe trains" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no .safetensors file"):
        load_job([f"init.weights_path={tmp_path / 'empty'}"])
    with pytest.raises(ConfigError, match="init.weights_path: no such folder"):
        load_job([f"init.weights_path={tmp_path / 'nowhere'}"])


def _cli(*words: str, cache: Path, hub: FakeHub | None = None) -> subprocess.CompletedProcess:
    env = {**cli_env(), "MONARCH_SKY_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_granted",
           "HF_ENDPOINT": hub.endpoint if hub else "http://127.0.0.1:9"}
    return subprocess.run([sys.executable, "-m", "monarch_sky", *words], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def hub_files(tmp_path: Path) -> dict[str, bytes]:
    made = tmp_path / "made"
    write_checkpoint(made)
    return {p.name: p.read_bytes() for p in made.iterdir()} | {"README.md": b"# tiny", "pytorch_model.bin": b"x"}


def test_hub_weights_are_fetched_before_train_and_only_their_files_arrive(tmp_path):
    files = hub_files(tmp_path)
    cache, job = tmp_path / "cache", ("recipe=llama3_tiny", f"init.weights_repo={REPO_ID}")
    preview = _cli("config", *job, cache=cache)
    assert preview.returncode == 0 and "monarch-sky fetch-weights" in preview.stderr, preview.stderr
    refused = _cli("train", *job, cache=cache)
    assert refused.returncode == 2 and f"init.weights_repo: {REPO_ID}'s weights are not at" in refused.stderr
    hub = FakeHub(REPO_ID, files, token="hf_granted", gated=True)
    try:
        fetched = _cli("fetch-weights", *job, cache=cache, hub=hub)
    finally:
        hub.close()
    assert fetched.returncode == 0, fetched.stderr
    folder = cache / "weights" / REPO_ID
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == sorted(
        n for n in files if n.endswith(".safetensors") or n == "config.json")
    nothing = _cli("fetch-weights", "recipe=llama3_tiny", cache=cache)
    assert nothing.returncode == 0 and "random weights (from scratch): nothing to fetch" in nothing.stdout


def test_node_setup_fetches_the_weights_the_runs_arguments_name(tmp_path):
    """sky/setup.sh's own fetch step, with the run's MONARCH_SKY_ARGS as SkyPilot passes them."""
    script = (REPO / "sky" / "setup.sh").read_text()
    fetch_weights = script[script.index("fetch_weights() {"):]
    fetch_weights = fetch_weights[:fetch_weights.index("\n}\n") + 3]
    hub, cache = FakeHub(REPO_ID, hub_files(tmp_path), token="hf_granted"), tmp_path / "cache"
    env = {**cli_env(), "MONARCH_SKY_CACHE": str(cache), "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": "hf_granted",
           "HF_ENDPOINT": hub.endpoint, "PY": sys.executable, "RECIPE": "llama3_tiny",
           # words that are not init.* (here one that only a multi-node job accepts) stay the trainer's
           "MONARCH_SKY_ARGS": f"steps=5 hosts.spares=1 'init.weights_repo={REPO_ID}'"}
    try:
        run = subprocess.run(["bash", "-c", f'set -euo pipefail; die() {{ echo "$*" >&2; exit 1; }}\n{fetch_weights}\nfetch_weights'],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        hub.close()
    assert run.returncode == 0, run.stderr
    assert any((cache / "weights" / REPO_ID).glob("*.safetensors"))
    env["MONARCH_SKY_ARGS"] = "steps=5"
    nothing = subprocess.run(["bash", "-c", f'set -euo pipefail\n{fetch_weights}\nfetch_weights'],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert nothing.returncode == 0 and nothing.stdout == "", nothing.stdout + nothing.stderr
