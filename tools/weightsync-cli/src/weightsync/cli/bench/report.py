"""What ``weightsync bench`` prints and writes once everything is measured: the table, the JSON and the trace."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import Any

from weightsync.api.config import MiB
from weightsync.cli.bench.measure import BenchResult, Yardsticks, cores
from weightsync.cli.bench.ray_e2e import E2E_TARGET, RayEndToEnd
from weightsync.cli.bench.scenario import GATHERED, SHARDED, BenchOptions, Case, bench_part
from weightsync.cli.bench.serving import PERIOD
from weightsync.cli.bench.worker import Layout
from weightsync.core.native import STREAM_COPY

__all__ = ["RayOutcome", "Summary", "chrome_trace", "print_report", "write_json"]


@dataclass(frozen=True)
class RayOutcome:
    """The Ray end-to-end figure, or why there is none (``skipped``: the reason, or the failure when ``failed``)."""

    measured: RayEndToEnd | None
    skipped: str | None = None
    failed: bool = False

    def to_json(self) -> dict[str, Any]:
        return self.measured.to_json() if self.measured is not None else {"skipped": self.skipped}


@dataclass(frozen=True)
class Summary:
    """One run's measurements, and the figures derived from them that the table and the JSON share."""

    options: BenchOptions
    backends: tuple[str, ...]
    main: Case
    """The case as the options describe it: its model and R are the ones every figure is per."""
    results: dict[str, BenchResult]
    yardsticks: Yardsticks
    wall_seconds: float
    skipped: tuple[str, ...] = ()
    """With ``--hosts``: requested or available backends left out because they cannot cross hosts."""
    changed_fraction: float | None = None
    """With ``--mix rl``: the bytes of each timed update's version that differ from the previous one's, / S, averaged
    over the timed updates."""

    @property
    def link_limit_gbps(self) -> float:
        """With ``--hosts``: the sender host's links' rate in decimal GB/s (every rail of it); no full update to
        another host can beat S / this through them."""
        return self.options.rails * self.options.link_gbps / 8

    @property
    def limit_gbps(self) -> float:
        return self.yardsticks.copy_bandwidth / (1 + self.main.receivers) / 1e9

    @property
    def engine_copy_limit_gbps(self) -> float:
        return self.yardsticks.engine_copy_bandwidth / (1 + self.main.receivers) / 1e9

    @property
    def raw_gbps(self) -> float:
        return self.main.total_bytes / self.yardsticks.raw_gloo_seconds / 1e9

    @property
    def bucketed_gbps(self) -> float:
        return self.results["bucketed"].gbps_p50

    def rows(self) -> list[dict[str, Any]]:
        rows = []
        for result in self.results.values():
            row: dict[str, Any] = {
                "backend": result.backend, "gbps_p50": round(result.gbps_p50, 4),
                "gbps_p90": round(result.gbps_p90, 4),
                "ratio_bucketed": round(result.gbps_p50 / self.bucketed_gbps, 4),
                "ratio_limit": round(result.gbps_p50 / self.limit_gbps, 4),
                "ratio_engine_copy_limit": round(result.gbps_p50 / self.engine_copy_limit_gbps, 4),
                "peak_extra_rss_mb": round(result.peak_extra_rss_mb, 1),
            }
            if result.chosen:
                row["chosen"] = result.chosen
            if result.report is not None:  # an engine entry's: the manager's report of its last timed update
                row["report"] = result.report
            if result.serving is not None:
                row.update(_serving_row(result))
            if result.busy_seconds:
                row["busy_seconds_p50"] = round(statistics.median(result.busy_seconds), 5)
            row.update(self._parts_row(result))
            row.update(self._sharded_row(result))
            if self.options.hosts:
                # Per update: the median over the timed updates (every update's counts are in the scenario).
                row.update(ratio_link_limit=round(result.gbps_p50 / self.link_limit_gbps, 4),
                           sender_egress_bytes=int(statistics.median(result.sender_egress_bytes)),
                           host_ingress_bytes=[int(statistics.median(update[host] for update in
                                                                     result.host_ingress_bytes))
                                               for host in range(self.options.hosts - 1)],
                           rail_egress_bytes=[int(statistics.median(update[rail] for update in
                                                                    result.rail_egress_bytes))
                                              for rail in range(self.options.rails)],
                           rail_ingress_bytes=[[int(statistics.median(update[host][rail] for update in
                                                                      result.rail_ingress_bytes))
                                                for rail in range(self.options.rails)]
                                               for host in range(self.options.hosts - 1)])
            rows.append(row)
        return rows

    def _parts_row(self, result: BenchResult) -> dict[str, Any]:
        """``--parts``: an entry of workers holding parts against its whole-model twin (p50 against p50)."""
        parts = self.options.parts
        twin = self.results.get(result.backend.replace(f"+{parts}", "", 1)) if parts else None
        if twin is None or twin is result or not result.busy_seconds or not twin.busy_seconds:
            return {}
        return {"parts_of": twin.backend,
                "ratio_seconds_whole": round(statistics.median(result.seconds) / statistics.median(twin.seconds), 4),
                "ratio_busy_whole": round(statistics.median(result.busy_seconds)
                                          / statistics.median(twin.busy_seconds), 4),
                "receivers_rss_mb": round(result.receivers_rss_mb, 1),
                "whole_receivers_rss_mb": round(twin.receivers_rss_mb, 1),
                "replicated_bytes": replicated_bytes(self.main.layout, parts)}

    def _sharded_row(self, result: BenchResult) -> dict[str, Any]:
        """``--sharded``: the bytes each actor rank sent in the entry's last timed update, the receivers whose model
        was checked, and on ``B+sharded`` its gathered twin's update time over its own (p50 over p50)."""
        if not result.backend.endswith((SHARDED, GATHERED)) or result.report is None:
            return {}
        senders = sorted((transfer for transfer in result.report["transfers"] if transfer["role"] == "actor"),
                         key=lambda transfer: int(transfer["rank"]))
        row: dict[str, Any] = {"actor_bytes": [int(transfer["nbytes"]) for transfer in senders],
                               "receivers_checked": result.checked}
        twin = self.results.get(result.backend.removesuffix(SHARDED) + GATHERED)
        if result.backend.endswith(SHARDED) and twin is not None:
            row.update(gathered=twin.backend, ratio_gathered_sharded=round(
                statistics.median(twin.seconds) / statistics.median(result.seconds), 4))
        striped = self.results.get(result.backend.removesuffix(SHARDED)) if self.options.hosts else None
        if result.backend.endswith(SHARDED) and striped is not None:
            row.update(striped=striped.backend, ratio_sharded_striped=round(
                statistics.median(result.seconds) / statistics.median(striped.seconds), 4))
            row.update(self._rank_egress(result))
        return row

    def _rank_egress(self, result: BenchResult) -> dict[str, Any]:
        """``--sharded --hosts``: each actor rank's egress per update / S (the median update) from its rail's counters,
        where no two ranks share a rail (rank a is on rail a mod K); else nothing: the report's bytes say it."""
        ranks, rails = self.options.actor_ranks, self.options.rails
        if ranks > rails or not result.rail_egress_bytes:
            return {}
        total = self.main.total_bytes
        return {"actor_egress_fraction": [round(statistics.median(update[rank] for update in result.rail_egress_bytes)
                                                / total, 4) for rank in range(ranks)]}

    def scenario(self) -> dict[str, Any]:
        options, total, yardsticks = self.options, self.main.total_bytes, self.yardsticks
        hosts: dict[str, Any] = {}
        if options.hosts:
            hosts = {"hosts": options.hosts, "link_gbps": options.link_gbps, "rails": options.rails,
                     "actor_ranks": options.actor_ranks or options.rails,
                     "rtt_ms": options.rtt_ms,
                     "receivers_per_host": self.main.receivers // (options.hosts - 1), "skipped": list(self.skipped),
                     "link_bytes": {result.backend: {"sender_egress": result.sender_egress_bytes,
                                                     "host_ingress": result.host_ingress_bytes}
                                    for result in self.results.values()}}
        return {
            "backends": list(self.backends), "model_bytes": total, "model_mb": round(total / MiB, 3),
            "mix": options.mix, "tensors": len(self.main.layout), "receivers": self.main.receivers,
            "bucket_mb": options.bucket_mb, "repeat": options.repeat, "cores": cores(), "copiers": yardsticks.copiers,
            "copy_bandwidth_gbps": round(yardsticks.copy_bandwidth / 1e9, 3),
            "engine_copy_bandwidth_gbps": round(yardsticks.engine_copy_bandwidth / 1e9, 3),
            "bucketed_over_raw_gloo": round(self.bucketed_gbps / self.raw_gbps, 4),
            "wall_seconds": round(self.wall_seconds, 1),
            **({"lr": options.lr, "changed_fraction": round(self.changed_fraction, 6)}
               if self.changed_fraction is not None else {}),
            **({"verify_every": options.verify_every} if options.delta else {}),
            **({"staged": True, "serving_period_s": PERIOD} if options.staged else {}),
            **({"sharded": True, "actor_ranks": options.actor_ranks} if options.sharded else {}),
            "seconds": {result.backend: [round(s, 6) for s in result.seconds] for result in self.results.values()},
            **hosts,
        }


def print_report(summary: Summary, ray: RayOutcome) -> None:
    options, main, yardsticks = summary.options, summary.main, summary.yardsticks
    raw_gbps, bucketed = summary.raw_gbps, summary.bucketed_gbps
    print(f"model {main.total_bytes / MiB:g} MiB ({options.mix}, {len(main.layout)} tensors), {main.receivers} "
          f"receivers, buckets {options.bucket_mb} MiB, {options.repeat} updates after a warm-up; GB/s per receiver")
    if summary.changed_fraction is not None:
        print(f"rl: versions one Adam step apart at lr {options.lr:g}; {summary.changed_fraction:.2%} of the bytes "
              "changed per update")
    if options.hosts:
        _print_hosts(summary)
    print(f"limit {summary.limit_gbps:.2f} GB/s = BW(k={yardsticks.copiers}) {yardsticks.copy_bandwidth / 1e9:.2f} "
          f"GB/s / (1+R); raw gloo broadcast {raw_gbps:.2f} GB/s; bucketed = {bucketed / raw_gbps:.2f} x raw "
          f"({'meets' if bucketed >= 0.8 * raw_gbps else 'BELOW'} the 0.8 x raw bar)")
    print(f"(the engines copy large tensors with {STREAM_COPY} in 256 KiB pieces: BW(k) that way "
          f"{yardsticks.engine_copy_bandwidth / 1e9:.2f} GB/s, a limit of {summary.engine_copy_limit_gbps:.2f} GB/s "
          "per receiver; JSON: ratio_engine_copy_limit)")
    print(f"{'backend':<12} {'p50':>7} {'p90':>7} {'x bucketed':>11} {'x limit':>8} {'peak extra RSS MiB':>19}")
    for row in summary.rows():
        if "chosen" in row:
            print(f"({row['backend']} picked {row['chosen']} here)")
        print(f"{row['backend']:<12} {row['gbps_p50']:>7.2f} {row['gbps_p90']:>7.2f} {row['ratio_bucketed']:>11.2f} "
              f"{row['ratio_limit']:>8.2f} {row['peak_extra_rss_mb']:>19.1f}")
    if options.hosts:
        _print_links(summary)
    if options.staged:
        _print_serving(summary)
    if options.parts:
        _print_parts(summary)
    if options.sharded:
        _print_sharded(summary)
    e2e = ray.measured
    if e2e is not None:
        stages = " + ".join(f"{step} {ms:.1f}" for step, ms in e2e.to_json()["stages_ms_p50"].items())
        print(f"ray end-to-end ({e2e.backend}): {e2e.model_bytes / MiB:g} MiB update "
              f"{e2e.update_p50 * 1e3:.2f} ms p50 = {e2e.ratio:.2f} x a no-op call gathered from "
              f"{e2e.workers} workers ({e2e.noop_p50 * 1e3:.2f} ms p50); {stages} ms "
              f"({'meets' if e2e.meets else 'MISSES'} the <= {E2E_TARGET:g} x bar)")
    else:
        print(f"ray end-to-end: {'FAILED' if ray.failed else 'skipped'} ({ray.skipped})")
    print(f"wall time {summary.wall_seconds:.0f} s")


def _print_hosts(summary: Summary) -> None:
    options = summary.options
    rtt = f", RTT {options.rtt_ms:g} ms" if options.rtt_ms else ""
    actors = options.actor_ranks or options.rails
    print(f"testbed: {options.hosts} hosts, {f'{actors} actor ranks' if actors > 1 else 'sender'} on host 0, "
          f"{summary.main.receivers // (options.hosts - 1)} "
          f"receivers on each of hosts 1..{options.hosts - 1}; "
          f"{f'{options.rails} rails' if options.rails > 1 else 'links'} of {options.link_gbps:g} Gb/s each way{rtt}: "
          f"link limit {summary.link_limit_gbps:.3f} GB/s"
          + (f"; skipped (cannot cross hosts): {', '.join(summary.skipped)}" if summary.skipped else ""))


def _print_links(summary: Summary) -> None:
    """Per backend: GB/s against the link, and the bytes each link carried per update (median), as multiples of S."""
    total = summary.main.total_bytes
    rails = summary.options.rails > 1
    print(f"{'backend':<12} {'x link':>7} {'host 0 out / S':>15} {'hosts 1.. in / S':>17}"
          + ("  host 0 out per rail / S" if rails else ""))
    for row in summary.rows():
        ingress = " ".join(f"{value / total:.3f}" for value in row["host_ingress_bytes"])
        per_rail = " ".join(f"{value / total:.3f}" for value in row["rail_egress_bytes"])
        print(f"{row['backend']:<12} {row['ratio_link_limit']:>7.2f} {row['sender_egress_bytes'] / total:>15.3f} "
              f"{ingress:>17}" + (f"  {per_rail}" if rails else ""))


PARTS_SECONDS_BAR = 0.8
PARTS_BUSY_BAR = 0.6
PARTS_HOSTS_BARS = (1.1, 0.55, 1.05)
"""Across hosts (the link bounds both entries): the update's time against the whole-model entry's, each receiving
host's ingress and the sender host's egress as multiples of the model, plus what both workers hold (``R``, the
replicated bytes: the norms of ``tp2``; none of ``layers2``), which each host takes in and the sender sends each."""


def replicated_bytes(layout: Layout, parts: str) -> int:
    """The bytes both workers of a replica of two hold (``bench_part``: tensors each holds whole)."""
    held = [bench_part(layout, parts, rank) for rank in (0, 1)]
    return sum(math.prod(shape) * 2 for name, shape in layout  # bf16
               if all(part.regions(name) is None for part in held))


def _print_parts(summary: Summary) -> None:
    """``--parts``: each entry of workers holding parts against its whole-model twin, update time and receivers'
    busy seconds (p50s), against the bars of one host, or across hosts those of the link counters; and the
    receivers' peak extra RSS, the entry's and its twin's (``rss MiB``: with ``--delta``, the copies they keep)."""
    print(f"parts ({summary.options.parts}: replicas of two workers, each reading, copying and hashing only its part; "
          "p50 against the whole-model entry's)")
    print(f"{'entry':<22} {'x time':>7} {'x busy':>7} {'busy ms':>8} {'rss MiB':>15}")
    total, (time_bar, in_bar, out_bar) = summary.main.total_bytes, PARTS_HOSTS_BARS
    for row in summary.rows():
        if "parts_of" not in row:
            continue
        if summary.options.hosts:
            replicated = row["replicated_bytes"]
            meets = row["ratio_seconds_whole"] <= time_bar and \
                max(row["host_ingress_bytes"]) <= in_bar * total + replicated / 2 and \
                row["sender_egress_bytes"] <= out_bar * total + replicated
            plus = (" + R/2", " + R", f"; R = {replicated / total:.3f} S") if replicated else ("", "", "")
            bars = f"time <= {time_bar:g} x, each host in <= {in_bar:g} S{plus[0]}, host 0 out <= {out_bar:g} " \
                   f"S{plus[1]}{plus[2]}"
        else:
            meets = row["ratio_seconds_whole"] <= PARTS_SECONDS_BAR and row["ratio_busy_whole"] <= PARTS_BUSY_BAR
            bars = f"time <= {PARTS_SECONDS_BAR:g} x, busy <= {PARTS_BUSY_BAR:g} x"
        print(f"{row['backend']:<22} {row['ratio_seconds_whole']:>7.2f} {row['ratio_busy_whole']:>7.2f} "
              f"{row['busy_seconds_p50'] * 1e3:>8.1f} {row['receivers_rss_mb']:>7.1f}/"
              f"{row['whole_receivers_rss_mb']:<7.1f} "
              f"({'meets' if meets else 'MISSES'} {bars})")


SHARDED_BAR = 1.5
"""``B+sharded`` should take at most 1 / this of ``B+gathered``'s time on one host, where the gather is the
bottleneck."""


SHARDED_HOSTS_BAR = 1.05
"""Across hosts ``B+sharded`` should take at most this × ``B``'s time: each rank sends its half over its own rail, as
the striped whole model does."""
EGRESS_TOLERANCE = 0.1
"""Across hosts each of M ranks on rails of their own should send (1 ± this) × S / M per update (0.45–0.55 × S for
two): its shards, and only once."""


def _print_sharded(summary: Summary) -> None:
    """``--sharded``: each entry's update time (p50), each actor rank's bytes sent / S, and gathered / sharded."""
    if summary.options.hosts:
        _print_sharded_hosts(summary)
        return
    total = summary.main.total_bytes
    print(f"sharded ({summary.options.actor_ranks} actor ranks hold the model under FSDP2 over gloo; +gathered "
          "all-gathers every parameter and rank 0 sends it; every receiver's model checked against the version sent)")
    print(f"{'entry':<18} {'p50 s':>7} {'x gathered':>11}  actor ranks' bytes sent / S")
    rows = summary.rows()
    for row in rows:
        if "actor_bytes" not in row:
            continue
        seconds = statistics.median(summary.results[row["backend"]].seconds)
        ratio = f"{row['ratio_gathered_sharded']:>11.2f}" if "ratio_gathered_sharded" in row else f"{'':>11}"
        print(f"{row['backend']:<18} {seconds:>7.3f} {ratio}  "
              + " ".join(f"{nbytes / total:.3f}" for nbytes in row["actor_bytes"]))
    for row in rows:
        if "ratio_gathered_sharded" in row:
            ratio = row["ratio_gathered_sharded"]
            print(f"{row['gathered']} / {row['backend']} = {ratio:.2f} x (update time, p50; "
                  f"{'meets' if ratio >= SHARDED_BAR else 'BELOW'} the >= {SHARDED_BAR:g} x bar)")


def _print_sharded_hosts(summary: Summary) -> None:
    """``--sharded --hosts``: ``B+sharded`` against ``B`` (the whole model striped over the same ranks): update time
    (p50), each rank's bytes sent / S (its transfer report) and its rail's egress / S (the link counters)."""
    total = summary.main.total_bytes
    print(f"sharded ({summary.options.actor_ranks} actor ranks on host 0 hold the model under FSDP2 over gloo, each "
          "sends its shards over its rail; against the whole model striped over the same ranks; every receiver's "
          "model checked against the version sent)")
    print(f"{'entry':<18} {'p50 s':>7} {'x striped':>10}  ranks' bytes sent / S  ranks' rail egress / S")
    for row in summary.rows():
        if "ratio_sharded_striped" not in row:
            continue
        seconds = statistics.median(summary.results[row["backend"]].seconds)
        sent = " ".join(f"{nbytes / total:.3f}" for nbytes in row["actor_bytes"])
        egress = row.get("actor_egress_fraction", [])
        print(f"{row['backend']:<18} {seconds:>7.3f} {row['ratio_sharded_striped']:>10.2f}  {sent:<21}  "
              + (" ".join(f"{fraction:.3f}" for fraction in egress) or "(ranks share rails)"))
        ratio, share = row["ratio_sharded_striped"], 1 / summary.options.actor_ranks
        low, high = share * (1 - EGRESS_TOLERANCE), share * (1 + EGRESS_TOLERANCE)
        within = bool(egress) and all(low <= fraction <= high for fraction in egress)
        print(f"{row['backend']} / {row['striped']} = {ratio:.2f} x (update time, p50; "
              f"{'meets' if ratio <= SHARDED_HOSTS_BAR else 'ABOVE'} the <= {SHARDED_HOSTS_BAR:g} x bar); each rank's "
              f"egress {'within' if within else 'OUTSIDE'} {low:.3g}-{high:.3g} x S")


def _serving_row(result: BenchResult) -> dict[str, Any]:
    """``--staged``: what the receivers saw while serving (measured inside them), per entry."""
    serving = result.serving
    if serving is None:
        return {}
    row: dict[str, Any] = {"pause_ms_p50": round(statistics.median(serving.pause_ms), 2),
                           "failed_requests": serving.failed_requests, "idle_rate": round(serving.idle_rate, 2),
                           "pause_ms": [round(ms, 2) for ms in serving.pause_ms]}
    if serving.apply_ms:
        row.update(apply_ms_p50=round(statistics.median(serving.apply_ms), 2),
                   served_during_stage=sum(serving.served_during_stage),
                   stage_seconds=round(sum(serving.stage_seconds), 4))
    return row


def _print_serving(summary: Summary) -> None:
    """Per entry: how long the longest-paused receiver stopped serving (p50 over the timed updates), and for a
    staged entry its apply and what its receivers served while the update was staged."""
    rows = summary.rows()
    idle = statistics.median(row["idle_rate"] for row in rows if "idle_rate" in row)
    print(f"serving (every receiver: a forward pass of an 8 MiB MLP every 20 ms unless paused; {idle:.1f}/s idle)")
    print(f"{'backend':<20} {'pause ms':>9} {'apply ms':>9} {'served in stage':>16} {'stage s':>8} {'failed':>7}")
    for row in rows:
        if "pause_ms_p50" not in row:
            continue
        staged = "apply_ms_p50" in row
        print(f"{row['backend']:<20} {row['pause_ms_p50']:>9.1f} "
              f"{row['apply_ms_p50'] if staged else float('nan'):>9.1f} "
              f"{row.get('served_during_stage', 0):>16} {row.get('stage_seconds', 0.0):>8.2f} "
              f"{row['failed_requests']:>7}")


def write_json(path: str, summary: Summary, ray: RayOutcome) -> None:
    with open(path, "w") as handle:
        data: dict[str, Any] = {"scenario": summary.scenario(), "limit_gbps": round(summary.limit_gbps, 4),
                                "engine_copy_limit_gbps": round(summary.engine_copy_limit_gbps, 4),
                                "raw_gloo_gbps": round(summary.raw_gbps, 4)}
        if summary.options.hosts:
            data["link_limit_gbps"] = round(summary.link_limit_gbps, 6)
        data.update(results=summary.rows(), ray_end_to_end=ray.to_json())
        json.dump(data, handle, indent=2)


def chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Numeric pid/tid with name metadata: Chrome's and Perfetto's JSON importers expect integers there."""
    pids: dict[str, int] = {}
    tids: dict[tuple[str, str], int] = {}
    out: list[dict[str, Any]] = []
    for event in sorted(events, key=lambda event: float(event["ts"])):
        pid_name, tid_name = str(event["pid"]), str(event["tid"])
        if pid_name not in pids:
            pids[pid_name] = len(pids) + 1
            out.append({"name": "process_name", "ph": "M", "pid": pids[pid_name], "args": {"name": pid_name}})
        if (pid_name, tid_name) not in tids:
            tids[pid_name, tid_name] = len(tids) + 1
            out.append({"name": "thread_name", "ph": "M", "pid": pids[pid_name], "tid": tids[pid_name, tid_name],
                        "args": {"name": tid_name}})
        out.append({**event, "pid": pids[pid_name], "tid": tids[pid_name, tid_name]})
    return {"traceEvents": out, "displayTimeUnit": "ms"}
