"""TorchTitan qwen3 configs (dense), built the same way as the llama3 ones (`llama3.py`): the
same trainer, fault tolerance and heal state; Qwen3's own blocks (QK norm, tied embeddings on
the small sizes), parallelize function and state-dict adapter.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from monarch_sky.recipes.llama3 import _trainer_config

if TYPE_CHECKING:
    from monarch_sky.recipes import TrainerSpec


def _qwen3_family():
    from torchtitan.models.qwen3 import Qwen3StateDictAdapter, parallelize_qwen3

    return "qwen3", parallelize_qwen3, Qwen3StateDictAdapter


def tiny(spec: "TrainerSpec"):
    return _trainer_config(spec, _tiny_model(vocab_size=512), "tiny", family=_qwen3_family)


def _flavor(name: str, spec: "TrainerSpec"):
    from torchtitan.models.qwen3 import qwen3_configs

    return _trainer_config(spec, qwen3_configs[name](attn_backend="flex"), name, family=_qwen3_family)


qwen3_0_6b = partial(_flavor, "0.6B")
qwen3_8b = partial(_flavor, "8B")
qwen3_32b = partial(_flavor, "32B")


def _tiny_model(vocab_size: int, dim: int = 128, n_layers: int = 4, n_heads: int = 8, n_kv_heads: int = 4):
    """A Qwen3 (QK norm, grouped KV heads, tied embeddings) small enough for CPU runs."""
    import torch.nn as nn
    from torchtitan.models.common import CosSinRoPE, Embedding, FlexAttention, Linear, RMSNorm
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.qwen3 import Qwen3Model, Qwen3TransformerBlock

    head_dim = dim // n_heads
    linear_init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}

    def norm(size: int):
        return RMSNorm.Config(normalized_shape=size, eps=1e-6, param_init={"weight": nn.init.ones_})

    layers = [
        Qwen3TransformerBlock.Config(
            attention_norm=norm(dim),
            ffn_norm=norm(dim),
            attention=make_gqa_config(
                dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim,
                wqkv_param_init=linear_init, wo_param_init=linear_init, inner_attention=FlexAttention.Config(),
                fuse_qkv=True, rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0),
                qk_norm=norm(head_dim),
            ),
            feed_forward=make_ffn_config(dim=dim, hidden_dim=3 * dim, w1_param_init=linear_init,
                                         w2w3_param_init=linear_init),
        )
        for _ in range(n_layers)
    ]
    return Qwen3Model.Config(
        vocab_size=vocab_size,
        dim=dim,
        norm=norm(dim),
        enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=vocab_size, embedding_dim=dim,
                                        param_init={"weight": partial(nn.init.normal_, std=0.02)}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab_size, param_init=linear_init),
        layers=layers,
    )
