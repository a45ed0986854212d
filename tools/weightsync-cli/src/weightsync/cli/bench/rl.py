"""``weightsync bench --mix rl``: the versions an RL trainer really sends, one Adam step apart.

A Llama-style decoder (``weightsync.cli.model``) of about S bytes in bf16 — norms 1.0, linear and embedding weights
N(0, 0.02), an untied head — whose fp32 master weights are the upcast bf16 weights. Between two versions exactly one
Adam step (β 0.9/0.999, eps 1e-8, no weight decay) on the real gradients of a language-model loss over 4 × 128
random tokens; each version is the master weights cast back to bf16. At RL learning rates (1e-6) most of an Adam
step is smaller than half the bf16 spacing of the weight it moves, so most bf16 bits stay as they were: the changed
fraction is what delta updates exploit; ``--lr 1e-3`` is the dense control.

The versions are computed once per run, untimed, into files of the model's bytes in layout order, and every case
replays the same files (its sender loads version k before the k-th update, untimed).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from weightsync.cli.model import TinyLlama, config_for_megabytes
from weightsync.core.wire.tensors import as_byte_view, memoryview_of

__all__ = ["DEFAULT_LR", "RLVersions", "changed_bytes", "load_version", "make_versions", "version_path"]

DEFAULT_LR = 1e-6
BATCH, SEQUENCE = 4, 128
INIT_STD = 0.02
SEED = 0


@dataclass(frozen=True)
class RLVersions:
    """Versions 0..count-1 of one model, each a file of its bf16 bytes in ``layout`` order."""

    directory: str
    layout: list[tuple[str, tuple[int, ...]]]
    total_bytes: int
    changed: list[int]
    """``changed[k]``: the bytes of version k that differ bitwise from version k-1 (``changed[0]``: all of them)."""
    lr: float

    def changed_fraction(self, versions: range) -> float:
        """The mean changed bytes / S over ``versions`` (each against the one before)."""
        return sum(self.changed[k] for k in versions) / (len(versions) * self.total_bytes) if len(versions) else 0.0

    def remove(self) -> None:
        for name in os.listdir(self.directory):
            os.unlink(os.path.join(self.directory, name))
        os.rmdir(self.directory)


def changed_bytes(before: torch.Tensor, after: torch.Tensor) -> int:
    """The bytes of two same-shaped tensors that differ, compared bitwise in units of their element size."""
    unit = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[after.element_size()]
    return int((before.view(unit) != after.view(unit)).sum()) * after.element_size()


def _model(total_bytes: int) -> TinyLlama:
    """The fp32 master model of about ``total_bytes`` bf16 bytes, its weights the upcast of their bf16 cast."""
    model = TinyLlama(config_for_megabytes(2 * total_bytes / 1e6), seed=SEED)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, INIT_STD, generator=generator)
            else:
                parameter.fill_(1.0)
            parameter.copy_(parameter.to(torch.bfloat16).float())
    return model


def make_versions(total_bytes: int, count: int, *, lr: float = DEFAULT_LR, directory: str | None = None,
                  step: Callable[[str], None] | None = None) -> RLVersions:
    """Compute ``count`` versions (version 0 the initial model, each next one Adam step later) and write them to
    files in a new directory under ``directory`` (default: the system's temporary directory)."""
    if count < 1:
        raise ValueError("make_versions needs at least one version")
    if not lr > 0:
        raise ValueError(f"the learning rate must be positive, not {lr}")
    model = _model(total_bytes)
    names = [name for name, _ in model.named_parameters()]
    parameters = list(model.parameters())
    layout = [(name, tuple(parameter.shape)) for name, parameter in zip(names, parameters)]
    optimizer = torch.optim.Adam(parameters, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    tokens = torch.Generator().manual_seed(SEED + 1)
    vocab = model.config.vocab_size
    folder = tempfile.mkdtemp(prefix="weightsync-rl-", dir=directory)
    changed: list[int] = []
    previous: list[torch.Tensor] | None = None
    try:
        for version in range(count):
            if version > 0:
                batch = torch.randint(vocab, (BATCH, SEQUENCE + 1), generator=tokens)
                logits = model(batch[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
                optimizer.zero_grad(set_to_none=True)
                torch.autograd.backward(loss)
                optimizer.step()
            with torch.no_grad():
                current = [parameter.detach().to(torch.bfloat16) for parameter in parameters]
            changed.append(sum(tensor.numel() * 2 for tensor in current) if previous is None
                           else sum(changed_bytes(a, b) for a, b in zip(previous, current)))
            with open(version_path(folder, version), "wb") as handle:
                for tensor in current:
                    handle.write(memoryview_of(as_byte_view(tensor)))
            previous = current
            if step is not None:
                step(f"rl versions: {version + 1}/{count} (lr {lr:g})")
    except BaseException:
        RLVersions(folder, layout, 0, [], lr).remove()
        raise
    return RLVersions(folder, layout, sum(2 * tensor.numel() for tensor in previous or []), changed, lr)


def version_path(directory: str, version: int) -> str:
    return os.path.join(directory, f"version-{version}.bin")


def load_version(directory: str, version: int, tensors: list[torch.Tensor]) -> None:
    """Read version ``version`` of ``directory`` into ``tensors`` (its layout's tensors, in order)."""
    path = version_path(directory, version)
    with open(path, "rb") as handle:
        for tensor in tensors:
            view = memoryview_of(as_byte_view(tensor), writable=True)
            if handle.readinto(view) != len(view):
                raise ValueError(f"{path} is shorter than its layout")
        if handle.read(1):
            raise ValueError(f"{path} is longer than its layout")
