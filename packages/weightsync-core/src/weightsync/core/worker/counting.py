"""What ``EngineHost`` hands a sink: the engine's ``ReceivedWeights``, passed through, noting from outside the engine
whether any tensor may have reached the sink's model (a failed update that touched nothing leaves the replica
holding its old version, which the manager reads from ``mark_untouched``'s mark)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

import torch

from weightsync.api.errors import DestinationError
from weightsync.api.protocols import ReceivedWeights, next_batch
from weightsync.api.types import TransferReport

__all__ = ["CountingStream", "Lookups"]


class CountingStream:
    """Passes a ``ReceivedWeights`` through, noting from outside the engine whether any tensor may have reached the
    sink's model (:meth:`touched`)."""

    def __init__(self, inner: ReceivedWeights) -> None:
        self._inner = inner
        self.handed = 0
        """Tensors handed to the sink itself (views it iterated, or the fallback of ``copy_into``)."""
        self.looked_up: list[str] = []
        """Names of the destinations ``copy_into`` looked up, in order."""

    def touched(self, error: BaseException) -> bool:
        """Whether the failed update (``error``) may have written to the model. A tensor handed to the sink may
        have been; in ``copy_into``, what the engine says (a ``wrote`` flag: ours set it before their first copy),
        else every destination looked up counts, except the last when ``error`` is a ``DestinationError`` naming
        it (its check failed before it was written, as ``copy_stream_into`` checks)."""
        if self.handed:
            return True
        wrote = getattr(self._inner, "wrote", None)
        if isinstance(wrote, bool):
            return wrote
        looked_up = len(self.looked_up)
        if looked_up and isinstance(error, DestinationError) and error.name == self.looked_up[-1]:
            looked_up -= 1
        return looked_up > 0

    @property
    def report(self) -> TransferReport | None:
        return self._inner.report

    async def drain(self) -> int:
        """Read what the sink left of the stream without handing it over; how many tensors that was."""
        left = 0
        async for _ in self._inner:
            left += 1
        return left

    async def aclose(self) -> None:
        close = getattr(self._inner, "aclose", None)
        if close is not None:
            await close()

    def __aiter__(self) -> CountingStream:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        item = await self._inner.__anext__()
        self.handed += 1
        return item

    async def next_batch(self) -> list[tuple[str, torch.Tensor]] | None:
        """``BatchedWeights``: the engine's batch, or one tensor from a stream that has no batches."""
        batch = await next_batch(self._inner)
        self.handed += len(batch or ())
        return batch

    async def copy_into(
        self, destinations: Mapping[str, torch.Tensor], *,
        fallback: Callable[[str, torch.Tensor], object] | None = None,
    ) -> int:
        """Noted from outside the engine: each destination looked up, each fallback call."""

        def counted(name: str, tensor: torch.Tensor) -> object:
            self.handed += 1
            return fallback(name, tensor) if fallback is not None else None

        return await self._inner.copy_into(Lookups(self.looked_up, destinations),
                                           fallback=counted if fallback else None)


class Lookups(Mapping[str, "torch.Tensor"]):
    """The sink's destinations, noting the name of every lookup that finds one."""

    def __init__(self, names: list[str], inner: Mapping[str, torch.Tensor]) -> None:
        self._names = names
        self._inner = inner

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._inner[name]
        self._names.append(name)
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)
