"""One worker's membership of the ParameterServer world for one epoch: joined in ``init_process_group``, left when
the epoch ends or the engine closes.

Its methods block (collectives, checkpoint-engine's own waits); the engine runs the update's in its own thread.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator

import torch

from weightsync.api.errors import BackendUnavailableError, TopologyError, TransferError
from weightsync.core.backend import EngineSettings
from weightsync.kimi.library import CheckpointEngineLibrary, ParameterServer
from weightsync.kimi.mapping import Exchange, JoinArgs, KimiOptions, SetDigest
from weightsync.kimi.stream import KimiStream

__all__ = ["ParameterServerGroup"]


class ParameterServerGroup:
    """This worker's ``ParameterServer``, its group, and what it registered under the epoch's checkpoint name."""

    def __init__(self, server: ParameterServer, *, library: CheckpointEngineLibrary, settings: EngineSettings,
                 options: KimiOptions, args: JoinArgs) -> None:
        self.server, self.library, self.settings, self.options, self.args = server, library, settings, options, args
        self.registered = False
        """Whether this update's share is registered (``finalize`` unregisters it)."""
        self.pool_in_use = False
        """Whether the shared pinned pool was allocated (finalize keeps it; leaving the epoch frees it)."""

    @classmethod
    def join(cls, *, library: CheckpointEngineLibrary, settings: EngineSettings, options: KimiOptions,
             args: JoinArgs) -> ParameterServerGroup:
        """Build this worker's ParameterServer and join its (private) group; blocks until every PS rank arrived."""
        rank, world = args.ps_rank, args.ps_world_size
        try:
            with _ps_environment(rank, world):
                server = library.new_parameter_server(
                    rank=rank, world_size=world, auto_pg=False, mem_fraction=options.mem_fraction,
                    master_addr=args.master_addr, master_port=args.master_port,
                )
            library.join_group(server, timeout=datetime.timedelta(seconds=settings.timeout))
        except BackendUnavailableError:
            raise
        except Exception as exc:  # checkpoint-engine validates with assert and raises plain RuntimeErrors
            raise TransferError(f"kimi: ParameterServer rank {rank} failed to join its group: {exc!r}",
                                peer="ParameterServer rank 0") from None
        return cls(server, library=library, settings=settings, options=options, args=args)

    @property
    def peer(self) -> str:
        return f"kimi ParameterServer group (this is PS rank {self.args.ps_rank})"

    @property
    def _timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.settings.timeout)

    @property
    def _update_ranks(self) -> list[int] | None:
        ranks = self.args.update_ranks
        return list(ranks) if ranks else None

    def send(self, share: dict[str, torch.Tensor], digest: SetDigest, version: int) -> Exchange:
        """An actor rank's update: register its share, exchange digests, serve ``update``; the whole update's
        digest, size and version come back."""
        name, rank = self.args.checkpoint_name, self.settings.context.rank
        try:
            self.server.register_checkpoint(name, named_tensors=share,
                                            use_shared_memory_pool=self.options.shared_memory_pool)
            self.registered = True
            self.pool_in_use = self.pool_in_use or self.options.shared_memory_pool
            self.server.gather_metas(name)
            contribution = Exchange.contribution(digest, version=version if rank == 0 else None)
            exchange = Exchange.from_sum(self.library.all_reduce_sum(contribution, ps_rank=self.args.ps_rank))
            self.server.update(name, self._discard, timeout=self._timeout, ranks=self._update_ranks)
        except (BackendUnavailableError, TopologyError):
            raise
        except Exception as exc:
            raise TransferError(f"kimi: update failed on actor rank {rank}: {exc!r}", peer=self.peer) from None
        return exchange

    def _discard(self, socket_paths: list[tuple[str, str]]) -> None:
        """An actor rank's PS also receives every bucket in broadcast mode; its IPC consumer drops them."""
        self.library.serve_ipc(self._socket_for_this_device(socket_paths), lambda weights: None,
                               ps_rank=self.args.ps_rank)

    def receive(self, stream: KimiStream) -> Exchange:
        """A rollout worker's update: exchange digests, then serve ``update``'s IPC hand-off into ``stream``."""
        name = self.args.checkpoint_name
        try:
            self.server.gather_metas(name)
            contribution = Exchange.contribution(None, version=None)
            exchange = Exchange.from_sum(self.library.all_reduce_sum(contribution, ps_rank=self.args.ps_rank))
            stream.expected = exchange

            def req_func(socket_paths: list[tuple[str, str]]) -> None:
                try:
                    self.library.serve_ipc(self._socket_for_this_device(socket_paths), stream.deliver,
                                           ps_rank=self.args.ps_rank)
                except BaseException as exc:
                    stream.fail(exc)
                    raise

            self.server.update(name, req_func, timeout=self._timeout, ranks=self._update_ranks)
        except (BackendUnavailableError, TopologyError, TransferError):
            raise
        except Exception as exc:
            raise TransferError(f"kimi: update failed on rollout rank {self.settings.context.rank}: {exc!r}",
                                peer=self.peer) from None
        return exchange

    def _socket_for_this_device(self, socket_paths: list[tuple[str, str]]) -> str:
        uuid = self.library.device_uuid(ps_rank=self.args.ps_rank)
        for device_uuid, path in socket_paths:
            if device_uuid == uuid:
                return path
        raise TransferError(f"kimi: no IPC socket for this GPU ({uuid}) among {[u for u, _ in socket_paths]}",
                            peer=self.peer)

    def finalize(self) -> None:
        if self.registered:
            # Not forced: a shared pinned pool stays allocated for the next update of this epoch.
            self.server.unregister_checkpoint(self.args.checkpoint_name)
            self.registered = False

    def leave(self) -> None:
        """Free the epoch's registrations (the shared pool included) and destroy the PS's private groups."""
        try:
            if self.registered or self.pool_in_use:
                self.server.unregister_checkpoint(self.args.checkpoint_name, force=True)
        finally:
            self.registered = self.pool_in_use = False
            self.library.destroy_process_group()


@contextlib.contextmanager
def _ps_environment(rank: int, world_size: int) -> Iterator[None]:
    """``RANK``/``WORLD_SIZE`` as the PS's constructor reads them, then the caller's values back.

    checkpoint-engine reads ``rank or int(os.environ["RANK"])`` (rank 0 counts as unset) and its P2P store reads
    ``RANK`` too, both in the constructor only; a trainer's or vLLM's own ``RANK`` must survive the epoch.
    """
    saved = {name: os.environ.get(name) for name in ("RANK", "WORLD_SIZE")}
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(rank), str(world_size)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
