"""TorchTitan llama3 configs for fault-tolerant training across replica groups.

Each public function takes a `TrainerSpec` and returns a complete
`FaultTolerantTrainer.Config`. torchtitan is imported inside the functions: they run in
the replica processes, after `platform.prepare_torchtitan()`.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from monarch_sky.recipes import TrainerSpec


def tiny(spec: "TrainerSpec"):
    return _trainer_config(spec, _tiny_model(vocab_size=512), flavor="tiny")


def debug(spec: "TrainerSpec"):
    from torchtitan.models.llama3 import llama3_configs

    return _trainer_config(spec, llama3_configs["debugmodel"](attn_backend="flex"), "debugmodel")


def llama3_8b(spec: "TrainerSpec"):
    from torchtitan.models.llama3 import llama3_configs

    return _trainer_config(spec, llama3_configs["8B"](attn_backend="flex"), "8B")


def llama3_70b(spec: "TrainerSpec"):
    from torchtitan.models.llama3 import llama3_configs

    return _trainer_config(spec, llama3_configs["70B"](attn_backend="flex"), "70B")


def _tiny_model(vocab_size: int, dim: int = 128, n_layers: int = 4, n_heads: int = 8):
    """A llama3 small enough for 6 trainer processes to share 2 CPU cores."""
    import torch.nn as nn
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        FlexAttention,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.common.param_init import depth_scaled_std
    from torchtitan.models.llama3 import Llama3Model, Llama3TransformerBlock

    linear_init = {"weight": partial(nn.init.trunc_normal_, std=0.02), "bias": nn.init.zeros_}
    norm_init = {"weight": nn.init.ones_}

    def depth_init(layer_id: int):
        std = depth_scaled_std(0.02, layer_id)
        return {"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}

    rope = ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=4096, theta=500000, scaling="llama")
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
            attention=make_gqa_config(
                dim=dim,
                n_heads=n_heads,
                wqkv_param_init=linear_init,
                wo_param_init=depth_init(layer_id),
                inner_attention=FlexAttention.Config(),
                fuse_qkv=True,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=dim,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=32),
                w1_param_init=linear_init,
                w2w3_param_init=depth_init(layer_id),
            ),
        )
        for layer_id in range(n_layers)
    ]
    output_std = dim**-0.5
    return Llama3Model.Config(
        dim=dim,
        vocab_size=vocab_size,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab_size,
            embedding_dim=dim,
            param_init={"weight": partial(nn.init.normal_, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=norm_init),
        lm_head=Linear.Config(
            in_features=dim,
            out_features=vocab_size,
            param_init={
                "weight": partial(
                    nn.init.trunc_normal_, std=output_std, a=-3 * output_std, b=3 * output_std
                ),
                "bias": nn.init.zeros_,
            },
        ),
        layers=layers,
    )


def _use_sdpa(model_config) -> None:
    """FlexAttention has no CPU backward: run plain causal SDPA instead."""
    from torchtitan.models.common import ScaledDotProductAttention

    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def _llama3_family():
    from torchtitan.models.llama3 import Llama3StateDictAdapter, parallelize_llama

    return "llama3", parallelize_llama, Llama3StateDictAdapter


def _trainer_config(spec: "TrainerSpec", model_config, flavor: str, family=_llama3_family):
    """`family`: () -> (name, parallelize_fn, state_dict_adapter) of TorchTitan's model family."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CommConfig, CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.experiments.torchft.checkpoint import TorchFTCheckpointManager
    from torchtitan.experiments.torchft.config.job_config import (
        FaultTolerance,
        FaultTolerantModelSpec,
    )
    from torchtitan.experiments.torchft.diloco import fragment_llm
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer
    from torchtitan.experiments.torchft.trainer import FaultTolerantTrainer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.tools.profiler import Profiler

    on_cpu = spec.platform_kind == "cpu"
    if on_cpu:
        _use_sdpa(model_config)
    name, parallelize, adapter = family()
    model_spec = FaultTolerantModelSpec(
        name=f"torchft/{name}",
        flavor=flavor,
        model=model_config,
        parallelize_fn=parallelize,
        pipelining_fn=pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=adapter,
        fragment_fn=fragment_llm,
    )
    training, data, ft = spec.training, spec.data, spec.ft
    diloco = ft["mode"] == "diloco"
    return FaultTolerantTrainer.Config(
        model_spec=model_spec,
        hf_assets_path=data["tokenizer_path"],
        dump_folder=spec.dump_folder,
        loss=CrossEntropyLoss.Config(global_vocab_size=model_config.vocab_size),
        profiler=Profiler.Config(enable_profiling=False),
        metrics=MetricsProcessor.Config(log_freq=10**9, disable_color_printing=True),
        optimizer=TorchFTOptimizersContainer.Config(
            param_groups=default_adamw(lr=training["lr"]).param_groups
        ),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=training["warmup_steps"],
            decay_ratio=0.8,
            decay_type="linear",
            min_lr_factor=0.1,
        ),
        training=TrainingConfig(
            local_batch_size=training["local_batch_size"],
            seq_len=training["seq_len"],
            steps=spec.steps,
            # bf16 compute is slow and imprecise on CPU.
            mixed_precision_param=_precision(training, on_cpu),
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=spec.ranks // training["tensor_parallel"],
            tensor_parallel_degree=training["tensor_parallel"],
            # The default spmd_types backend rejects FSDP over >1 rank here.
            spmd_backend="partial_dtensor",
        ),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset=data["dataset"], dataset_path=data["dataset_path"]
        ),
        # Live recovery never reads checkpoint files: healing state is registered on the
        # TorchFT manager by monarch_sky.replica.healing instead.
        checkpoint=TorchFTCheckpointManager.Config(enable=False),
        activation_checkpoint=_activation_checkpoint(training, on_cpu),
        compile=CompileConfig(enable=training["compile"]),
        comm=CommConfig(trace_buf_size=0, init_timeout_seconds=300),
        debug=DebugConfig(seed=spec.seed),
        fault_tolerance=FaultTolerance(
            enable=True,
            replica_id=spec.replica,
            group_size=spec.replicas,
            process_group="gloo" if on_cpu else "nccl",
            process_group_timeout_ms=ft["process_group_timeout_ms"],
            min_replica_size=ft["min_replicas"],
            semi_sync_method="diloco" if diloco else None,
            sync_steps=ft["sync_steps"],
        ),
        validator=Validator.Config(enable=False),
    )


def _precision(training: dict, on_cpu: bool) -> str:
    """FSDP's parameter dtype: `auto` is bf16 on GPUs and float32 on CPU (bf16 is slow and imprecise there)."""
    chosen = training["mixed_precision"]
    return ("float32" if on_cpu else "bfloat16") if chosen == "auto" else chosen


def _activation_checkpoint(training: dict, on_cpu: bool):
    """TorchTitan's activation checkpointing: `auto` is full on GPUs (8192-token sequences) and none on CPU."""
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    mode = training["activation_checkpoint"]
    if mode == "auto":
        mode = "none" if on_cpu else "full"
    return {"full": FullAC.Config, "selective": SelectiveAC.Config}.get(mode, lambda: None)()
