"""A small Llama-style causal LM, built in code from a config (nothing downloaded), with Hugging Face's names.

Parameter names follow ``transformers``' Llama (``model.layers.0.self_attn.q_proj.weight``, ...), so what the demo
moves looks like what a real trainer moves. Float32 and one thread per process keep forward passes deterministic,
so a replica holding the trainer's exact bytes produces the trainer's exact logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from weightsync.api.parts import Part

__all__ = ["LlamaConfig", "TinyLlama", "config_for_megabytes", "tensor_parallel_part", "tensor_parallel_dims"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 4096
    hidden_size: int = 512
    intermediate_size: int = 1408
    num_layers: int = 4
    num_heads: int = 8
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0

    @property
    def parameters(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        per_layer = 4 * h * h + 3 * h * i + 2 * h
        return 2 * self.vocab_size * h + self.num_layers * per_layer + h


def config_for_megabytes(megabytes: float) -> LlamaConfig:
    """A config whose float32 weights take about ``megabytes`` MB (decimal): the widest that fits one layer."""
    target = megabytes * 1e6 / 4
    for hidden in (512, 384, 256, 192, 128, 64):
        shape = {"hidden_size": hidden, "intermediate_size": hidden * 11 // 4}
        base = LlamaConfig(num_layers=0, **shape).parameters
        per_layer = LlamaConfig(num_layers=1, **shape).parameters - base
        if base + per_layer <= target:
            return LlamaConfig(num_layers=max(1, round((target - base) / per_layer)), **shape)
    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176, num_layers=1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed: torch.Tensor = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return normed


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.heads = config.num_heads
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        shape = (batch, length, self.heads, hidden // self.heads)
        q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        projected: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, length, hidden))
        return projected


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return down


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class _Body(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)


class TinyLlama(nn.Module):
    def __init__(self, config: LlamaConfig, *, seed: int) -> None:
        super().__init__()
        self.config = config
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.model = _Body(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for parameter in self.parameters():
            if parameter.dim() > 1:
                nn.init.normal_(parameter, std=1 / math.sqrt(parameter.shape[-1]))
        torch.random.set_rng_state(generator_state)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        config = self.config
        head_dim = config.hidden_size // config.num_heads
        positions = torch.arange(tokens.shape[1], dtype=torch.float32)
        inverse = 1.0 / config.rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        angles = torch.outer(positions, inverse)
        angles = torch.cat((angles, angles), dim=-1)
        x = self.model.embed_tokens(tokens)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # a no-op for float32 weights
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        logits: torch.Tensor = self.lm_head(self.model.norm(x))
        return logits


_ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")
"""Layers whose input is split across tensor-parallel ranks: each rank holds a block of their columns."""


def tensor_parallel_dims(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """The dimension tensor parallelism splits each parameter along, as vLLM's Llama does: the vocabulary of the
    embedding and the head, the rows of q/k/v, gate and up (column-parallel), the columns of o and down
    (row-parallel); norms are not split (every rank holds them whole)."""
    return {name: 1 if name.endswith(_ROW_PARALLEL) else 0 for name, shape in shapes.items() if len(shape) == 2}


def tensor_parallel_part(config: LlamaConfig, rank: int, size: int) -> Part:
    """Rank ``rank`` of ``size``'s part of a ``TinyLlama`` of ``config`` (``weightsync.api.parts.Part``)."""
    with torch.device("meta"):
        shapes = {name: tuple(param.shape) for name, param in TinyLlama(config, seed=0).named_parameters()}
    return Part.split(shapes, dims=tensor_parallel_dims(shapes), rank=rank, parts=size)
