"""What each update tells an operator, from the manager's process.

- **A log record per update** (logger ``weightsync.core.control.telemetry``): INFO when every replica committed,
  WARNING otherwise, with the version, the backend that ran, the bytes (the model's and what crossed per receiver),
  the seconds, the longest pause and the replicas by state; each step of it at DEBUG
  (:func:`weightsync.core.control.steps.gather`).
- **Prometheus metrics**, when ``prometheus_client`` is installed (``pip install 'weightsync-core[prometheus]'``),
  in its default registry, named like vLLM's weight-update metrics: the process exposes them as it exposes any
  other (``prometheus_client.start_http_server``).

  ==========================================================  =========  ==================================
  ``weightsync:weight_update_duration_seconds{operation}``    histogram  each step (setup, pause, transfer,
                                                                         finalize, resume...) and ``total``
  ``weightsync:weight_update_operations_in_flight``           gauge      updates under way
  ``weightsync:weight_updates_total{outcome}``                counter    ``committed`` or ``failed``
  ``weightsync:weight_update_bytes_total{kind}``              counter    ``model`` (what receivers hold) and
                                                                         ``wire`` (what crossed), per receiver
  ``weightsync:replicas{state}``                              gauge      committed, torn, untouched after the
                                                                         last update
  ==========================================================  =========  ==================================
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any, NamedTuple, get_args

from weightsync.api.types import ReplicaState, UpdateReport

__all__ = ["in_flight", "record", "summary"]

logger = logging.getLogger(__name__)

_STATES: tuple[ReplicaState, ...] = get_args(ReplicaState)


def summary(report: UpdateReport) -> str:
    """One line: the update's version, backend, sizes, seconds, longest pause and replicas by state."""
    states = [outcome.state for outcome in (*report.replicas, *report.evicted)]
    counted = ", ".join(f"{states.count(state)} {state}" for state in _STATES if state in states)
    chosen = f" ({report.chosen})" if report.chosen else ""
    return (f"update {report.version}: backend {report.backend}{chosen}, {report.nbytes} bytes "
            f"({report.wire_bytes} on the wire) per receiver to {report.receivers}, {report.seconds:.3f} s "
            f"(transfer {report.transfer_seconds:.3f} s), longest pause {report.pause_seconds:.3f} s; "
            f"replicas: {counted or 'none'}")


def record(report: UpdateReport, *, failure: BaseException | None = None) -> None:
    """The update's log record and metrics (``failure``: what it raised, if it did)."""
    failed = failure is not None or not report.ok
    if not failed:
        logger.info("%s", summary(report))
    else:
        cause = f": {type(failure).__name__}: {failure}" if failure is not None else ""
        logger.warning("%s; failed%s", summary(report), cause)
    metrics = _prometheus()
    if metrics is None:
        return
    for step, seconds in report.stages.items():
        metrics.durations.labels(operation=step).observe(seconds)
    metrics.durations.labels(operation="total").observe(report.seconds)
    metrics.updates.labels(outcome="failed" if failed else "committed").inc()
    metrics.sent.labels(kind="model").inc(report.nbytes)
    metrics.sent.labels(kind="wire").inc(report.wire_bytes)
    states = [outcome.state for outcome in (*report.replicas, *report.evicted)]
    for state in _STATES:
        metrics.replicas.labels(state=state).set(states.count(state))


@contextlib.contextmanager
def in_flight() -> Iterator[None]:
    """Counts an update under way (the in-flight gauge) while the block runs."""
    metrics = _prometheus()
    if metrics is None:
        yield
        return
    metrics.in_flight.inc()
    try:
        yield
    finally:
        metrics.in_flight.dec()


class _Metrics(NamedTuple):
    durations: Any
    in_flight: Any
    updates: Any
    sent: Any
    replicas: Any


@functools.cache
def _prometheus() -> _Metrics | None:
    """The metrics, registered once per process; None without ``prometheus_client``."""
    try:
        import prometheus_client as prometheus
    except ImportError:
        return None
    return _Metrics(
        prometheus.Histogram("weightsync:weight_update_duration_seconds",
                             "Seconds of each step of a weight update (setup, pause, transfer, finalize, resume, "
                             "...) and of the whole update (total)", ["operation"],
                             buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)),
        prometheus.Gauge("weightsync:weight_update_operations_in_flight", "Weight updates under way"),
        prometheus.Counter("weightsync:weight_updates", "Weight updates by outcome (committed or failed)",
                           ["outcome"]),
        prometheus.Counter("weightsync:weight_update_bytes", "Bytes per receiver of weight updates: the model "
                           "(what receivers hold) and the wire (what crossed)", ["kind"]),
        prometheus.Gauge("weightsync:replicas", "Replicas by state after the last weight update", ["state"]),
    )
