"""Released weights to start from: a Hugging Face checkpoint (safetensors) instead of random ones.

By default a run trains from scratch. `init.weights_repo` names a hub model (e.g.
meta-llama/Llama-3.1-8B), which `monarch-sky fetch-weights` downloads with HF_TOKEN into
`weights_dir(repo)` (sky/setup.sh does it on every node); `init.weights_path` names a local
folder instead. Every replica group loads them at the start through TorchTitan's own HF loader
(`replica/initial_weights.py`), each from its own node's disk, all at once; a group that joins
after the first commit heals from a peer instead. Before anything is spawned, the checkpoint's
tensor names and shapes are checked against the recipe's model (built on the meta device).
"""

from __future__ import annotations

from pathlib import Path

from monarch_sky.common import hub_assets

WEIGHT_FILES = ["*.safetensors", "model.safetensors.index.json", "config.json"]


def weights_dir(repo: str) -> Path:
    return hub_assets.cache_root() / "weights" / repo


def weights_path(init) -> str | None:
    """The folder a job's weights are read from, or None: the run trains from scratch."""
    if init.weights_path:
        return str(Path(init.weights_path).expanduser().resolve())
    return str(weights_dir(init.weights_repo)) if init.weights_repo else None


def source(init) -> str:
    """What the run starts from, in words."""
    return init.weights_path or init.weights_repo or "random weights (from scratch)"


def fetched_later(init) -> bool:
    """The weights come from the hub: fetched where the run trains, so a preview validates without them."""
    return bool(init.weights_repo) and not init.weights_path


def present(init) -> bool:
    path = weights_path(init)
    return path is not None and any(Path(path).glob("*.safetensors"))


def fetch(repo: str) -> Path:
    dest = weights_dir(repo)
    hub_assets.download(repo, WEIGHT_FILES, dest, field="init.weights_repo",
                        local_fix="copy the model's safetensors to every node and set init.weights_path")
    if not any(dest.glob("*.safetensors")):
        raise hub_assets.HubAccessError(f"init.weights_repo: {repo} has no .safetensors files; fix: name a "
                                        f"repository with the model's Hugging Face weights")
    return dest


def missing(init) -> str | None:
    """Why the job's weights are not there to load, with the fix; None if they are (or the
    run trains from scratch). Their shapes are checked against the model by `model_shapes`."""
    path = weights_path(init)
    if path is None or present(init):
        return None
    if not init.weights_path:
        return (f"init.weights_repo: {init.weights_repo}'s weights are not at {path}; fetch them with "
                f"`HF_TOKEN=... monarch-sky fetch-weights init.weights_repo={init.weights_repo}` "
                "(sky/setup.sh does this on the cloud)")
    return f"init.weights_path: {path} holds no .safetensors file; point it at a Hugging Face model folder"
