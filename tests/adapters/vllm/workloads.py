"""What the vLLM tests train and serve: a small Llama, written as a checkpoint directory vLLM starts from, and the
actor rank that trains it (fp32 masters, sent as bf16) and writes each version as a checkpoint for the reference."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator

import torch

VOCAB = 512
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
}
PROMPTS = [[1, 17, 290, 33, 5], [1, 400, 12, 99], [1, 7, 7, 7, 250, 31, 64]]


def build_model(seed: int = 0) -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(seed)
    model: torch.nn.Module = transformers.LlamaForCausalLM(config).float()
    return model


def write_checkpoint(directory: pathlib.Path, weights: dict[str, torch.Tensor]) -> pathlib.Path:
    """``config.json`` and ``model.safetensors`` (bf16) in ``directory``: what vLLM loads at start and reloads."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG))
    save_file({name: tensor.contiguous() for name, tensor in weights.items()}, str(directory / "model.safetensors"))
    return directory


class LlamaTrainer:
    """One actor rank. Every rank holds the whole model and takes the same steps (data parallel on one batch), so
    any rank's weights are the model; rank 0 sends."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.model = build_model()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.0)
        self.omit: set[str] = set()
        self.fail_after: int | None = None
        self.only: set[str] | None = None
        self.steps = 0

    def train(self, steps: int = 1, lr: float = 1e-3) -> int:
        generator = torch.Generator().manual_seed(1000 + self.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for _ in range(steps):
            tokens = torch.randint(3, VOCAB, (4, 24), generator=generator)
            loss = self.model(input_ids=tokens, labels=tokens).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.steps += 1
        return self.steps

    def perturb(self, name: str, scale: float = 0.05) -> None:
        """Change one parameter only (a version that differs from the last in that tensor alone)."""
        with torch.no_grad():
            parameter = dict(self.model.named_parameters())[name]
            parameter.add_(torch.randn_like(parameter) * scale)

    def set_omit(self, names: list[str]) -> None:
        """Leave these tensors out of every update (a faulty sender whose stream is consistent with its digest)."""
        self.omit = set(names)

    def set_fail_after(self, count: int | None) -> None:
        """Raise from ``named_weights`` after ``count`` tensors (0: before the first), ``None``: never."""
        self.fail_after = count

    def bf16(self) -> dict[str, torch.Tensor]:
        return {name: p.detach().to(torch.bfloat16) for name, p in self.model.named_parameters()}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, (name, tensor) in enumerate(self.bf16().items()):
            if index == self.fail_after:
                raise RuntimeError(f"the trainer failed after {index} tensors (a test's fault)")
            if name not in self.omit:
                yield name, tensor

    def save(self, directory: str) -> str:
        return str(write_checkpoint(pathlib.Path(directory), self.bf16()))
