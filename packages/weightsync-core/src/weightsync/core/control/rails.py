"""Rails a striped update lost (:mod:`weightsync.core.transports.chain.stripes`), left out until a probe shows them back.

A striped update whose stripe failed on its rail raises a ``TransferError`` naming the ``rail``, as does a part
group's stream over a rail of its own (:mod:`weightsync.core.transports.chain.groups`). The manager records
it here; before every update after that (and at every rebuild, before ``auto`` deals stripes), each rollout worker
on that rail probes it (a ``ping`` with ``probe``: a TCP connection to the sender host's address on that rail,
refused or accepted, within a second: :func:`weightsync.core.transports.place.reaches`), the replicas serving; the
rail comes back — and the topology is rebuilt with stripes over it — only when every probe reached it. Until then
``auto`` deals the stripes over the other rails only (rail 0 carries the control plane: losing it is losing the
host).
"""

from __future__ import annotations

from collections.abc import Sequence

from weightsync.api.errors import TransferError
from weightsync.api.protocols import RolloutWorker
from weightsync.core.control import steps
from weightsync.core.control.steps import worker_label
from weightsync.core.transports.place import PingAnswer
from weightsync.core.transports.plan import decode_metadata

__all__ = ["LostRails", "RAIL_GRACE_S", "rail_grace"]

RAIL_GRACE_S = 1.0
"""How long past the transfer timeout an update of several senders waits for its workers' own errors."""


def rail_grace(senders: Sequence[int]) -> float:
    """Seconds added to a transfer step's timeout: an update of several senders (``senders``: a striped update's, a
    part group's each, a sharded ``actor_wg``'s) may cross several rails, and its workers report a lost rail at their
    own deadline; a second more lets their errors, which name the rail and its hosts, arrive instead of the step's
    timeout."""
    return RAIL_GRACE_S if len(senders) > 1 else 0.0


class LostRails:
    """The rails left out of stripes: recorded from a failed update, probed at each rebuild."""

    def __init__(self) -> None:
        self.rails: set[int] = set()

    def record(self, error: BaseException) -> None:
        """Note the rail ``error`` names (a stripe's ``TransferError``), if any."""
        if isinstance(error, TransferError) and error.rail is not None and error.rail > 0:
            self.rails.add(error.rail)

    async def recheck(self, workers: Sequence[tuple[int, RolloutWorker]], pings: steps.Labelled, actor_size: int,
                      timeout: float) -> bool:
        """Ping every worker (``pings``, actor ranks first) and probe the lost rails; whether one came back."""
        lost = set(self.rails)
        answers = await steps.gather("setup", timeout, pings, raise_first=False)
        places = [decode_metadata(answer, PingAnswer, who=label) if isinstance(answer, dict) else None
                  for (label, _), answer in zip(pings, answers)]
        await self.probe(workers, places, actor_size, timeout)
        return self.rails != lost

    async def probe(self, workers: Sequence[tuple[int, RolloutWorker]], answers: Sequence[PingAnswer | None],
                    actor_size: int, timeout: float) -> None:
        """Probe every lost rail from the rollout workers on it (``answers``: every worker's ping, actor ranks
        first; None where a worker did not answer); a rail every probe reached is no longer lost."""
        sender = answers[0]
        if sender is None:
            return
        for rail in sorted(self.rails):
            targets = [answer.rail_address for answer in answers[:actor_size]
                       if answer is not None and answer.node_id == sender.node_id and answer.rail == rail]
            probers = [(r, worker) for (r, worker), answer in zip(workers, answers[actor_size:])
                       if answer is not None and answer.rail == rail]
            if not targets or not targets[0] or not probers:
                continue
            results = await steps.gather("setup", timeout, [
                (worker_label(r, worker), worker.execute_checkpoint_engine("ping", probe=[targets[0]]))
                for r, worker in probers], raise_first=False)
            if all(isinstance(result, dict) and decode_metadata(result, PingAnswer, who="a probe").reachable.get(
                    targets[0]) is True for result in results):
                self.rails.discard(rail)
