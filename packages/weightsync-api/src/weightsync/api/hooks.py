"""Helpers for writing a ``RolloutReplica`` (plain Python; no torch, no ray)."""

from __future__ import annotations

__all__ = ["WholePauseHooks"]


class WholePauseHooks:
    """The four ``RolloutReplica`` hooks of a replica that pauses and resumes whole (a ``PausableReplica`` whose
    pause keeps its requests and KV cache): ``abort_all_requests`` pauses, ``resume_generation`` resumes, and the KV
    cache hooks have nothing to do. A replica class lists it as a base beside its own ``pause`` and ``resume``."""

    async def pause(self) -> None:
        raise NotImplementedError

    async def resume(self) -> None:
        raise NotImplementedError

    async def abort_all_requests(self) -> None:
        await self.pause()

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def resume_generation(self) -> None:
        await self.resume()
