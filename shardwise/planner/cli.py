"""``shardwise plan``: rank parallel layouts for a model on a cluster; say how long training takes.

    shardwise plan --model 175B --nodes 128 --gpus-per-node 8 --gpu a100-80gb \\
        --network 8x200gbps --tokens 300e9

``--global-batch`` counts sequences (``1536``) or, with a ``tok`` suffix, tokens (``3.1Mtok``,
rounded to whole sequences); by default it follows GPT-3's batch sizes (0.5M tokens up to 1B
parameters, 1M to 3B, 2M to 20B, 1536 x 2048 tokens above). Bad input prints one line
``error: --FIELD: value X ...; fix: ...`` on stderr and returns 2; no layout fitting returns 1.
"""
from __future__ import annotations

import argparse
import re
import sys

from shardwise.planner.catalogue import GPU_HEADROOM
from shardwise.planner.errors import PlanError
from shardwise.planner.hardware import Hardware
from shardwise.planner.layout import CONVENTIONS, INITS, OPTIMIZERS, PRECISIONS, Batch
from shardwise.planner.model import ModelSpec, parse_model
from shardwise.planner.units import parse_bytes, parse_count, parse_rate

TIE_BAND = 0.10
"""Default ``--tie-band``: search.TIE_BAND (repeated so ``--help`` needs no search import)."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors become ``PlanError`` (one line, a field and a fix; no usage dump)."""

    def error(self, message: str):  # type: ignore[override]
        if message.startswith("unrecognized arguments:"):
            extra = message.split(":", 1)[1].strip()
            raise PlanError(extra.split()[0], extra, "is not an option of shardwise plan",
                            "see 'shardwise plan --help'")
        if message.startswith("the following arguments are required"):
            flag = message.split(":", 1)[1].strip().split(",")[0]
            raise PlanError(flag, "(missing)", "is required", f"give {flag}, e.g. {flag} 175B")
        match = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
        if match and match.group(2).startswith("expected one argument"):
            raise PlanError(match.group(1), "(missing)", "needs a value",
                            f"write {match.group(1)} VALUE (see 'shardwise plan --help')")
        flag, problem = (match.group(1), match.group(2)) if match else ("args", message)
        raise PlanError(flag, "(as given)", problem, "see 'shardwise plan --help'")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="shardwise plan", description=__doc__.split("\n\n")[0],
                formatter_class=argparse.RawDescriptionHelpFormatter)
    a = p.add_argument
    a("--model", required=True, help="175B | 70B | 13B | 7B | gpt-tiny | L,H,A,S,V")
    a("--nodes", default="1", help="number of machines (default 1)")
    a("--gpus-per-node", default="8", help="devices per machine (default 8)")
    a("--gpu", default="a100-80gb", help="a100-40gb | a100-80gb | h100-80gb | h200 | v100 | "
      "v100-16gb | l4 | cpu (default a100-80gb)")
    a("--interconnect", default=None, help="nvlink | pcie (default: nvlink where the GPU has it)")
    a("--network", default=None, help="10gbps | 25gbps | 100gbps | 200gbps | 400gbps | "
      "8x200gbps | 8x400gbps, per node (default 100gbps)")
    a("--tokens", default="300e9", help="tokens to train on, for the time estimate (300e9)")
    a("--global-batch", default=None, help="sequences per step, or tokens with 'tok' (3.1Mtok)")
    a("--micro-batch", default=None, help="fix the micro-batch size (default: searched)")
    a("--precision", default="bf16", help="bf16 | fp16 (mixed precision) | fp32")
    a("--optimizer", default="adam", help="adam | sgd (with momentum)")
    a("--convention", default="zero-paper", help="how model states are counted: zero-paper "
      "(ZeRO-2 = 2 + 14/N bytes per parameter) | deepspeed (4 + 16/N; docs/planner.md)")
    a("--init", default="meta", help="how ranks build the model at start-up: meta (each "
      "builds only what it keeps) | eager (each builds the whole fp32 model first)")
    a("--tie-band", default=str(TIE_BAND), help="layouts within this fraction of the fastest "
      f"step time tie; the simplest of them wins (default {TIE_BAND})")
    a("--format", default="table", help="table | json")
    a("--top", default="5", help="rows in the ranking (default 5)")
    a("--memory", default=None, help="override: memory per device, e.g. 80GiB")
    a("--headroom", default=None, help="override: fraction of device memory a plan leaves "
      f"free for allocator fragmentation (default {GPU_HEADROOM} on GPUs, 0 on cpu)")
    a("--peak-tflops", default=None, help="override: dense 16-bit peak TFLOP/s per device")
    a("--efficiency", default=None, help="override: fraction of peak a layer reaches (0-1]")
    a("--intra-bw", default=None, help="override: per-device bandwidth in a node, e.g. 300GB/s")
    a("--inter-bw", default=None, help="override: per-node network bandwidth, e.g. 200gbps")
    a("--host-memory", default=None, help="override: host memory per node, e.g. 2TiB")
    a("--disk-size", default=None, help="override: disk space per node for offload, e.g. 4TB")
    a("--disk-bw", default=None, help="override: disk read/write bandwidth per node, e.g. "
      "3GB/s (shardwise train --strategy auto measures it)")
    return p


def _positive_int(text: str, field: str) -> int:
    """A whole number of at least 1."""
    if not re.fullmatch(r"\s*[0-9]+\s*", text) or int(text) < 1:
        raise PlanError(field, text, "is not a whole number of at least 1",
                        f"give --{field} as an integer, e.g. --{field} 8")
    return int(text)


def _fraction(text: str, field: str) -> float:
    """A number in [0, 1)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1:
        raise PlanError(field, text, "is not a fraction in [0, 1)",
                        f"give --{field} as e.g. 0.1 (10%), or 0 for none")
    return value


def _choice(text: str, field: str, choices: tuple[str, ...]) -> str:
    if text.lower() not in choices:
        raise PlanError(field, text, "is not a choice", "use one of " + ", ".join(choices))
    return text.lower()


def _overrides(args: argparse.Namespace) -> dict:
    """Hardware fields the user replaced."""
    out: dict = {}
    if args.memory:
        out["memory_bytes"] = parse_bytes(args.memory, "memory")
    if args.headroom is not None:
        out["headroom"] = _fraction(args.headroom, "headroom")
    if args.peak_tflops:
        out["peak_flops"] = parse_count(args.peak_tflops, "peak-tflops") * 1e12
    if args.efficiency:
        out["efficiency"] = parse_count(args.efficiency, "efficiency")
    if args.intra_bw:
        out["intra_bw"] = parse_rate(args.intra_bw, "intra-bw")
    if args.inter_bw:
        out["inter_bw"] = parse_rate(args.inter_bw, "inter-bw")
    if args.host_memory:
        out["host_memory_bytes"] = parse_bytes(args.host_memory, "host-memory")
    if args.disk_size:
        out["disk_bytes"] = parse_bytes(args.disk_size, "disk-size")
    if args.disk_bw:
        out["disk_bw"] = parse_rate(args.disk_bw, "disk-bw")
    return out


def default_global_batch(model: ModelSpec) -> int:
    """GPT-3's batch size for a model of this size (Brown et al. 2020, Table 2.1), in sequences."""
    p = model.params
    tokens = 2**19 if p < 1e9 else 2**20 if p < 3e9 else 2**21 if p < 20e9 else 1536 * 2048
    return max(1, tokens // model.seq_len)


def _global_batch(text: str | None, model: ModelSpec) -> int:
    """Sequences per step from ``1536`` (sequences) or ``3.1Mtok`` (tokens)."""
    if text is None:
        return default_global_batch(model)
    stripped = re.sub(r"(tokens|tok)$", "", text.strip().lower())
    if stripped != text.strip().lower():
        return max(1, round(parse_count(stripped, "global-batch") / model.seq_len))
    return _positive_int(text, "global-batch")


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    model = parse_model(args.model)
    fmt = _choice(args.format, "format", ("table", "json"))
    hw = Hardware.from_catalogue(args.gpu, nodes=_positive_int(args.nodes, "nodes"),
                                 devices_per_node=_positive_int(args.gpus_per_node,
                                                                "gpus-per-node"),
                                 interconnect=args.interconnect, network=args.network,
                                 **_overrides(args))
    batch = Batch(_global_batch(args.global_batch, model),
                  precision=_choice(args.precision, "precision", PRECISIONS),
                  optimizer=_choice(args.optimizer, "optimizer", OPTIMIZERS),
                  convention=_choice(args.convention, "convention", CONVENTIONS),
                  init=_choice(args.init, "init", INITS))
    band = _fraction(args.tie_band, "tie-band")
    micro = _positive_int(args.micro_batch, "micro-batch") if args.micro_batch else None
    tokens = parse_count(args.tokens, "tokens")
    top = _positive_int(args.top, "top")
    from shardwise.planner.search import plan

    result = plan(model, hw, batch, micro_batch=micro, everything=True, band=band)
    from shardwise.planner import report

    if fmt == "json":
        print(report.to_json(result, top, tokens))
    else:
        report.print_table(result, top, tokens)
    return 0 if result.winner is not None else 1


def main(argv: list[str] | None = None) -> int:
    """``shardwise plan ARGS``: 0 with a plan, 1 when nothing fits, 2 on bad input."""
    try:
        return _run(sys.argv[1:] if argv is None else list(argv))
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # --help
        return int(exc.code or 0)


if __name__ == "__main__":
    sys.exit(main())
