"""An engine entry's updates: ``CheckpointEngineManager.update_weights()`` over the bench's worker pipes
(``weightsync.cli.bench.group``), on one event loop for the case. Setup, ``auto``, the staged flow, stripes and
delta are the manager's; what is timed is the manager's own transfer step (``UpdateReport.transfer_seconds``: the
send and every receive, or a staged update's stage and every swap), and what the serving probe reads comes from the
replicas' pause and resume hooks and the report's per-replica stage and swap seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any

from weightsync.api.config import StepTimeouts, SyncConfig
from weightsync.api.types import UpdateReport
from weightsync.cli.bench.group import PipeActorGroup, PipeReplica, PipeWorker, Pipes
from weightsync.core.control.manager import CheckpointEngineManager

if TYPE_CHECKING:
    from weightsync.cli.bench.measure import ServingFigures, _Workers
    from weightsync.cli.bench.scenario import Case

__all__ = ["ManagedUpdates", "report_dict"]

TIMEOUT_S = 600.0
"""Every step's timeout: a bench update on a shaped testbed link may take minutes; a hang still ends."""


class ManagedUpdates:
    """The manager of one engine entry, its replicas, and the last update's report."""

    def __init__(self, case: Case, workers: _Workers) -> None:
        self.case, self.workers = case, workers
        self.pipes = Pipes(workers.pipes, case.name)
        self.replicas = [PipeReplica([PipeWorker(self.pipes, rank, f"receiver{rank - case.actors}") for rank in group],
                                     self.pipes, group, serving=case.serving) for group in case.replicas()]
        timeouts = StepTimeouts(**{step.name: TIMEOUT_S for step in dataclasses.fields(StepTimeouts)})
        config = SyncConfig(bucket_bytes=case.bucket_bytes, delta=case.delta, verify_every=case.verify_every,
                            staged=case.staged, timeouts=timeouts)
        self.manager = CheckpointEngineManager(backend=case.backend, actor_wg=PipeActorGroup(self.pipes, case.actors),
                                               replicas=self.replicas, config=config)
        self.loop = asyncio.new_event_loop()
        self.report: UpdateReport | None = None

    @property
    def chosen(self) -> str:
        """What ``auto`` picked (its name: backend and layout), empty for a named backend."""
        choice = self.manager.choice
        return choice.name if choice is not None else ""

    def connect(self) -> None:
        """The membership epoch, before the first update (the processes' connections then exist for ``mark``)."""
        self.loop.run_until_complete(self.manager.connect())

    def update(self, serving: ServingFigures | None) -> float:
        """One update; the seconds of its transfer step. With ``serving``, what the receivers saw goes there."""
        started = time.monotonic()
        report = self.report = self.loop.run_until_complete(self.manager.update_weights())
        if serving is not None:
            self._serving(serving, report, started)
        return report.transfer_seconds

    def _serving(self, serving: ServingFigures, report: UpdateReport, started: float) -> None:
        if self.case.staged:
            stage_end = started + max(outcome.stage_seconds for outcome in report.replicas)
            counts = self.workers.each_receiver("count", start=started, end=stage_end)
            serving.served_during_stage.append(int(statistics.median(counts)))
            serving.stage_seconds.append(stage_end - started)
            serving.apply_ms.append(max(outcome.swap_seconds for outcome in report.replicas) * 1e3)
        self.workers.record_pauses(serving, [last for replica in self.replicas for last in replica.lasts[-1]],
                                   [mark for replica in self.replicas for mark in replica.marks[-1]])

    def traced(self, serving: ServingFigures | None) -> list[dict[str, Any]]:
        """One update with every engine's tracing on; its events."""
        self.workers.each("trace_on")
        self.update(serving)
        return [event for events in self.workers.each("trace_off") for event in events]

    def close(self) -> None:
        self.loop.close()
        self.pipes.close()


def report_dict(report: UpdateReport | None) -> dict[str, Any] | None:
    """The manager's report as plain data (the bench's JSON carries the last timed update's)."""
    return dataclasses.asdict(report) if report is not None else None
