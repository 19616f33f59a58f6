"""A recipe's model built on the meta device: its real shapes, no memory, no accelerator.

The heal budget sizes a recipe from it; released weights (`common/released_weights.py`) and
a tensor parallel degree are checked against it before anything is spawned.
"""

from __future__ import annotations

import math
from pathlib import Path

_BUILT: dict = {}  # recipe -> (meta model, trainer config)


def meta_build(cfg):
    """(model, TorchTitan trainer config) of the job `cfg`'s recipe, on the meta device; built
    once per recipe (the shapes are the recipe's own)."""
    if cfg.recipe not in _BUILT:
        _BUILT[cfg.recipe] = _build(cfg)
    return _BUILT[cfg.recipe]


def _build(cfg):
    import torch

    from monarch_sky.common import platform as platform_mod
    from monarch_sky.recipes import RECIPES, TrainerSpec

    platform_mod.prepare_torchtitan(platform_mod.detect())  # before torchtitan's first import
    spec = TrainerSpec.from_job(cfg, replica=0, dump_folder="", platform_kind="cpu")
    config = RECIPES[cfg.recipe].build_trainer(spec)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    return model, config


def attention_heads(cfg) -> tuple[int, int]:
    """(attention heads, key/value heads) of the job's model: tensor parallelism splits both."""
    model, _config = meta_build(cfg)
    attention = next(iter(model.layers.values())).attention
    return attention.n_heads, attention.n_kv_heads


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The Hugging Face name and shape of every tensor a checkpoint for the job's recipe must
    hold (TorchTitan's own state-dict adapter maps the names)."""
    model, config = meta_build(cfg)
    adapter = config.model_spec.state_dict_adapter(config.model_spec.model, None)
    return {name: tuple(t.shape) for name, t in adapter.to_hf(model.state_dict()).items()}


def tensor_parallel_problem(cfg) -> str | None:
    """Why the job's `training.tensor_parallel` cannot split its model, with the fix; None if it can."""
    tp = cfg.training.tensor_parallel
    if cfg.procs_per_replica % tp:
        return (f"training.tensor_parallel: {tp} does not divide procs_per_replica={cfg.procs_per_replica}; "
                "a layer is split over the GPUs of one host, so pick a divisor of it")
    if tp == 1:
        return None
    heads, kv_heads = attention_heads(cfg)
    if heads % tp or kv_heads % tp:
        return (f"training.tensor_parallel: {tp} does not divide recipe {cfg.recipe}'s {heads} attention heads "
                f"and {kv_heads} key/value heads; pick a divisor of {math.gcd(heads, kv_heads)}")
    return None


def weights_problem(cfg) -> str | None:
    """Why the released weights a job starts from cannot start its recipe's model, with the
    fix; None if they can, or it trains from scratch."""
    from monarch_sky.common import released_weights

    if problem := released_weights.missing(cfg.init):
        return problem
    path = released_weights.weights_path(cfg.init)
    key = "init.weights_path" if cfg.init.weights_path else "init.weights_repo"
    return weights_mismatch(key, path, cfg) if path else None


def weights_mismatch(key: str, path: str, cfg) -> str | None:
    """Why the safetensors in `path` (named by setting `key`) cannot start the job's model; None if they can."""
    recipe = cfg.recipe
    want, have = hf_shapes(cfg), _shapes(path)
    missing = sorted(set(want) - set(have))
    wrong = sorted(n for n in set(want) & set(have) if want[n] != have[n])
    if not missing and not wrong:
        return None
    said = [f"{n} is {have[n]}, the model's {want[n]}" for n in wrong[:3]] + [f"{n} is missing" for n in missing[:3]]
    return (f"{key}: {path} is not a checkpoint of recipe {recipe}'s model ({len(wrong)} tensors of another shape, "
            f"{len(missing)} missing: {'; '.join(said)}); fix: use the weights of the model the recipe trains")


def _shapes(path: str) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape in a folder's safetensors, read from their headers only."""
    from safetensors import safe_open

    shapes = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            shapes.update({name: tuple(f.get_slice(name).get_shape()) for name in f.keys()})
    return shapes
