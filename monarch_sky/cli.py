"""`monarch-sky` command line: train, worker."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="monarch-sky", description="Fault-tolerant TorchTitan training with Monarch + TorchFT."
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a recipe across replica groups")
    train.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help="config overrides, e.g. replicas=2 steps=60 faults=kill@20:1",
    )

    worker = sub.add_parser("worker", help="run this host's Monarch worker loop")
    worker.add_argument("--address", required=True, help="tcp://IP:PORT to listen on")

    args = parser.parse_args(argv)
    from monarch_sky import supervision

    supervision.configure_monarch_env()  # before anything imports Monarch
    if args.command == "worker":
        from monarch_sky import worker as worker_mod

        worker_mod.run(args.address)
        return 0
    return _train(args.overrides)


def _train(overrides: list[str]) -> int:
    from monarch_sky.config import EXIT_CONFIG, ConfigError, load_job

    try:
        job = load_job(overrides)
    except ConfigError as e:
        print(f"monarch-sky: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from monarch_sky.controller import run_job

    return run_job(job)
