"""The models the ``fully_shard`` tests train, and how they split them.

Shared by ``test_fully_shard``, ``test_fully_shard_checkpoint`` and ``test_fully_shard_elastic``:
an MLP whose sizes split unevenly over 3 or 4 ranks (5 -> 7 -> 11 -> 2 -> 3, a nested block
among its layers) and a tiny transformers Llama, both built from seed 0.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import sharded_tensor as st
from sharding import composite, single_split

__all__ = ["fully_shard_llama", "fully_shard_mlp", "tensor_parallel_mlp", "tiny_llama", "uneven_mlp"]


def uneven_mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    """The MLP with uneven sizes, seed 0, in ``dtype``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.GELU(),
                         nn.Sequential(nn.Linear(7, 11), nn.LayerNorm(11), nn.Tanh(), nn.Linear(11, 2)),
                         nn.Linear(2, 3)).to(dtype)


def fully_shard_mlp(model: nn.Module, ranks: list[int] | None = None, **kwargs: Any) -> nn.Module:
    """``uneven_mlp``'s units: its first layer and its nested block fully sharded, then the root."""
    st.fully_shard(model[0], ranks, **kwargs)  # type: ignore[index]
    st.fully_shard(model[2], ranks, **kwargs)  # type: ignore[index]
    return st.fully_shard(model, ranks, **kwargs)


def tensor_parallel_mlp(model: nn.Module, group: Any) -> nn.Module:
    """``uneven_mlp`` tensor parallel over the 2 ranks of ``group``: the first layer split on its
    outputs, the nested block's last layer on its inputs."""
    ranks = ["rank:0/cpu", "rank:1/cpu"]
    spec = composite(**{"0": single_split(0, ranks), "2.3.weight": single_split(1, ranks)})
    return st.shard_model(model, spec, process_group=group)


def tiny_llama(vocab: int) -> nn.Module:
    """A transformers Llama of 2 layers (hidden 32, 4 heads over 2 key/value heads), seed 0."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=44, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=32,
                         use_cache=False, attention_dropout=0.0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def fully_shard_llama(model: nn.Module, **kwargs: Any) -> nn.Module:
    """``tiny_llama``'s units: each decoder layer fully sharded, then the model."""
    for layer in model.model.layers:  # type: ignore[union-attr]
        st.fully_shard(layer, **kwargs)
    return st.fully_shard(model, **kwargs)
