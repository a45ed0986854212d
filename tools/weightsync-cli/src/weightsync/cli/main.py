"""Entry point of the ``weightsync`` command."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Sequence

from weightsync.api.registry import backend_statuses

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="weightsync", description="Move a trainer's weights into rollout replicas.")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="train a small LM on a local Ray cluster and sync it into replicas")
    demo.add_argument("--backend", default="shm", help="backend name (see `weightsync doctor`); default shm")
    demo.add_argument("--steps", type=int, default=3, help="training steps, one update each (default 3)")
    demo.add_argument("--replicas", type=int, default=2, help="rollout replicas (default 2)")
    demo.add_argument("--model-mb", type=float, default=64.0, help="model size in MB, fp32 (default 64)")
    demo.add_argument("--bucket-mb", type=int, default=32, help="bucket size in MiB (default 32)")
    demo.add_argument("--address", default=None, help="an existing Ray cluster's address (default: start one here)")

    doctor = commands.add_parser("doctor", help="list every known backend and whether it can run here")
    doctor.add_argument("--json", action="store_true", help="print a JSON list instead of a table")

    migrate = commands.add_parser("migrate", help="rewrite trainer= / trainer_world_size= call sites to actor_wg")
    try:
        from weightsync.migrate import add_arguments

        add_arguments(migrate)
    except ImportError:
        migrate.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _doctor(as_json: bool) -> int:
    statuses = backend_statuses()
    if as_json:
        print(json.dumps([dataclasses.asdict(status) for status in statuses], indent=2))
        return 0
    width = max(len(status.backend) for status in statuses)
    for status in statuses:
        detail = status.reason if status.status == "unusable here" else ""
        if status.status == "not installed":
            detail = status.install
        print(f"{status.backend:<{width}}  {status.status:<14}  {detail}")
    return 0


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
    from weightsync.cli.demo import DemoOptions, run_demo

    options = DemoOptions(
        backend=args.backend, steps=args.steps, replicas=args.replicas, model_mb=args.model_mb,
        bucket_mb=args.bucket_mb, address=args.address,
    )
    return asyncio.run(run_demo(options))
