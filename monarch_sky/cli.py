"""`monarch-sky` command line: train, config, worker, doctor, bench, report, tls-ca, tls-node, fetch-tokenizer, fetch-weights.

Every subcommand imports what it runs only once chosen: `--help` and `tls-ca` load no torch."""

from __future__ import annotations

import argparse
import os
import sys

from monarch_sky import cli_fetch


EXAMPLES = """examples:
  monarch-sky train                                  the tiny CPU llama: 3 groups, one kill healed live
  monarch-sky train replicas=2 steps=60 faults=kill@20:1
  monarch-sky train --config job.yaml steps=500      a YAML file of the same keys, overrides on top
  monarch-sky config recipe=llama3_8b                the resolved settings, validated (exit 2 on errors)
  monarch-sky report runs/RUN_ID                     a past run's table and timeline
settings are KEY=VALUE everywhere (--key value is read the same); `monarch-sky train --help` lists the keys.
"""
TAKES_KEYS = ("train", "config", "fetch-weights")  # subcommands whose settings are the job config's keys
OWN_FLAGS = {"--config", "--log-level", "-h", "--help"}


class Parser(argparse.ArgumentParser):
    """argparse, with key help appended on demand and a hint when a flag is unknown."""

    def __init__(self, *args, more_help=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.more_help = more_help

    def format_help(self) -> str:
        extra = self.more_help() if self.more_help else ""
        return super().format_help() + (f"\n{extra}\n" if extra else "")

    def error(self, message: str):
        if "unrecognized arguments" in message:
            message += ("\ntrain, config and bench take settings as KEY=VALUE (replicas=2, training.lr=0.001); "
                        "`monarch-sky COMMAND --help` lists what a command takes")
        super().error(message)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv else None
    if command in TAKES_KEYS:
        argv = [command, *_flags_as_keys(argv[1:])]
    elif command == "bench":
        argv = [command, *_keys_as_flags(argv[1:])]
    args = _parser(command).parse_args(argv)
    if args.command == "fetch-tokenizer":
        return cli_fetch.fetch_tokenizer(args)
    if args.command == "fetch-weights":
        return cli_fetch.fetch_weights(_load(args))
    if args.command in ("bench", "report"):
        return _bench_or_report(args)
    if args.command in ("tls-ca", "tls-node"):
        return _tls(args)
    if args.command == "config":
        return _config(args)
    from monarch_sky.common import supervision

    supervision.configure_monarch_env()  # before anything imports Monarch
    if args.command == "doctor":
        from monarch_sky.hosts import doctor as doctor_mod

        workers = [w for w in args.workers.split(",") if w.strip()]
        return doctor_mod.run(workers, args.lighthouse, args.expect_gpus, args.wait)
    if args.command == "standby":
        from monarch_sky import standby

        doors = [d for d in args.watch.split(",") if d.strip()]
        return standby.watch_and_take_over(doors, args.local_worker, args.after_s, args.train, args.mark)
    if args.command == "worker":
        from monarch_sky.hosts import worker as worker_mod

        worker_mod.run(args.address, args.until_shutdown)
        return 0
    return _train(args)


def _parser(command: str | None) -> Parser:
    parser = Parser(
        prog="monarch-sky", description="Fault-tolerant TorchTitan training with Monarch + TorchFT.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train = sub.add_parser("train", help="train a recipe across replica groups", more_help=_keys_help,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    _job_arguments(train)
    train.add_argument("--log-level", choices=("debug", "info", "warning"), default=None,
                       help="the console's log level (default: $MONARCH_SKY_LOG or warning); the run folder's "
                       "controller.log keeps INFO and up (DEBUG with debug) and every traceback")
    config = sub.add_parser("config", help="print the resolved config of a train command, validated (exit 2 on errors)",
                            more_help=_keys_help, formatter_class=argparse.RawDescriptionHelpFormatter)
    _job_arguments(config)

    worker = sub.add_parser("worker", help="run this host's Monarch worker loop")
    worker.add_argument("--address", required=True, help="tcp://IP:PORT or tls://IP:PORT to listen on")
    worker.add_argument(
        "--until-shutdown", action="store_true", help="exit when a controller shuts this host down"
    )

    standby = sub.add_parser("standby", help="on another node: take the run over when its controller's node is lost "
                             "(sky/bootstrap.sh runs it)")
    standby.add_argument("--watch", required=True, help="comma-separated IP:PORT of the controller doors to watch "
                         "(hosts.controller_port on the nodes before this one)")
    standby.add_argument("--local-worker", required=True, help="this node's worker, IP:PORT: when it ends, the run did")
    standby.add_argument("--after-s", type=float, default=10.0, help="seconds of silence at every door before taking over, "
                         "times the number of doors (the nodes before this one take over first)")
    standby.add_argument("--mark", default=None, help="a file to create on taking over (the bootstrap reads it)")
    standby.add_argument("train", nargs=argparse.REMAINDER, help="the train command to run on taking over: train KEY=VALUE ...")

    doctor = sub.add_parser("doctor", help="check this node (platform, GPUs, RCCL, RDMA) and reach the others")
    doctor.add_argument("--workers", default="", help="comma-separated IP:PORT of every node's worker")
    doctor.add_argument("--lighthouse", default=None, help="TorchFT lighthouse address to reach")
    doctor.add_argument("--expect-gpus", type=int, default=None, help="fail unless this node has this many GPUs")
    doctor.add_argument("--wait", type=float, default=0.0, help="seconds to keep retrying unreachable nodes")

    bench = sub.add_parser("bench", help="goodput benchmark: monarch-sky against checkpoint-restart and TorchFT alone")
    if command == "bench":  # its settings import the benchmark: only when it runs
        from monarch_sky.bench.runner import add_arguments

        add_arguments(bench)
    report = sub.add_parser("report", help="render the table and plots of a past run or bench")
    report.add_argument("path", metavar="RUN_OR_BENCH_DIR", help="a run folder (summary.json) or bench folder (bench.json, bench-heal.json)")

    sub.add_parser("tls-ca", help="make a run CA: prints shell exports of MONARCH_SKY_TLS_CA and _KEY "
                   "(`python3 -m monarch_sky.hosts.tls` does the same with only `cryptography` installed)")
    node = sub.add_parser("tls-node", help="issue this node's certificate from the run CA in the environment")
    node.add_argument("--out", required=True, help="folder for ca.pem, cert.pem, key.pem (mode 0600)")
    node.add_argument("hosts", nargs="+", metavar="IP_OR_NAME", help="every address this node is dialled by")

    fetch = sub.add_parser("fetch-tokenizer", help="download a hub model's tokenizer (HF_TOKEN) for data.tokenizer_repo")
    fetch.add_argument("repo", nargs="?", help="hub repository, e.g. meta-llama/Llama-3.1-8B")
    fetch.add_argument("--recipe", help="fetch what this recipe's data.tokenizer_repo names (none: nothing to do)")
    weights = sub.add_parser("fetch-weights", help="download the released weights (HF_TOKEN) a job starts from (init.weights_repo)")
    _job_arguments(weights)
    return parser


def _job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. replicas=2 steps=60 faults=kill@20:1 (keys below)")
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="a YAML file of config keys (nested or dotted), under the KEY=VALUE overrides")


def _keys_help() -> str:
    from monarch_sky.config_help import keys_help

    return keys_help()


def _flags_as_keys(args: list[str]) -> list[str]:
    """`--training.steps 10` and `--replicas=2`, TorchTitan's and argparse's habits, as the
    KEY=VALUE they mean; monarch-sky's own flags pass through."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if not arg.startswith("--") or name in OWN_FLAGS:
            out.append(arg)
            if name in OWN_FLAGS - {"-h", "--help"} and "=" not in arg and i + 1 < len(args):
                out.append(args[i + 1])
                i += 1
        elif "=" in arg:
            out.append(arg[2:].replace("-", "_"))
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out.append(f"{arg[2:].replace('-', '_')}={args[i + 1]}")
            i += 1
        else:
            out.append(arg)  # a flag with no value: argparse names it
        i += 1
    return out


def _keys_as_flags(args: list[str]) -> list[str]:
    """`steps=60`, the KEY=VALUE form, as the `--steps 60` the benchmark's flags are."""
    out: list[str] = []
    for arg in args:
        if "=" in arg and not arg.startswith("-"):
            key, value = arg.split("=", 1)
            out += [f"--{key.replace('_', '-')}", value]
        else:
            out.append(arg)
    return out


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
    from monarch_sky.hosts import tls

    if args.command == "tls-ca":
        print(tls.ca_exports())
        return 0
    try:
        print(tls.exports(tls.node_env(args.out, args.hosts)))
    except ValueError as e:
        print(f"monarch-sky: {e}", file=sys.stderr)
        return 2
    return 0


def _load(args):
    """The validated job, or None after printing what is wrong."""
    from monarch_sky.config import ConfigError, load_job

    try:
        return load_job(args.overrides, args.config)
    except ConfigError as e:
        print(f"monarch-sky: config error: {e}", file=sys.stderr)
        return None


def _config(args) -> int:
    from monarch_sky.config import EXIT_CONFIG, resolved_yaml

    from monarch_sky.common import hub_assets, released_weights

    job = _load(args)
    if job is None:
        return EXIT_CONFIG
    print(resolved_yaml(job), end="")
    cfg = job.config
    missing = hub_assets.tokenizer_problem(cfg.data) or released_weights.missing(cfg.init)
    if missing:  # a preview of a cloud recipe: its nodes fetch the tokenizer at setup
        print(f"monarch-sky: note: `train` here would refuse: {missing}", file=sys.stderr)
    return 0


def _train(args) -> int:
    from monarch_sky.config import EXIT_CONFIG

    if args.log_level:
        os.environ["MONARCH_SKY_LOG"] = args.log_level
    job = _load(args)
    if job is None:
        return EXIT_CONFIG
    from monarch_sky import standby
    from monarch_sky.run import new_run_id, run_job

    cfg = job.config
    if cfg.hosts.controller_port and not standby.is_controller_child():
        try:
            standby.open_door(cfg.hosts.controller_ip or "127.0.0.1", cfg.hosts.controller_port)
        except OSError as e:
            print(f"monarch-sky: hosts.controller_port={cfg.hosts.controller_port}: cannot listen ({e.strerror}): "
                  "another controller runs on this node, or pick a free port", file=sys.stderr)
            return EXIT_CONFIG
    if cfg.controller.standby and not standby.is_controller_child():
        argv = ["train", *(["--config", args.config] if args.config else []),
                *(["--log-level", args.log_level] if args.log_level else []),
                *(o for o in args.overrides if not o.startswith("run_id="))]
        return standby.stand_by(argv, cfg.run_id or new_run_id(cfg.recipe), cfg.run_id is None, cfg.controller.max_restarts)
    standby.die_with_standby()
    standby.wait_for_the_word()  # a warm controller: its imports (above) are done
    return run_job(job, new_run=standby.is_new_run())
