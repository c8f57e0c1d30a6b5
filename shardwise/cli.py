"""``shardwise train | plan | bench``: the command line.

Every config field is a flag (``--n-layer 4``, ``--strategy ddp``, ``--overlap/--no-overlap``),
generated from shardwise/config/__init__.py so that ``--help`` documents every field. A bad value stops
with one line on stderr (field, value, fix), exit code 2, before any process starts: the checks
are shardwise/launch/checks.py's, the run itself (in this process, or as one rank of a launched
world) shardwise/launch/ranks.py's.
"""
from __future__ import annotations

import argparse
import functools
import sys

from shardwise.config import Config, ConfigError, flag_of, from_dict, read_file, section_fields
from shardwise.launch import checks as prelaunch
from shardwise.launch import ranks
from shardwise.launch.checks import FinishedBeforeRestart, error

USAGE = """usage: shardwise COMMAND [options]

commands:
  train   train a model with a parallel strategy ('shardwise train' alone: the default job,
          a small GPT on the Python standard library's source, DDP on 2 processes; on
          GPUs one process per GPU)
  plan    rank parallel layouts for a model on a cluster with the cost model
  bench   run benchmark rows against their PyTorch peers (shardwise/bench/README.md)
  checkpoint inspect D | export D OUT [--max-shard-size 2GB]
          what a saved checkpoint holds; the plain model's weights as safetensors (OUT: a
          folder in the Hugging Face layout, or a file ending in .safetensors)
  generate --run DIR --prompt TEXT | --prompts-file FILE [--max-new-tokens N --temperature T
          --top-k K --seed S --device auto|cpu|cuda --no-cache]
          sample text from a trained run's model (gpt, hf:gpt2, hf:llama) on a device, with a
          KV cache; one prompt, or one per line of FILE (one JSON line each); tokens/s on stderr
  doctor RUN_DIR
          the hang report of a run whose collective timed out: which rank was behind, its
          last completed collective and step, what the others waited in

options:
  --version   print shardwise's version and exit
  --help      print this list and exit

run 'shardwise COMMAND --help' for the options of each command."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (and exit code 2), not a usage dump."""

    def error(self, message: str):
        message = " ".join(message.split())   # an argument with a newline in it stays one line
        fix = f"see '{self.prog} --help'"
        if message.endswith("expected one argument"):    # '--lr -inf': '-inf' looks like a flag
            flag = message.split(":")[0].replace("argument ", "").split("/")[0]
            fix = f"give a value after {flag}; one starting with '-' as {flag}=VALUE"
        print(f"error: {message}; fix: {fix}", file=sys.stderr)
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


@functools.lru_cache(maxsize=1)
def _parser() -> argparse.ArgumentParser:
    """train_parser(), built once (about 10 ms: a flag per config field); parsing leaves it as it was."""
    return train_parser()


def parse_config(argv: list[str]) -> tuple[Config, argparse.Namespace]:
    """Defaults <- --config file <- flags, then the layout resolved (shardwise/parallel/layout.py: a
    strategy the person named is a preset the axis flags must agree with). Raises ConfigError
    on a bad value."""
    from shardwise.parallel import layout
    args = _parser().parse_args(argv)
    cfg, named = Config(), hasattr(args, "parallel.strategy")
    if getattr(args, "config", None):
        data = read_file(args.config)
        cfg = from_dict(data, cfg)
        section = data.get("parallel") if isinstance(data, dict) else None
        named = named or (isinstance(section, dict) and "strategy" in section)
    overrides: dict = {}
    for key, value in vars(args).items():
        if "." in key:
            sec, name = key.split(".", 1)
            overrides.setdefault(sec, {})[name] = value
    cfg = from_dict(overrides, cfg)
    return layout.resolve(cfg, explicit_strategy=named), args


def check_train(argv: list[str]) -> tuple[Config, argparse.Namespace, int]:
    """Everything ``shardwise train`` checks before it starts a process: parse the flags and
    the config file, then validate the config against the world it will run in. Returns
    (config, parsed flags, world size); raises ConfigError (or SystemExit(2) for a bad flag)."""
    from shardwise.launch import torchrun as launch
    from shardwise.parallel import replicas_checks
    from shardwise.parallel.layout import check_model_names
    from shardwise.checkpoint.checks import check as check_checkpoint
    from shardwise.run.validate import check_ignored, validate
    cfg, args = parse_config(argv)
    cfg = replicas_checks.group_config(cfg)   # a replica group's rank: the group's config
    world = launch.world_size(cfg)
    validate(cfg, world)
    launch.check_gpus(cfg)          # a CUDA run: one GPU per rank on this node
    check_ignored(cfg, args, world)
    replicas_checks.check_each_group(cfg, world, lambda c, w: (validate(c, w),
                                                               check_ignored(c, args, w)))
    cfg = prelaunch.resolve_model_data(cfg, args, world)   # --dataset text tokenized here, once
    check_model_names(cfg)          # --freeze / --lora-targets against the model's names
    launch.check_restarts(cfg)      # --max-restarts needs --checkpoint-dir
    if cfg.parallel.ft_rejoin_nproc and not launch.under_launcher():
        from shardwise.launch import replicas    # a group of another size resumes resharded
        replicas.check_rejoin(cfg, world)
    cfg = prelaunch.resume_after_restart(cfg)   # a world torchrun restarted continues from `latest`
    check_checkpoint(*replicas_checks.as_group(cfg, world))   # --checkpoint-dir / --resume
    #                 (shardwise/checkpoint/checks.py; under --ft-replicas: a group's world)
    prelaunch.check_offload_room(cfg, world, launch.local_ranks())   # offload=disk: room for the state
    prelaunch.check_data_files(cfg)
    prelaunch.check_extras(cfg)
    return cfg, args, world


def _honours(args: argparse.Namespace):
    """For ``--strategy auto``: "" when a candidate layout reads every setting the person
    gave, else the one-line reason (run.validate.check_ignored, as for a named strategy)."""
    from shardwise.parallel.layout import resolve
    from shardwise.run.validate import check_ignored

    def honours(cfg: Config, world: int) -> str:
        try:
            check_ignored(resolve(cfg, explicit_strategy=True), args, world)
        except ConfigError as exc:
            return str(exc)
        return ""
    return honours


def cmd_train(argv: list[str]) -> int:
    from shardwise.launch import torchrun as launch
    try:
        cfg, args, world = check_train(argv)
    except ConfigError as exc:
        return error(str(exc))
    except FinishedBeforeRestart as exc:
        import os
        if os.environ.get("RANK") == "0":
            print(exc, flush=True)
        return 0
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
        from shardwise.launch.auto import choose, fixed_by_user
        from shardwise.parallel.layout import resolve
        try:
            fixed = fixed_by_user(cfg, lambda sec, name: prelaunch.given(args, sec, name))
            choice = choose(cfg, fixed=fixed, honours=_honours(args))
            cfg, argv = resolve(choice.config, explicit_strategy=True), [*argv, *choice.flags]
        except ConfigError as exc:
            return error(str(exc))
        world = launch.world_size(cfg)
    if launch.under_launcher():
        return ranks.train_rank(cfg)
    from shardwise.config import rundir
    try:   # name the run once, here: every rank (and the schedule picture) uses the same folder
        cfg = rundir.name_run(cfg)
        folder = rundir.create(cfg)
        prelaunch.keep_tokenizer(cfg, folder)
    except ConfigError as exc:
        return error(str(exc))
    prelaunch.warn_emulated(cfg)
    if cfg.parallel.ft_replicas:     # R torchruns and the lighthouse (launch/replicas.py)
        from shardwise.launch import replicas
        return replicas.launch(cfg, world, argv, folder)
    if world > 1 or cfg.train.max_restarts:   # restarts need torchrun's agent, even for one rank
        return launch.relaunch(world, ["train", *argv, "--run-name", cfg.logging.run_name], folder,
                               max_restarts=cfg.train.max_restarts)
    return ranks.train_here(cfg, folder)


def cmd_plan(argv: list[str]) -> int:
    try:
        from shardwise.planner.cli import main as plan_main
    except ImportError:
        return error("the planner is not installed in this version")
    return plan_main(argv)


def cmd_bench(argv: list[str]) -> int:
    """The benchmark matrix (shardwise/bench/), part of the installed package."""
    from shardwise.bench.run import main as bench_main
    return bench_main(argv)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version("shardwise")
    except PackageNotFoundError:   # running from a checkout that was never installed
        return "unknown (not installed)"


def checkpoint_parser() -> argparse.ArgumentParser:
    ap = _OneLineParser(prog="shardwise checkpoint", description=(
        "Read a checkpoint that 'shardwise train --checkpoint-dir D' saved (D, or one of its "
        "step-N folders), in this process alone."))
    sub = ap.add_subparsers(dest="action", required=True, parser_class=_OneLineParser)
    ins = sub.add_parser("inspect", help="layout, step, world size, sizes and config")
    ins.add_argument("path", help="a --checkpoint-dir or a step-N folder in it")
    ins.add_argument("--json", action="store_true", help="print the details as JSON")
    exp = sub.add_parser("export", help="the plain model's state dict as safetensors, streamed: "
                         "a folder in the Hugging Face layout, or one .safetensors file")
    exp.add_argument("path", help="a --checkpoint-dir or a step-N folder in it")
    exp.add_argument("out", nargs="?", help="a folder (model.safetensors, or shards and "
                     "model.safetensors.index.json; config.json for hf:* models), or a file "
                     "ending in .safetensors")
    exp.add_argument("--out", dest="out_flag", metavar="OUT", help="the same as OUT")
    exp.add_argument("--max-shard-size", default="2GB", help="largest shard of a folder export "
                     "(2GB = 2*10^9 bytes; MiB, GiB: 2^20, 2^30; default 2GB); the tensors are "
                     "read at most this many bytes (and at most 256 MiB) at a time")
    return ap


def cmd_checkpoint(argv: list[str]) -> int:
    import json
    import warnings
    args = checkpoint_parser().parse_args(argv)
    from shardwise.checkpoint import tools
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # DCP's "no process group" notice: one process here
            if args.action == "inspect":
                info = tools.inspect(args.path)
                print(json.dumps(info, indent=2) if args.json else tools.describe(info))
            else:
                if (args.out is None) == (args.out_flag is None):
                    return error("checkpoint export: give where to write once, as OUT or "
                                 "--out OUT; fix: e.g. 'shardwise checkpoint export ck model/'")
                out = args.out or args.out_flag
                done = tools.export(args.path, out, args.max_shard_size)
                files = done["files"]
                shown = files if len(files) <= 3 else [files[0], "...", *files[-2:]]
                print(f"wrote {len(done['tensors'])} tensors to {out} in {len(files)} "
                      f"file(s): {', '.join(shown)}")
    except ConfigError as exc:
        return error(str(exc))
    except (OSError, KeyError, ValueError) as exc:
        return error(f"checkpoint {args.path!r} cannot be read ({exc}); fix: give a folder a "
                     "run saved into, or check the file")
    return 0


def cmd_generate(argv: list[str]) -> int:
    """Sample text from a trained run (shardwise/run/generate.py)."""
    from shardwise.run import generate
    return generate.main(argv, _OneLineParser, error)


def cmd_doctor(argv: list[str]) -> int:
    """The hang report of a run (shardwise/launch/hang.py): the one the launcher wrote when a
    collective timed out, else one built now from the ranks' flight records."""
    import os
    ap = _OneLineParser(prog="shardwise doctor", description=cmd_doctor.__doc__)
    ap.add_argument("run_dir", metavar="RUN_DIR", help="a run's folder (runs/<name>)")
    args = ap.parse_args(argv)
    from shardwise.launch import hang
    if not os.path.isdir(os.path.join(args.run_dir, "flight")):
        return error(f"{args.run_dir!r} holds no flight records (flight/); fix: give the folder "
                     "of a run of 2 or more processes (its metrics.jsonl is there)")
    print(hang.saved(args.run_dir) or hang.build(args.run_dir))
    return 0


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "bench": cmd_bench, "checkpoint": cmd_checkpoint,
            "generate": cmd_generate, "doctor": cmd_doctor}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)          # bare 'shardwise' lists the commands; 'shardwise train' trains
        return 0
    if argv[0] in ("-V", "--version", "version"):
        print(f"shardwise {version()}")
        return 0
    if argv[0] not in COMMANDS:
        return error(f"unknown command {argv[0]!r}; fix: use one of {', '.join(COMMANDS)}")
    return COMMANDS[argv[0]](argv[1:])


def entry() -> int:
    """The console script: ``main``, quiet when its reader goes away (``shardwise | head``)."""
    import os
    try:
        code = main()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if sys.argv[1:2] == ["train"]:
        # a finished or stopped run has closed its logs and checkpoints; what is left is the
        # interpreter's final garbage collection of torch's objects (2.5 s here, more on a
        # loaded machine), which would hold a stopped run past its promptness
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(entry())
