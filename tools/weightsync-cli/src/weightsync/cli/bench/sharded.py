"""``weightsync bench --sharded``: the actor ranks hold the bench's model under FSDP2, as a trainer's ranks do.

The M actor ranks of an entry join one gloo group of their own (``torch.distributed.init_process_group`` over a
``TCPStore`` the driver hosts on the loopback interface) and build the bench's model (``scenario.model_layout``) as
a module tree whose parameter names are the layout's names and whose shapes are its shapes, in bf16: every dotted
prefix of a name is a plain ``nn.Module``, the last component its parameter. Each module whose path ends in
``layers.<i>`` is a "layer" (``model.layers.3`` of the realistic mix, holding its norm and its MLP matrix; ``layers.3``
of the small mix) and gets ``fully_shard``, then the root does (``lm_head.weight`` is the root's), all over the mesh
``init_device_mesh("cpu", (M,))``: every parameter is a ``DTensor``, ``Shard(0)``, each rank a block of its rows. The
module is built on the meta device and materialised after sharding, so a rank never holds more than its shards.
The parameters are frozen (``requires_grad=False``): nothing is trained, and ``full_tensor`` then records no graph.
The stream order is ``named_parameters``'s (each layer's norm, then its matrix), not the layout's: a model's own.

Two ways to send it, the two entries of a backend B (``scenario.SHARDED``, ``scenario.GATHERED``):
- ``B+sharded``: every rank streams ``ModuleShards(module).named_weights()`` (its local shards, no collective) and
  declares its ``SourceLayout`` at ``prepare``: every rank sends what it holds, at once;
- ``B+gathered``: every rank streams ``(name, param.full_tensor())`` for each parameter in order (an all-gather per
  parameter, collective: every rank iterates the same order) and declares nothing, so rank 0 sends the gathered
  model and the others drain their streams: how a trainer without sharded sources sends, today's path.

Version k of the model (``fill``) is a pattern of the full tensors' rows: row i of tensor ``name`` (element i of a
vector) is ``((7 i + 13 k + crc32(name)) mod 251) - 125`` everywhere, small integers that bf16 holds exactly; rank r
fills its shard's rows from where the shard starts. After the timed updates every receiver compares what it holds
with the version sent (``mismatches``): a shard sent to the wrong rows, or one rank's shard sent for another's, shows
there, which the per-sender digests (which prove each stream arrived as sent) would not.
"""

from __future__ import annotations

import datetime
import re
import zlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from weightsync.api.sources import Shard, SourceLayout
from weightsync.core.worker.sources import ModuleShards

__all__ = ["FsdpModel", "build_module", "check_receivers", "fill_rows", "mismatches", "row_pattern"]

JOIN_TIMEOUT = datetime.timedelta(seconds=120)
# torch.distributed re-exports its C++ store classes without declaring them to type checkers.
_c10d: Any = dist
_LAYER = re.compile(r"(?:.*\.)?layers\.\d+")
"""The path of a "layer" module: each gets its own ``fully_shard``, as a trainer wraps its decoder layers."""


def row_pattern(name: str, version: int, rows: range) -> torch.Tensor:
    """The values of rows ``rows`` of tensor ``name`` in version ``version`` (one bf16 value per row)."""
    index = torch.arange(rows.start, rows.stop, dtype=torch.int64)
    return ((index * 7 + version * 13 + zlib.crc32(name.encode())) % 251 - 125).to(torch.bfloat16)


def fill_rows(tensor: torch.Tensor, name: str, version: int, first_row: int) -> None:
    """``tensor`` (rows ``first_row``.. of tensor ``name``) set to its rows of version ``version``."""
    if tensor.numel() == 0:
        return
    values = row_pattern(name, version, range(first_row, first_row + tensor.shape[0]))
    tensor.copy_(values.view(-1, *([1] * (tensor.dim() - 1))).expand_as(tensor))


def mismatches(by_name: dict[str, torch.Tensor], version: int) -> list[str]:
    """The tensors of a receiver's whole model that do not hold version ``version`` bit for bit."""
    wrong = []
    for name, tensor in by_name.items():
        expected = torch.empty_like(tensor)
        fill_rows(expected, name, version, 0)
        if not torch.equal(tensor.view(torch.int16), expected.view(torch.int16)):
            wrong.append(name)
    return wrong


def build_module(layout: list[tuple[str, tuple[int, ...]]], device: str = "meta") -> torch.nn.Module:
    """A module tree whose ``named_parameters`` are ``layout``'s names and shapes, frozen bf16 on ``device``."""
    root = torch.nn.Module()
    for name, shape in layout:
        *path, leaf = name.split(".")
        owner = root
        for component in path:
            try:
                owner = owner.get_submodule(component)
            except AttributeError:  # the first name under this prefix
                child = torch.nn.Module()
                owner.add_module(component, child)
                owner = child
        owner.register_parameter(leaf, torch.nn.Parameter(
            torch.empty(shape, dtype=torch.bfloat16, device=device), requires_grad=False))
    return root


class FsdpModel:
    """One actor rank's FSDP2-sharded copy of the bench's model (see the module docstring): ``spec`` is the
    worker's (``group_rank`` is its rank in the actors' group, ``actor_ranks`` its size, ``store_host``,
    ``store_port`` and ``tag`` the driver's store); joining blocks until every actor rank has joined."""

    def __init__(self, spec: dict[str, Any], layout: list[tuple[str, tuple[int, ...]]]) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        self.sharded = spec["source"] == "sharded"
        ranks = int(spec["actor_ranks"])
        store = _c10d.TCPStore(spec["store_host"], int(spec["store_port"]), is_master=False, timeout=JOIN_TIMEOUT)
        dist.init_process_group("gloo", store=_c10d.PrefixStore(f"sharded/{spec['tag']}", store),
                                rank=int(spec["group_rank"]), world_size=ranks, timeout=JOIN_TIMEOUT)
        mesh = init_device_mesh("cpu", (ranks,))
        module = build_module(layout)
        for path, layer in list(module.named_modules()):
            if _LAYER.fullmatch(path):
                fully_shard(layer, mesh=mesh)
        fully_shard(module, mesh=mesh)
        self.module = module.to_empty(device="cpu")
        self.shards = ModuleShards(self.module)
        # Pre-faulted, as a trainer's parameters are: else the first ``load`` touches the shards' pages after the
        # peak-RSS mark, and the entry's peak extra RSS counts this rank's shards as the update's memory.
        self.fill(0)

    def fill(self, version: int) -> None:
        """This rank's shards of version ``version`` (untimed, before an update)."""
        with torch.no_grad():
            for name, item in self.shards.named_weights():
                shard = item if isinstance(item, Shard) else Shard(tensor=item, shape=tuple(item.shape),
                                                                    start=(0,) * item.dim())
                fill_rows(shard.tensor, name, version, shard.start[0] if shard.start else 0)

    def layout(self) -> SourceLayout:
        """What this rank holds (``EngineHost(source=...)``): asked at every ``prepare``."""
        return self.shards.source_layout()

    def weights(self) -> Iterator[tuple[str, Any]]:
        """The stream of one update: this rank's shards (``+sharded``), or every parameter gathered whole."""
        if self.sharded:
            yield from self.shards.named_weights()
            return
        from torch.distributed.tensor import DTensor

        for name, parameter in self.module.named_parameters():
            # An all-gather of the parameter's shards: collective, so every rank asks for them in the same order.
            yield name, parameter.full_tensor() if isinstance(parameter, DTensor) else parameter

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_receivers(entry: str, wrong: list[list[str]]) -> int:
    """The receivers checked (``wrong``: per receiver, the tensors :func:`mismatches` found); a ``RuntimeError``
    naming those of ``entry`` that do not hold what was sent, and the first few tensors of each."""
    bad = {receiver: names for receiver, names in enumerate(wrong) if names}
    if bad:
        said = "; ".join(f"receiver {receiver}: {len(names)} tensors ({', '.join(names[:3])}...)"
                         for receiver, names in bad.items())
        raise RuntimeError(f"{entry}: the receivers do not hold the model sent: {said}")
    return len(wrong)
