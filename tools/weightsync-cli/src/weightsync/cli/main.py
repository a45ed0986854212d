"""Entry point of the ``weightsync`` command."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import importlib.util
import json
import math
import platform
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

from weightsync.api.errors import UnknownBackendError
from weightsync.api.registry import backend_statuses, get_backend_spec

__all__ = ["build_parser", "main", "versions"]

# `bench --hosts` defaults (the model's, 256 MiB, is the bench's: weightsync.cli.bench.scenario). Here rather than
# imported from the bench: importing it imports torch, which `weightsync doctor` and `--help` should not wait for.
HOSTS_DEFAULT = 4
HOSTS_LINK_GBPS = 2.0
HOSTS_BUCKET_MB = 8


def versions() -> list[tuple[str, str]]:
    """(name, version) of every weightsync distribution installed here, then of torch, Ray and Python."""
    ours = {(dist.metadata["Name"] or ""): dist.version for dist in metadata.distributions()}
    found = [(name, ours[name]) for name in sorted(ours) if name.startswith("weightsync")]
    for name in ("torch", "ray"):
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            found.append((name, "not installed"))
    return [*found, ("python", platform.python_version())]


class _Versions(argparse.Action):
    """``--version``: every version :func:`versions` lists, one per line, then exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(_version_lines())
        parser.exit()


def _version_lines() -> str:
    found = versions()
    width = max(len(name) for name, _ in found)
    return "\n".join(f"{name:<{width}}  {version}" for name, version in found)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description="Move a trainer's weights into rollout replicas.")
    parser.add_argument("--version", action=_Versions,
                        help="print the versions of weightsync's distributions, torch, Ray and Python, and exit")
    commands = parser.add_subparsers(dest="command", required=True)

    _add_demo(commands)
    _add_bench(commands)

    doctor = commands.add_parser("doctor", help="list every known backend and whether it can run here")
    doctor.add_argument("--json", action="store_true", help="print a JSON list instead of a table")

    migrate = commands.add_parser("migrate", help="rewrite trainer= / trainer_world_size= call sites to actor_wg")
    try:
        from weightsync.migrate import add_arguments

        add_arguments(migrate)
    except ImportError:
        migrate.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _add_demo(commands: Any) -> None:
    demo = commands.add_parser("demo", help="train a small LM on a local Ray cluster and sync it into replicas")
    demo.add_argument("--backend", default="shm", help="backend name (see `weightsync doctor`); default shm")
    demo.add_argument("--steps", type=int, default=3, help="training steps, one update each (default 3)")
    demo.add_argument("--replicas", type=int, default=2, help="rollout replicas (default 2)")
    demo.add_argument("--model-mb", type=float, default=64.0, help="model size in MB, fp32 (default 64)")
    demo.add_argument("--bucket-mb", type=int, default=32, help="bucket size in MiB (default 32)")
    demo.add_argument("--address", default=None, help="an existing Ray cluster's address (default: start one here)")
    demo.add_argument("--delta", action="store_true",
                      help="delta updates (SyncConfig.delta) of bf16 rollout weights trained at an RL learning rate "
                           "(1e-6): after the first update, only the bytes that changed cross")
    demo.add_argument("--staged", action="store_true",
                      help="staged updates (SyncConfig.staged): replicas serve while each host stages the update, "
                           "and pause only to swap it in")
    demo.add_argument("--tp", type=int, default=1, metavar="N",
                      help="workers per replica, each holding its tensor-parallel part of every layer and reading "
                           "and verifying only that part of each update (default 1: each replica holds the whole "
                           "model); the logits are checked from the workers' parts put together")
    demo.add_argument("--rollout", choices=["model", "vllm"], default="model",
                      help="what the replicas are: a small PyTorch model of ours (default), or real vLLM engines "
                           "(needs vLLM: python3 -m hatch run vllm:demo), each step checked against a vLLM engine "
                           "that loads that version from a checkpoint")


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser("bench", help="throughput of each backend between processes on this machine, or across "
                                                    "an emulated testbed of hosts (--hosts)")
    bench.add_argument("--backends", default="", help="comma-separated backends (default: all available)")
    bench.add_argument("--model-mb", type=float, default=None,
                       help="model size in MiB (default 1024, 256 with --hosts or --mix rl; with --mix small, 10,000 "
                            "tensors of 4 KiB)")
    bench.add_argument("--receivers", type=int, default=2,
                       help="receiving processes (default 2); with --hosts, on each receiving host")
    bench.add_argument("--bucket-mb", type=int, default=None, help="bucket size in MiB (default 64; 8 with --hosts)")
    bench.add_argument("--mix", choices=["realistic", "small", "rl"], default="realistic",
                       help="the model: large bf16 tensors (realistic), many 4 KiB ones (small), or a bf16 Llama-style "
                            "decoder whose versions are one Adam step apart (rl; computed once before timing)")
    bench.add_argument("--lr", type=float, default=None,
                       help="with --mix rl: the Adam step's learning rate (default 1e-6; 1e-3 is the dense control)")
    bench.add_argument("--delta", action="store_true",
                       help="also measure every backend B with delta updates, as the entry B+delta")
    bench.add_argument("--staged", action="store_true",
                       help="also measure every entry B with staged updates (SyncConfig.staged) as B+staged; every "
                            "receiver of every entry then serves (an 8 MiB MLP every 20 ms) and pause figures are "
                            "reported")
    bench.add_argument("--parts", choices=["tp2", "layers2"], default=None,
                       help="also measure every entry B with the receivers in replicas of two workers, each holding "
                            "its part (tp2: half of every matrix; layers2: half the layers) and reading only it, as "
                            "B+tp2 (B+layers2; B+delta gets B+tp2+delta). With --hosts and an even number of "
                            "receiving hosts a replica's two workers sit on two hosts (--actor-ranks defaults to 2: "
                            "one sender per part group); else two neighbours on one host, --receivers even")
    bench.add_argument("--verify-every", type=int, default=1, metavar="K",
                       help="with --delta: receivers verify what they hold after every K-th delta update (default 1)")
    bench.add_argument("--repeat", type=int, default=5, help="timed runs per backend after a warm-up")
    bench.add_argument("--json", dest="json_path", default=None, help="also write the results as JSON")
    bench.add_argument("--plot", dest="plot_path", default=None,
                       help="also sweep bucket size and R and plot GB/s per backend to this PNG (needs matplotlib)")
    bench.add_argument("--trace", dest="trace_path", default=None,
                       help="Chrome trace JSON of one update of the first backend (with --delta: of its delta entry; open "
                            "in Perfetto)")
    bench.add_argument("--no-ray", dest="ray", action="store_false",
                       help="skip the Ray end-to-end figure (a 1 MiB update against a no-op gathered from every worker)")
    bench.add_argument("--ray-backend", default=None,
                       help="backend of the Ray end-to-end figure (default: shm where it can run)")
    bench.add_argument("--hosts", type=int, nargs="?", const=HOSTS_DEFAULT, default=0, metavar="H",
                       help=f"run across an emulated testbed of H hosts (default {HOSTS_DEFAULT}; needs root and "
                            "iproute2): sender on host 0, --receivers on each other host, every link shaped; no Ray "
                            "figure, backends that cannot cross hosts skipped")
    bench.add_argument("--link-gbps", type=float, default=None,
                       help=f"with --hosts: each host's link rate in Gb/s, both ways (default {HOSTS_LINK_GBPS:g})")
    bench.add_argument("--rails", type=int, default=1, metavar="K",
                       help="with --hosts: K links per host (rails, each its own network at --link-gbps; default 1)")
    bench.add_argument("--actor-ranks", type=int, default=0, metavar="A",
                       help="with --hosts: actor ranks on the sender's host, local ranks 0..A-1, each on rail "
                            "(rank mod --rails), each draining the whole stream (default: --rails); with --sharded: "
                            "the FSDP2 group's ranks (2 or more)")
    bench.add_argument("--sharded", action="store_true",
                       help="--actor-ranks A >= 2, shm or auto (default shm): the actor ranks hold the model "
                            "under FSDP2 over gloo; every backend B is measured as B+sharded (each rank sends its "
                            "shards) against B+gathered (every parameter all-gathered, rank 0 sends); with --hosts "
                            "(auto only, the default there; --receivers >= A) B+sharded against B, the whole model "
                            "striped over the same ranks")
    bench.add_argument("--rtt-ms", type=float, default=0.0,
                       help="with --hosts: round-trip delay between hosts in ms (default 0; needs sch_netem)")
    bench.add_argument("--cleanup", action="store_true",
                       help="only remove what killed --hosts runs left behind (namespaces, folders), then exit")
    bench.add_argument("--soak", type=int, default=0, metavar="N",
                       help="only a soak on a 4-host testbed (needs root): N delta updates, a replica killed (between "
                            "or mid-update) or added every 2-4 of them, every update checked; exit 1 if any failed")
    bench.add_argument("--seed", type=int, default=0, help="with --soak: the seed of its events (default 0)")
    bench.add_argument("--rollout", choices=["model", "vllm"], default="model",
                       help="vllm: weightsync (shm) against the disk route (safetensors + vLLM's reload_weights) "
                            "into --receivers real vLLM engines on this host (needs vLLM: python3 -m hatch run "
                            "vllm:bench); --model-mb defaults to 256, --bucket-mb to 16")
    bench.add_argument("--hidden", type=int, default=None, metavar="N",
                       help="with --rollout vllm: the Llama's hidden size, a multiple of 256 (default 1024; 4096 "
                            "has a 7B model's matrices)")
    bench.add_argument("--disk-dir", default=None,
                       help="with --rollout vllm: where the disk route writes (default /var/tmp; not a tmpfs)")
    bench.add_argument("--tp", type=int, default=1, metavar="N",
                       help="with --rollout vllm: every engine's tensor_parallel_size; above 1 the routes are by part "
                            "(each worker reads and hashes only its part) and whole (each worker the whole model), "
                            "into half the --receivers replicas each (an even number), instead of shm and disk")


def _doctor(as_json: bool) -> int:
    statuses = backend_statuses()
    if as_json:
        print(json.dumps([dataclasses.asdict(status) for status in statuses], indent=2))
        return 0
    print(_version_lines())
    print()
    width = max(len(status.backend) for status in statuses)
    for status in statuses:
        detail = status.reason if status.status == "unusable here" else ""
        if status.status == "not installed":
            detail = status.install
        print(f"{status.backend:<{width}}  {status.status:<14}  {detail}")
    from weightsync.core.control.auto import describe_rule, describe_shm  # imports torch: after the backends
    from weightsync.core.delta.encoding import ENCODER
    from weightsync.core.native import HELPER_MISSING, HELPER_PATH, STREAM_COPY

    print(f"backend='auto' (the default): {describe_rule()}")
    print(f"shared memory: {describe_shm()}")
    print(f"host copies of large tensors: {STREAM_COPY}")
    missing = (f"none ({HELPER_MISSING}): delta updates send every bucket dense and host copies use memmove; install "
               "a C compiler (cc, gcc or clang, or set CC) and it is built at the next start")
    print(f"compiled helper (_stream_copy.c): {HELPER_PATH or missing}")
    print(f"delta updates (SyncConfig.delta): {ENCODER}")
    return 0


def _usage_error(command: str, message: str) -> int:
    print(f"weightsync {command}: {message}", file=sys.stderr)
    return 2


def _testbed_missing(option: str) -> str:
    """'' where the emulated testbed is installed, else what ``option`` needs: it is an extra of the CLI
    (``weightsync-cli[testbed]``, the distribution weightsync-testbed), imported only by what runs on it."""
    if importlib.util.find_spec("weightsync.testbed") is not None:
        return ""
    return f"{option} needs the emulated testbed: pip install 'weightsync-cli[testbed]'"


def _run_vllm(command: str, options: object) -> int:
    """``weightsync.cli.vllm.<command>.run_vllm_<command>(options)``, or why it cannot run here. Imported by name:
    those modules import vLLM (mypy checks them in the vllm env, mypy-vllm.ini)."""
    from weightsync.cli.vllm import require_vllm

    missing = require_vllm()
    if missing:
        return _usage_error(command, missing)
    code: int = asyncio.run(getattr(importlib.import_module(f"weightsync.cli.vllm.{command}"), f"run_vllm_{command}")(
        options))
    return code


def _vllm_bench(args: argparse.Namespace) -> int:
    if args.hosts or args.delta or args.mix != "realistic" or args.lr is not None or args.backends \
            or args.plot_path or args.trace_path or args.ray_backend or args.verify_every != 1 or args.parts:
        return _usage_error("bench", "--rollout vllm runs on this host, full updates of its own Llama over shm "
                            "against the disk route (or, with --tp, by part against whole); it takes --model-mb, "
                            "--hidden, --receivers, --bucket-mb, --repeat, --json, --disk-dir and --tp only")
    error = _bench_error(args)  # what is left to check: the sizes, and --link-gbps/--rtt-ms without --hosts
    if error:
        return _usage_error("bench", error)
    if args.tp > 1 and args.receivers % 2:
        return _usage_error("bench", "--tp splits the replicas into two halves (by part, whole): an even --receivers")
    if args.hidden is not None and (args.hidden < 256 or args.hidden % 256):
        return _usage_error("bench", "--hidden must be a positive multiple of 256 (heads of 64, a KV head for 4)")
    from weightsync.cli.vllm import VllmBenchOptions

    return _run_vllm("bench", VllmBenchOptions(
        model_mb=args.model_mb or 256.0, replicas=args.receivers, repeat=args.repeat, bucket_mb=args.bucket_mb or 16,
        json_path=args.json_path, tp=args.tp, hidden=args.hidden or 1024,
        **({"disk_dir": args.disk_dir} if args.disk_dir else {})))


def _bench(args: argparse.Namespace) -> int:
    if args.cleanup:
        missing = _testbed_missing("--cleanup")
        if missing:
            return _usage_error("bench", missing)
        from weightsync.cli.bench.hosts import run_cleanup

        return run_cleanup()
    if args.soak:
        missing = _testbed_missing("--soak") or ("" if args.soak >= 3 else "--soak runs at least 3 updates")
        if missing:
            return _usage_error("bench", missing)
        from weightsync.cli.bench.soak import run_soak

        return run_soak(args.soak, args.seed, args.json_path)
    if args.sharded:
        error = _sharded_error(args)
        if error:
            return _usage_error("bench", error)
    if args.rollout == "vllm":
        return _vllm_bench(args)
    if args.disk_dir is not None or args.tp != 1 or args.hidden is not None:
        return _usage_error("bench", "--disk-dir, --hidden and --tp need --rollout vllm (the model bench's parts are "
                            "--parts)")
    error = _bench_error(args)
    if error:
        return _usage_error("bench", error)
    from weightsync.cli.bench import BenchOptions, run_bench  # imports torch: only once the options are good

    default_bucket_mb = HOSTS_BUCKET_MB if args.hosts else 64
    return run_bench(BenchOptions(
        backends=tuple(name for name in args.backends.split(",") if name) or _sharded_backends(args),
        model_mb=args.model_mb,
        receivers=args.receivers, bucket_mb=args.bucket_mb or default_bucket_mb, mix=args.mix, repeat=args.repeat,
        json_path=args.json_path, plot_path=args.plot_path, trace_path=args.trace_path,
        ray=args.ray and not args.hosts, ray_backend=args.ray_backend, hosts=args.hosts,
        link_gbps=args.link_gbps if args.link_gbps is not None else HOSTS_LINK_GBPS, rtt_ms=args.rtt_ms,
        rails=args.rails, actor_ranks=args.actor_ranks or (2 if args.parts and args.hosts else 0),
        delta=args.delta, verify_every=args.verify_every, staged=args.staged, parts=args.parts or "",
        sharded=args.sharded,
        **({"lr": args.lr} if args.lr is not None else {}),
    ))


def _sharded_backends(args: argparse.Namespace) -> tuple[str, ...]:
    """``--sharded``'s backend when none is named: shm on one host, auto across hosts; no default otherwise."""
    if not args.sharded:
        return ()
    return ("auto",) if args.hosts else ("shm",)


def _unknown_backend(names: Sequence[str], *, allowed: Sequence[str] = ()) -> str:
    """Why one of ``names`` is not a backend (from the installed distributions' entry points, before torch or Ray
    is imported), or ''. ``auto`` and ``allowed`` are accepted."""
    for name in names:
        if name == "auto" or name in allowed:
            continue
        try:
            get_backend_spec(name)
        except UnknownBackendError as exc:
            return f"{exc}; or auto"
    return ""


def _positive(*values: float | None) -> bool:
    """Whether every value given (None: not given) is a finite number above zero (nan and inf are not)."""
    return all(value is None or (math.isfinite(value) and value > 0) for value in values)


def _demo_error(args: argparse.Namespace) -> str:
    """What is wrong with ``demo``'s options, or ''."""
    if not _positive(args.steps, args.replicas, args.model_mb, args.bucket_mb, args.tp):
        return "--steps, --replicas, --model-mb, --bucket-mb and --tp must be positive"
    if args.tp > 1 and args.rollout == "vllm":
        return "--tp is the demo's own model's: vLLM's tensor parallelism is tested in vllm:test (test_vllm_workers)"
    return _unknown_backend([args.backend])


def _bench_error(args: argparse.Namespace) -> str:
    """What is wrong with ``bench``'s options, or ''."""
    if not _positive(args.receivers, args.repeat, args.model_mb, args.bucket_mb, args.tp):
        return "--receivers, --repeat, --model-mb, --bucket-mb and --tp must be positive"
    # The baselines' names are the bench's to refuse (it runs them always): weightsync.cli.bench.scenario imports torch.
    unknown = _unknown_backend([name for name in args.backends.split(",") if name], allowed=("naive", "bucketed"))
    if unknown:
        return unknown
    if args.lr is not None and (args.mix != "rl" or not 0 < args.lr <= 1):
        return "--lr needs --mix rl and must be in (0, 1]"
    if args.verify_every < 1 or (args.verify_every != 1 and not args.delta):
        return "--verify-every needs --delta and must be positive"
    if args.parts and args.mix == "small":
        return "--parts splits the matrices of the realistic or the rl mix: not --mix small (vectors only)"
    if args.parts and args.receivers % 2 and (not args.hosts or args.hosts % 2 == 0):
        return ("--parts pairs the receivers into replicas of two: an even --receivers (or, with --hosts, an even "
                "number of receiving hosts)")
    if args.mix == "rl" and args.plot_path:
        return "--plot does not apply with --mix rl (its model is the decoder's, not a size to sweep)"
    if not args.hosts:
        if args.link_gbps is not None or args.rtt_ms or args.rails != 1 or (args.actor_ranks and not args.sharded):
            return "--link-gbps, --rails, --actor-ranks and --rtt-ms need --hosts (--actor-ranks: or --sharded)"
        return ""
    missing = _testbed_missing("--hosts")
    if missing:
        return missing
    if args.hosts < 2:
        return "--hosts needs at least 2 hosts (a sender host and a receiving host)"
    if args.plot_path or args.ray_backend:
        return "--plot and --ray-backend do not apply with --hosts"
    if args.link_gbps is not None and not 0.001 <= args.link_gbps <= 400:
        return "--link-gbps must be 0.001..400"
    if not 0 <= args.rtt_ms <= 10_000:
        return "--rtt-ms must be 0..10000"
    from weightsync.testbed.links import MAX_RAILS

    if not 1 <= args.rails <= MAX_RAILS:
        return f"--rails must be 1..{MAX_RAILS}"
    if not 0 <= args.actor_ranks <= 16:
        return "--actor-ranks must be 0 (one per rail) to 16"
    return ""


MAX_SHARDED_RANKS = 16


def _sharded_error(args: argparse.Namespace) -> str:
    """What ``--sharded`` cannot be combined with, or ''."""
    if args.rollout == "vllm":
        return "--sharded measures the bench's own receivers: not with --rollout vllm"
    if not 2 <= args.actor_ranks <= MAX_SHARDED_RANKS:
        return f"--sharded needs --actor-ranks A, 2..{MAX_SHARDED_RANKS}: the ranks that hold the model's shards"
    if args.delta or args.staged:
        return "--sharded measures full updates (a sharded actor_wg sends no delta; staged ones are not measured)"
    if args.parts or args.plot_path or args.mix == "rl":
        return "--sharded takes neither --parts, --plot nor --mix rl (its model is the realistic or the small mix)"
    if args.hosts:
        return _sharded_hosts_error(args)
    if any(name not in ("shm", "auto") for name in args.backends.split(",") if name):
        return "--sharded needs --backends shm or auto (on one host, shm is the backend that sends from shards)"
    return ""


def _sharded_hosts_error(args: argparse.Namespace) -> str:
    """What ``--sharded --hosts`` cannot measure, or ''. Across hosts a sharded actor_wg sends over a chain backend's
    two-level layout only, and the bench names a backend without a layout: auto is the one that picks it."""
    if any(name != "auto" for name in args.backends.split(",") if name):
        return "--sharded with --hosts needs --backends auto (a sharded actor_wg crosses hosts over two_level chains)"
    if args.receivers < args.actor_ranks:
        # Each rank's stream needs its own leader on every host, on the rank's rail: with R >= M there is one.
        return "--sharded with --hosts needs --receivers >= --actor-ranks (a leader per sending rank on every host)"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        return _doctor(args.json)
    if args.command == "migrate":
        try:
            from weightsync.migrate import run
        except ImportError:
            print("weightsync migrate needs the weightsync-migrate package: pip install weightsync-migrate",
                  file=sys.stderr)
            return 2
        return run(args)
    if args.command == "bench":
        return _bench(args)
    from weightsync.cli.demo import DemoOptions, run_demo

    options = DemoOptions(
        backend=args.backend, steps=args.steps, replicas=args.replicas, model_mb=args.model_mb,
        bucket_mb=args.bucket_mb, address=args.address, delta=args.delta, staged=args.staged, tp=args.tp,
    )
    error = _demo_error(args)
    if error:
        return _usage_error("demo", error)
    if args.rollout == "vllm":
        return _run_vllm("demo", options)
    return asyncio.run(run_demo(options))
