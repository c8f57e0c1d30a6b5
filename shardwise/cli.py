"""``shardwise train | plan | bench``: the command line.

Every config field is a flag (``--n-layer 4``, ``--strategy ddp``, ``--overlap/--no-overlap``),
generated from shardwise/config.py so that ``--help`` documents every field. A bad value stops
with one line on stderr (field, value, fix), exit code 2, before any process starts.
"""
from __future__ import annotations

import argparse
import functools
import sys

from shardwise.config import Config, ConfigError, flag_of, from_dict, read_file, section_fields

USAGE = """usage: shardwise COMMAND [options]

commands:
  train   train a model with a parallel strategy ('shardwise train' alone: the default job,
          a small GPT on the Python standard library's source, DDP on 2 processes)
  plan    rank parallel layouts for a model on a cluster with the cost model
  bench   run benchmark rows against their PyTorch peers (shardwise/bench/README.md)
  checkpoint inspect D | export D --out model.safetensors
          what a saved checkpoint holds; the plain model's weights as safetensors
  generate --run DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --seed S]
          sample text from a trained run's model (gpt, hf:gpt2, hf:llama)

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
    """Defaults <- --config file <- flags, then the layout resolved (shardwise/layout.py: a
    strategy the person named is a preset the axis flags must agree with). Raises ConfigError
    on a bad value."""
    from shardwise import layout
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


def error(msg: str) -> int:
    """Print one ``error:`` line (a message is one line by contract) and return exit code 2."""
    print("error: " + msg.replace("\n", "\\n"), file=sys.stderr)
    return 2


NON_FINITE_EXIT = 1     # the loss turned nan / inf (train.NonFiniteLoss), as any failed run


def _resource_error(exc: BaseException, cfg: Config) -> str | None:
    """The one line for a run that ran out of memory or disk (sizes validation could not rule
    out), or None for any other error (a bug: its traceback shows)."""
    import errno
    import torch
    from shardwise.comm.collectives import CollectiveError
    if isinstance(exc, CollectiveError):
        return None     # a peer stalled or died: its own line (_train_rank)
    text = " ".join(str(exc).split())[:200]
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)) or (
            isinstance(exc, RuntimeError) and ("can't allocate memory" in text
                                               or "out of memory" in text)):
        return (f"out of memory ({text or type(exc).__name__}); fix: lower --batch-size or the "
                "model size (--n-layer, --n-embd), or use --grad-accum, --activation-checkpointing"
                ", --mixed-precision bf16 or --zero-stage 3")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS,
                                                  errno.EACCES):
        import os
        out = os.path.abspath(cfg.logging.out_dir)
        named = exc.filename and not os.path.abspath(str(exc.filename)).startswith(out + os.sep)
        if named:           # not one of the run's own files (a data or offload file)
            return (f"writing {str(exc.filename)!r} failed ({exc.strerror or exc}); fix: free "
                    "space there, or make it writable")
        also = " (or --offload-dir: offload=disk writes there too)" if cfg.memory.offload == "disk" else ""
        return (f"logging.out_dir = {cfg.logging.out_dir!r}: writing the run's files failed "
                f"({exc.strerror or exc}); fix: free space there, or pick a writable folder "
                f"with room (--out-dir){also}")
    return None


def check_train(argv: list[str]) -> tuple[Config, argparse.Namespace, int]:
    """Everything ``shardwise train`` checks before it starts a process: parse the flags and
    the config file, then validate the config against the world it will run in. Returns
    (config, parsed flags, world size); raises ConfigError (or SystemExit(2) for a bad flag)."""
    from shardwise import launch
    from shardwise.layout import check_model_names
    from shardwise.checkpoint.checks import check as check_checkpoint
    from shardwise.validate import check_ignored, validate
    cfg, args = parse_config(argv)
    world = launch.world_size(cfg)
    validate(cfg, world)
    check_ignored(cfg)
    cfg = _resolve_model_data(cfg, args, world)   # --dataset text tokenized here, once
    check_model_names(cfg)          # --freeze / --lora-targets against the model's names
    launch.check_restarts(cfg)      # --max-restarts needs --checkpoint-dir
    cfg = _resume_after_restart(cfg)   # a world torchrun restarted continues from `latest`
    check_checkpoint(cfg, world)    # --checkpoint-dir / --resume (shardwise/checkpoint/checks.py)
    _check_data_files(cfg)
    _check_extras(cfg)
    return cfg, args, world


class _FinishedBeforeRestart(Exception):
    """A restarted world whose newest checkpoint is at the last step: nothing left to train."""


def _resume_after_restart(cfg: Config) -> Config:
    """In a world torchrun's agent restarted (``--max-restarts``; TORCHELASTIC_RESTART_COUNT >
    0) with a checkpoint folder: ``train.resume`` when the folder holds a complete checkpoint
    (the refusal of a fresh run into a used folder is for people, not for restarts), else the
    config as it is (no save was published: the run starts over from step 0)."""
    from shardwise import launch
    from shardwise.checkpoint import store
    folder = store.latest(cfg.train.checkpoint_dir) if cfg.train.checkpoint_dir else None
    if not launch.restart_count() or folder is None:
        return cfg
    step = int(store.read_meta(folder)["step"])
    if step >= cfg.train.steps:   # a rank died after the final save
        raise _FinishedBeforeRestart(f"restart {launch.restart_count()}: the checkpoint {folder} "
                                     f"is at the last step ({step}); nothing left to train")
    from dataclasses import replace
    return replace(cfg, train=replace(cfg.train, resume=True))


def _restart_step(cfg: Config) -> int | None:
    """The step a restarted world resumes from (None: from scratch)."""
    from shardwise.checkpoint import store
    return int(store.read_meta(store.latest(cfg.train.checkpoint_dir))["step"]) \
        if cfg.train.resume else None


def cmd_train(argv: list[str]) -> int:
    from shardwise import launch
    try:
        cfg, args, world = check_train(argv)
    except ConfigError as exc:
        return error(str(exc))
    except _FinishedBeforeRestart as exc:
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
        from shardwise.autoplan import choose
        from shardwise.layout import resolve
        try:
            choice = choose(cfg)
            cfg, argv = resolve(choice.config, explicit_strategy=True), [*argv, *choice.flags]
        except ConfigError as exc:
            return error(str(exc))
        world = launch.world_size(cfg)
    if launch.under_launcher():
        return _train_rank(cfg)
    from shardwise import rundir
    try:   # name the run once, here: every rank (and the schedule picture) uses the same folder
        cfg = rundir.name_run(cfg)
        folder = rundir.create(cfg)
        _keep_tokenizer(cfg, folder)
    except ConfigError as exc:
        return error(str(exc))
    _warn_emulated(cfg)
    if world > 1 or cfg.train.max_restarts:   # restarts need torchrun's agent, even for one rank
        return launch.relaunch(world, ["train", *argv, "--run-name", cfg.logging.run_name], folder,
                               max_restarts=cfg.train.max_restarts)
    return _train_here(cfg, folder)


def _train_here(cfg: Config, folder: str) -> int:
    """A world of one, in this process: a stop prints one line and returns 128 + signal."""
    from shardwise import stopping
    from shardwise.runtime import init_runtime, shutdown
    from shardwise.train import train
    from shardwise.train import NonFiniteLoss
    stopping.install_handlers()
    rt = init_runtime(cfg)
    try:
        train(cfg, rt)["engine"].close()
    except stopping.Stopped as exc:
        print(stopping.stop_line(folder), file=sys.stderr, flush=True)
        return stopping.exit_code(exc.signum)
    except NonFiniteLoss as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return NON_FINITE_EXIT
    except (MemoryError, RuntimeError, OSError) as exc:
        line = _resource_error(exc, cfg)
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr, flush=True)
        return 1
    shutdown(rt)
    return 0


def _train_rank(cfg: Config) -> int:
    """One rank of a world a launcher started (ours, torchrun, SLURM). Never returns: the rank
    leaves with os._exit so that the backend's teardown at interpreter exit (gloo in torch 2.13
    aborts in about 1 of 8 worlds) cannot turn a finished run into a failure."""
    import os
    from shardwise import launch, rundir, stopping
    from shardwise.runtime import init_runtime, shutdown
    from shardwise.comm.collectives import CollectiveError
    from shardwise.train import NonFiniteLoss, train
    request = stopping.install_handlers()
    stopping.watch_parent()
    ours = os.environ.get("SHARDWISE_RUN_DIR")   # set by our launcher: the folder is made
    code, rt = 0, None
    try:
        rt = init_runtime(cfg)
        if not ours:
            cfg = _agree_on_run(cfg, rt)
        if rt.is_main and launch.restart_count():    # --max-restarts: a restarted world
            launch.keep_attempt_metrics(rundir.path(cfg))
            print(launch.restart_line(_restart_step(cfg)), flush=True)
        train(cfg, rt)["engine"].close()
        shutdown(rt)
    except ConfigError as exc:
        code = error(str(exc))
    except NonFiniteLoss as exc:
        if rt is not None and rt.is_main:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        code = NON_FINITE_EXIT
    except CollectiveError as exc:
        if request.signum is not None:      # a peer left because we are all stopping
            code = stopping.exit_code(request.signum)
        else:
            where = f" at step {exc.step}" if exc.step else " before the first step"
            left = launch.restarts_left()
            then = f"torchrun restarts the world ({left} restarts left)" if left else "the run stops"
            print(f"error: rank {rt.rank if rt else '?'}: {exc.op}{where} failed ({exc}); another "
                  f"rank stalled or died (timeout {cfg.train.collective_timeout:g} s); {then}; "
                  "fix: look at that rank's output above, or raise --collective-timeout "
                  "if a step can take that long", file=sys.stderr, flush=True)
            code = 1
    except BaseException as exc:
        stopped = request.signum is not None or isinstance(exc, stopping.Stopped)
        line = None if stopped else _resource_error(exc, cfg)
        if line is not None:     # out of memory or disk: one line; the launcher stops the rest
            print(f"error: rank {rt.rank if rt else '?'}: {line}", file=sys.stderr, flush=True)
            code = 1
        elif not stopped:
            raise   # a real error: let the traceback show; torchrun stops the others
        else:
            signum = request.signum or exc.signum
            if not ours and rt is not None and rt.is_main:
                print(stopping.stop_line(rundir.path(cfg)), file=sys.stderr, flush=True)
            code = stopping.exit_code(signum)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _agree_on_run(cfg: Config, rt) -> Config:
    """Under someone else's launcher: rank 0 names and makes the run directory, all ranks use it."""
    from shardwise import rundir
    fixed = None
    if rt.is_main:
        try:
            from shardwise.launch import restart_count
            # a restarted world keeps its first attempt's --run-name folder (metrics: launch.py)
            fixed = cfg if restart_count() and cfg.logging.run_name else rundir.name_run(cfg)
            _keep_tokenizer(fixed, rundir.create(fixed))
            _warn_emulated(fixed)
        except ConfigError as exc:
            fixed = exc
    fixed = rt.comm.all_gather_object(fixed, rt.mesh.world)[0]
    if isinstance(fixed, ConfigError):
        raise fixed
    return fixed


def _warn_emulated(cfg: Config) -> None:
    """fp16 autocast on a CPU works but is emulated: say so once, before the run."""
    import torch
    on_cpu = cfg.train.device == "cpu" or (cfg.train.device == "auto" and not torch.cuda.is_available())
    if cfg.memory.mixed_precision == "fp16" and on_cpu:
        print("warning: memory.mixed_precision = 'fp16' on a CPU is emulated and slow (and bf16 "
              "needs no loss scaling); use --mixed-precision bf16 on CPUs", file=sys.stderr,
              flush=True)


def _given(args: argparse.Namespace, section: str, name: str) -> bool:
    """Whether the person set ``section.name``: a flag, or a key in the --config file."""
    if hasattr(args, f"{section}.{name}"):
        return True
    data = read_file(args.config) if getattr(args, "config", None) else {}
    keys = data.get(section) if isinstance(data, dict) else None
    return isinstance(keys, dict) and any(str(k).replace("-", "_") == name for k in keys)


def _resolve_model_data(cfg: Config, args: argparse.Namespace, world: int) -> Config:
    """Sizes known only from files, before launch: the vocabulary a Hugging Face config file
    fixes; for --dataset text, the corpus tokenized into the token cache (once: later runs and
    the ranks find it there) and model.vocab_size set to the tokenizer's unless given (a given
    one that is too small is refused); a --hf-weights checkpoint's tensors against the model."""
    from dataclasses import replace
    from shardwise.models import configured_vocab, hf
    from shardwise.validate import validate
    before, given = cfg, _given(args, "model", "vocab_size")
    fixed = configured_vocab(cfg.model)
    if fixed is not None:
        cfg, given = replace(cfg, model=replace(cfg.model, vocab_size=fixed)), True
    if cfg.data.dataset == "text":
        from shardwise.data import resolve_text
        cfg, _ = resolve_text(cfg, given)
    if cfg != before:
        validate(cfg, world)       # the sizes it set (memory bounds) are checked like typed ones
    if hf.is_hf(cfg.model.name) and cfg.model.hf_weights:
        hf.check_weights(cfg)
    return cfg


def _keep_tokenizer(cfg: Config, folder: str) -> None:
    """--dataset text with a BPE or a tokenizer file: a copy in the run directory, beside the
    weights it was trained with."""
    import shutil
    from shardwise.data import tokenizer_files
    for path in tokenizer_files(cfg):
        shutil.copy(path, folder)


def _check_extras(cfg: Config) -> None:
    """Optional packages a setting needs, checked before any process starts."""
    from shardwise.extras import require
    if cfg.logging.tensorboard:
        require("tensorboard", "tensorboard", "logging.tensorboard")


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
    exp = sub.add_parser("export", help="the plain model's state dict as a safetensors file")
    exp.add_argument("path", help="a --checkpoint-dir or a step-N folder in it")
    exp.add_argument("--out", required=True, help="the .safetensors file to write")
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
                shapes = tools.export(args.path, args.out)
                print(f"wrote {len(shapes)} tensors to {args.out}")
    except ConfigError as exc:
        return error(str(exc))
    except (OSError, KeyError, ValueError) as exc:
        return error(f"checkpoint {args.path!r} cannot be read ({exc}); fix: give a folder a "
                     "run saved into, or check the file")
    return 0


def cmd_generate(argv: list[str]) -> int:
    """Sample text from a trained run (shardwise/generate.py)."""
    from shardwise import generate
    return generate.main(argv, _OneLineParser, error)


COMMANDS = {"train": cmd_train, "plan": cmd_plan, "bench": cmd_bench, "checkpoint": cmd_checkpoint,
            "generate": cmd_generate}


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
