"""A recipe's model built on the meta device: its real shapes, no memory, no accelerator.

The heal budget sizes a recipe from it, and released weights (`common/released_weights.py`)
are checked against it before anything is spawned.
"""

from __future__ import annotations

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


def hf_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """The Hugging Face name and shape of every tensor a checkpoint for the job's recipe must
    hold (TorchTitan's own state-dict adapter maps the names)."""
    model, config = meta_build(cfg)
    adapter = config.model_spec.state_dict_adapter(config.model_spec.model, None)
    return {name: tuple(t.shape) for name, t in adapter.to_hf(model.state_dict()).items()}


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
