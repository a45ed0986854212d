"""The model of ``--rollout vllm`` and of the vLLM tests: a Llama (``transformers``' ``LlamaForCausalLM``, which vLLM
serves as its own ``LlamaForCausalLM``), written as a checkpoint directory vLLM starts from, and the actor rank that
trains it (fp32 masters, sent as bf16) and writes any version as a checkpoint.
"""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LlamaTrainer", "PROMPTS", "build_model", "llama_config", "write_checkpoint"]

SMALL: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
}
"""The tests' model: 2 layers, hidden 128 (about 1 MB in bf16)."""
WIDE = dict(SMALL, vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
            num_key_value_heads=4)
"""The shape of larger models (``llama_config(model_mb)``): layers of hidden 1024, about 22.4 MB each in bf16."""
PROMPTS = [[1, 17, 290, 33, 5], [1, 400, 12, 99], [1, 7, 7, 7, 250, 31, 64]]
"""Token ids, valid in every config here (vocabulary of at least 512)."""


def _parameters(config: dict[str, Any], layers: int) -> int:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    kv = hidden * config["num_key_value_heads"] // config["num_attention_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    return int(2 * config["vocab_size"] * hidden + hidden + layers * per_layer)


def llama_config(model_mb: float | None = None, *, hidden: int = 1024) -> dict[str, Any]:
    """``config.json`` of the model: the tests' small one (``None``, or up to 2 MB), else ``WIDE``'s shape at
    ``hidden`` (a multiple of 256: heads of 64, a KV head for every 4, an MLP 2.75 times as wide) with as many
    layers (at least 1) as bring its bf16 size nearest to ``model_mb`` MiB."""
    if model_mb is None or model_mb <= 2:
        return dict(SMALL)
    heads = hidden // 64
    shape = dict(WIDE, hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_attention_heads=heads,
                 num_key_value_heads=heads // 4)
    target = model_mb * (1 << 20) / 2
    layers = min(range(1, 4096), key=lambda n: abs(_parameters(shape, n) - target))
    return dict(shape, num_hidden_layers=layers)


def build_model(config: dict[str, Any], seed: int = 0) -> torch.nn.Module:
    """The fp32 model of ``config``, initialised from ``seed``."""
    import transformers

    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model: torch.nn.Module = transformers.LlamaForCausalLM(hf_config).float()
    return model


def write_checkpoint(directory: pathlib.Path, weights: dict[str, torch.Tensor], config: dict[str, Any]
                     ) -> pathlib.Path:
    """``config.json`` and ``model.safetensors`` in ``directory``: what vLLM loads at start and reloads."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(directory / "model.safetensors"))
    return directory


class LlamaTrainer:
    """One actor rank: the ``WeightSource`` of ``RayActorWorkerGroup.create(source_factory=...)``.

    Every rank holds the whole model (data parallel). Joined (:meth:`join`), each rank trains on a batch of its own
    and the gradients are all-reduced over gloo; unjoined, every rank takes the same batch. Either way the ranks
    hold the same weights, and rank 0's are the model.
    """

    def __init__(self, rank: int, world_size: int, *, config: dict[str, Any] | None = None) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self.config = dict(config or SMALL)
        self.model = build_model(self.config)
        self.optimizer: torch.optim.Optimizer | None = None
        self.steps = 0
        self._held: dict[str, torch.Tensor] | None = None

    def address(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def join(self, init_method: str) -> None:
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=init_method, rank=self.rank, world_size=self.world_size)

    def train(self, steps: int = 1, lr: float = 1e-3) -> int:
        """``steps`` AdamW steps at ``lr`` on random token batches; the number of steps taken so far."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)
        joined = dist.is_initialized()
        generator = torch.Generator().manual_seed(1000 + self.steps * self.world_size + (self.rank if joined else 0))
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for _ in range(steps):
            tokens = torch.randint(3, self.config["vocab_size"], (4, 24), generator=generator)
            loss = self.model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if joined:
                for parameter in self.model.parameters():
                    if parameter.grad is not None:
                        dist.all_reduce(parameter.grad)
                        parameter.grad /= self.world_size
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
        self._held = None
        return self.steps

    def perturb(self, name: str | None = None, scale: float = 0.05, seed: int = 0) -> None:
        """Add noise to one parameter (a version that differs from the last in that tensor alone), or to all
        (``None``: a new version of the whole model without the cost of a training step); the same on every rank."""
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for parameter_name, parameter in self.model.named_parameters():
                if name is None or parameter_name == name:
                    parameter.add_(torch.randn(parameter.shape, generator=generator) * scale)
        self._held = None

    def hold(self) -> None:
        """Cast the model to bf16 now and keep it until the next step: what is sent and saved is then ready, as in
        a mixed-precision trainer whose forward weights are bf16 (the bench's "the trainer holds version v")."""
        self._held = {name: p.detach().to(torch.bfloat16) for name, p in self.model.named_parameters()}

    def bf16(self) -> dict[str, torch.Tensor]:
        return dict(self.served())

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """What is sent: :meth:`served`."""
        yield from self.served()

    def served(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The model as served (bf16): the weights :meth:`hold` keeps, or each fp32 master cast to bf16 as it is
        asked for (the cast then overlaps the transfer)."""
        if self._held is not None:
            yield from self._held.items()
            return
        for name, parameter in self.model.named_parameters():
            yield name, parameter.detach().to(torch.bfloat16)

    def nbytes(self) -> int:
        """The model's size as sent (bf16)."""
        return sum(parameter.numel() * 2 for parameter in self.model.parameters())

    def save(self, directory: str) -> str:
        """Write the model (bf16) as a checkpoint directory; its path."""
        return str(write_checkpoint(pathlib.Path(directory), self.bf16(), self.config))

    def timed_save(self, directory: str) -> float:
        """:meth:`save`, its seconds."""
        began = time.perf_counter()
        self.save(directory)
        return time.perf_counter() - began
