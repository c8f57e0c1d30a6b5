"""``shardwise train | plan | bench``: the command line.

Every config field is a flag (``--n-layer 4``, ``--strategy ddp``, ``--overlap/--no-overlap``),
generated from shardwise/config.py so that ``--help`` documents every field. A bad value stops
with one line on stderr (field, value, fix), exit code 2, before any process starts.
"""
from __future__ import annotations

import argparse
import sys

from shardwise.config import Config, ConfigError, flag_of, from_dict, load_file, section_fields

USAGE = """usage: shardwise COMMAND [options]

commands:
  train   train a model with a parallel strategy (default: a small GPT on the Python stdlib)
  plan    rank parallel layouts for a model on a cluster with the cost model
  bench   run a benchmark row against its PyTorch peer (see benchmarks/README.md)

run 'shardwise COMMAND --help' for the options of each command."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (and exit code 2), not a usage dump."""

    def error(self, message: str):
        print(f"error: {message}; fix: see '{self.prog} --help'", file=sys.stderr)
        raise SystemExit(2)


def train_parser() -> argparse.ArgumentParser:
    ap = _OneLineParser(prog="shardwise train", description=(
        "Train with one of shardwise's strategies. Values come from the defaults, then --config "
        "FILE (TOML or YAML with sections model, data, parallel, memory, train, logging), then "
        "flags. Multi-process strategies re-run themselves under torchrun unless already "
        "launched by torchrun / SLURM."), argument_default=argparse.SUPPRESS)
    ap.add_argument("--config", help="TOML or YAML file with [section] tables of fields")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    groups = {}
    for sec, f in section_fields():
        g = groups.setdefault(sec, ap.add_argument_group(f"{sec} options"))
        flag = flag_of(f)
        choices = f.metadata.get("choices")
        help_text = f"{f.metadata['help']} (default: {f.default!r})".replace("%", "%%")
        if isinstance(f.default, bool):
            g.add_argument(flag, dest=f"{sec}.{f.name}", action=argparse.BooleanOptionalAction,
                           help=help_text)
        else:
            meta = "{" + ",".join(choices) + "}" if choices else type(f.default).__name__.upper()
            g.add_argument(flag, dest=f"{sec}.{f.name}", metavar=meta, help=help_text)
    return ap


def parse_config(argv: list[str]) -> tuple[Config, argparse.Namespace]:
    """Defaults <- --config file <- flags. Raises ConfigError on a bad value."""
    ap = train_parser()
    args = ap.parse_args(argv)
    cfg = Config()
    if getattr(args, "config", None):
        cfg = load_file(args.config, cfg)
    overrides: dict = {}
    for key, value in vars(args).items():
        if "." in key:
            sec, name = key.split(".", 1)
            overrides.setdefault(sec, {})[name] = value
    return from_dict(overrides, cfg), args


def error(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 2


def cmd_train(argv: list[str]) -> int:
    from shardwise import launch
    from shardwise.validate import validate
    try:
        cfg, args = parse_config(argv)
        world = launch.world_size(cfg)
        validate(cfg, world)
        _check_data_files(cfg)
    except ConfigError as exc:
        return error(str(exc))
    if getattr(args, "print_config", False):
        import json
        from shardwise.config import to_dict
        print(json.dumps(to_dict(cfg), indent=2))
        return 0
    if cfg.parallel.strategy == "auto":
        # calibrate here, plan, then run the choice like any other run (docs/planner.md)
        if launch.under_launcher():
            return error("parallel.strategy = 'auto' under a launcher: each rank would calibrate "
                         "on its own; fix: run 'shardwise train --strategy auto' without torchrun "
                         "(it launches the ranks itself), or pick a strategy")
        from shardwise.autoplan import choose
        try:
            choice = choose(cfg)
        except ConfigError as exc:
            return error(str(exc))
        cfg, argv = choice.config, [*argv, *choice.flags]
        world = launch.world_size(cfg)
    if not cfg.logging.run_name:
        # name the run once, here: every rank (and the schedule picture) must use the same folder
        import time
        from dataclasses import replace
        name = f"{cfg.parallel.strategy}-{time.strftime('%Y%m%d-%H%M%S')}"
        cfg = replace(cfg, logging=replace(cfg.logging, run_name=name))
        argv = [*argv, "--run-name", name]
    if world > 1 and not launch.under_launcher():
        return launch.relaunch(world, ["train", *argv])
    from shardwise.runtime import init_runtime, shutdown
    from shardwise.train import train
    rt = init_runtime(cfg)
    try:
        train(cfg, rt)["engine"].close()
    except BaseException:
        # no barrier: the other ranks may be inside a collective this rank will never join;
        # exiting lets torchrun stop them and report this rank's error
        shutdown(rt, clean=False)
        raise
    shutdown(rt)
    return 0


def _check_data_files(cfg: Config) -> None:
    """MNIST / Fashion-MNIST: the four IDX files must be there before any process starts."""
    if cfg.data.dataset not in ("mnist", "fashion-mnist"):
        return
    from shardwise.data.images import IDX_FILES, _find
    for pair in IDX_FILES.values():
        for stem in pair:
            try:
                _find(cfg.data.data_dir, stem)
            except FileNotFoundError:
                raise ConfigError("data.data_dir", cfg.data.data_dir, f"{stem}(.gz) is missing",
                                  "put the four IDX files of the data set in that directory") from None


def cmd_plan(argv: list[str]) -> int:
    try:
        from shardwise.planner.cli import main as plan_main
    except ImportError:
        return error("the planner is not installed in this version")
    return plan_main(argv)


def cmd_bench(argv: list[str]) -> int:
    import os
    if os.getcwd() not in sys.path:   # benchmarks/ lives beside shardwise/ in a checkout
        sys.path.insert(0, os.getcwd())
    try:
        from benchmarks.run import main as bench_main
    except ImportError:
        return error("'shardwise bench' runs from a source checkout (benchmarks/ beside shardwise/);"
                     " fix: cd into the repository, or run 'python -m benchmarks.run'")
    return bench_main(argv)


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        argv = ["train"]  # the embedded default job
    if argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] not in COMMANDS:
        return error(f"unknown command {argv[0]!r}; fix: use one of {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
