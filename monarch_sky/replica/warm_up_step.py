"""A spare's warm-up step: one layer of the recipe's model, forward and backward on random tokens.

On GPUs the recipes' FlexAttention is compiled and autotuned on its first call (45-80 s
measured on an H200, docs/gpu-check). A spare host runs this step while it waits, so what
Inductor compiled is in the node's cache (`platform.keep_kernels_on_node`) before a group's
trainer asks for it: the promoted group's first step loads the kernels instead of tuning them.
One layer has every layer's shapes, which is what the kernels are keyed on, so even the 70B
recipe's warm-up fits on one GPU. Only spares run it: a warm standby shares its GPUs with the
running group, whose memory it must not take. On CPU the recipes run SDPA and nothing is
compiled, so `auto` skips it there.
"""

from __future__ import annotations

import copy
import time

import torch

from monarch_sky.recipes import RECIPES, TrainerSpec


def wanted(mode: str, platform_kind: str) -> bool:
    return mode == "always" or (mode == "auto" and platform_kind != "cpu")


def warm_up_step(spec: TrainerSpec, mode: str, local_index: int) -> float | None:
    """Run the step if `mode` asks for it on this host, on the GPU this process will train on
    (`local_index` on its host); its seconds, or None if skipped."""
    from monarch_sky.replica.trainer import import_torchtitan

    plat = import_torchtitan()
    if not wanted(mode, plat.kind):
        return None
    start = time.perf_counter()
    config = RECIPES[spec.recipe].build_trainer(spec.on_host(plat.kind))
    device = torch.device("cpu") if plat.is_cpu else torch.device("cuda", local_index)
    model = _one_layer(config, device)
    batch, seq_len = config.training.local_batch_size, config.training.seq_len
    tokens = torch.randint(0, model.config.vocab_size, (batch, seq_len), device=device)
    positions = torch.arange(seq_len, device=device).expand(batch, seq_len)
    masks = _attention_masks(model, positions)
    model(tokens, positions=positions, **masks).float().mean().backward()
    del model, tokens, positions, masks
    if not plat.is_cpu:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()  # the group's trainer gets the whole device
    return time.perf_counter() - start


def _one_layer(config, device: torch.device):
    """The recipe's model cut to its first layer, initialised on `device` in the dtype its
    training computes in (bf16 on GPUs: the kernels are compiled per dtype)."""
    model_config = copy.deepcopy(config.model_spec.model)
    model_config.layers = model_config.layers[:1]
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device=device)
    model.init_weights(buffer_device=None)
    model.config = model_config
    dtype = getattr(torch, config.training.mixed_precision_param)
    for param in model.parameters():  # as FSDP's mixed precision does; buffers (RoPE's complex ones) stay
        param.data = param.data.to(dtype)
    return model


def _attention_masks(model, positions: torch.Tensor) -> dict:
    """FlexAttention's block mask, built as the trainer builds it (itself a compiled call)."""
    from torchtitan.models.common import FlexAttention

    inner = getattr(model.config.first_attention, "inner_attention", None)
    return {"attention_masks": model.get_attention_masks(positions=positions)} if isinstance(inner, FlexAttention.Config) else {}
