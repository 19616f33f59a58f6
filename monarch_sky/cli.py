"""`monarch-sky` command line: train, worker, doctor, bench, report, tls-ca, tls-node, fetch-tokenizer."""

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
    worker.add_argument("--address", required=True, help="tcp://IP:PORT or tls://IP:PORT to listen on")
    worker.add_argument(
        "--until-shutdown", action="store_true", help="exit when a controller shuts this host down"
    )

    doctor = sub.add_parser("doctor", help="check this node (platform, GPUs, RCCL, RDMA) and reach the others")
    doctor.add_argument("--workers", default="", help="comma-separated IP:PORT of every node's worker")
    doctor.add_argument("--lighthouse", default=None, help="TorchFT lighthouse address to reach")
    doctor.add_argument("--expect-gpus", type=int, default=None, help="fail unless this node has this many GPUs")
    doctor.add_argument("--wait", type=float, default=0.0, help="seconds to keep retrying unreachable nodes")

    bench = sub.add_parser("bench", help="goodput benchmark: monarch-sky against checkpoint-restart and TorchFT alone")
    from monarch_sky.bench.runner import add_arguments

    add_arguments(bench)
    report = sub.add_parser("report", help="render the table and plots of a past run or bench")
    report.add_argument("path", metavar="RUN_OR_BENCH_DIR", help="a run folder (summary.json) or bench folder (bench.json, bench-heal.json)")

    sub.add_parser("tls-ca", help="make a run CA: prints shell exports of MONARCH_SKY_TLS_CA and _KEY")
    node = sub.add_parser("tls-node", help="issue this node's certificate from the run CA in the environment")
    node.add_argument("--out", required=True, help="folder for ca.pem, cert.pem, key.pem (mode 0600)")
    node.add_argument("hosts", nargs="+", metavar="IP_OR_NAME", help="every address this node is dialled by")

    fetch = sub.add_parser("fetch-tokenizer", help="download a hub model's tokenizer (HF_TOKEN) for data.tokenizer_repo")
    fetch.add_argument("repo", nargs="?", help="hub repository, e.g. meta-llama/Llama-3.1-8B")
    fetch.add_argument("--recipe", help="fetch what this recipe's data.tokenizer_repo names (none: nothing to do)")

    args = parser.parse_args(argv)
    if args.command == "fetch-tokenizer":
        return _fetch_tokenizer(args)
    if args.command in ("bench", "report"):
        return _bench_or_report(args)
    if args.command in ("tls-ca", "tls-node"):
        return _tls(args)
    from monarch_sky import supervision

    supervision.configure_monarch_env()  # before anything imports Monarch
    if args.command == "doctor":
        from monarch_sky import doctor as doctor_mod

        workers = [w for w in args.workers.split(",") if w.strip()]
        return doctor_mod.run(workers, args.lighthouse, args.expect_gpus, args.wait)
    if args.command == "worker":
        from monarch_sky import worker as worker_mod

        worker_mod.run(args.address, args.until_shutdown)
        return 0
    return _train(args.overrides)


def _bench_or_report(args) -> int:
    from pathlib import Path

    from monarch_sky.bench import report

    path = Path(args.path) if args.command == "report" else None
    if path is None:
        from monarch_sky.bench.runner import run_bench, settings_from

        path = run_bench(settings_from(args), Path(args.out))
    try:
        text, plots = report.render(path)
    except ValueError as e:
        print(f"monarch-sky: {e}", file=sys.stderr)
        return 2
    print(text)
    print("\n".join(f"plot: {p}" for p in plots))
    return 0


def _tls(args) -> int:
    """Print `export NAME=VALUE` lines for a shell to eval (sky/bootstrap.sh does)."""
    import shlex

    from monarch_sky import tls

    if args.command == "tls-ca":
        cert, key = tls.new_ca()
        env = {tls.CA_ENV: tls.as_secret(cert), tls.CA_KEY_ENV: tls.as_secret(key)}
    else:
        try:
            env = tls.node_env(args.out, args.hosts)
        except ValueError as e:
            print(f"monarch-sky: {e}", file=sys.stderr)
            return 2
    print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items()))
    return 0


def _fetch_tokenizer(args) -> int:
    from monarch_sky import hub_assets
    from monarch_sky.recipes import RECIPES

    repo = args.repo
    if repo is None and args.recipe is not None:
        if args.recipe not in RECIPES:
            print(f"monarch-sky: --recipe: unknown recipe '{args.recipe}'; one of {', '.join(RECIPES)}", file=sys.stderr)
            return 2
        repo = RECIPES[args.recipe].job_defaults.get("data", {}).get("tokenizer_repo")
        if repo is None:
            print(f"monarch-sky: {args.recipe} trains on its shipped tokenizer: nothing to fetch")
            return 0
    if repo is None:
        print("monarch-sky: fetch-tokenizer: name a hub repository or --recipe", file=sys.stderr)
        return 2
    try:
        path = hub_assets.fetch_tokenizer(repo)
    except hub_assets.HubAccessError as e:
        print(f"monarch-sky: {e}", file=sys.stderr)
        return 2
    print(f"monarch-sky: {repo}'s tokenizer is in {path}")
    return 0


def _train(overrides: list[str]) -> int:
    from monarch_sky.config import EXIT_CONFIG, ConfigError, load_job

    try:
        job = load_job(overrides)
    except ConfigError as e:
        print(f"monarch-sky: config error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    from monarch_sky.run import run_job

    return run_job(job)
