"""Every generated block of the docs, written from its source (result JSON, the CLI's parsers).

    python scripts/gen_docs.py            # rewrite every generated block in README.md and docs/
    python scripts/gen_docs.py --check    # exit 1 and name each block that differs (CI, tests)

A generated block is the text between

    <!-- generated: KIND ARGS -->
    ...
    <!-- /generated -->

and KIND is one of:

    bench-table FOLDER      the benchmark rows of FOLDER's JSON (shardwise.bench.report.table):
                            throughput, runs, peak memory, ratio against the PyTorch peer
    bench-provenance FOLDER where those rows ran: date, commit, dirty flag, machine, load
    gpu-table FILE...       shardwise/bench/gpu.py's gpu.json files (report.gpu_table)
    gpu-summary FILE...     a line per case with a peer: ratio, MFU, the ledger's gap
    generate-speed FILE     shardwise/bench/generate_speed.py's JSON: with and without the cache
    bench-rows FILE...      the benchmark table of the given row JSON files (a page's own rows),
                            then a provenance line
    json-table FILE         the table a benchmark stored in its JSON (``table``: the 57M memory
                            benchmarks), then a provenance line
    ps-rows FILE...         the parameter-server straggler rows: tokens/s, runs, last loss,
                            staleness, and the allreduce peer of the sync row
    bubble FILE             the mp-bubble row: measured idle fraction against each formula
    planner-steps FILE      planner_validation.json: predicted vs measured states and step time
    planner-categories FILE the same file, per memory category
    offload-row FILE        the ZeRO-Infinity row: throughput, peak RSS fallen vs bytes offloaded
    planner-heldout FILE    planner_heldout.json: the held-out models, run by run, and what
                            missed its goal
    allreduce-sizes FILE    allreduce-sizes.json: the allreduce against its size, measured and
                            as the calibration's fits predict it

A measured figure inside a sentence is an inline value, one number from one JSON file:

    <!-- value: FILE KEY FORMAT -->1.20<!-- /value -->

KEY is a dotted path into the JSON (``ours.items_per_s``; a list index is a number:
``sides.zero3.0.peak_rss_mib``) and FORMAT a Python format spec (``.2f``, ``,.0f``, ``.0%``),
optionally followed by ``/DIVISOR``, the value divided first (``.1f/1e9``: bytes/s as GB/s;
``,.0f/1048576``: bytes as MiB; ``.0f/60``: seconds as minutes).

Every measured block ends with where its JSON ran (date, commit, uncommitted changes, machine);
a field the JSON does not carry is written "not recorded".
    cli-reference           every command's options, from the same parsers ``--help`` prints

So a measured figure in the docs is never typed: change a number in a block and ``--check``
fails (tests/test_docs.py), re-run the benchmark and this script rewrites it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = re.compile(r"(<!-- generated: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- /generated -->)",
                   re.S)


def bench_table(folder: str) -> str:
    from shardwise.bench.report import load, table
    rows = load(os.path.join(ROOT, folder))
    if not rows:
        raise SystemExit(f"error: no benchmark rows in {folder}")
    return table(rows)


def bench_provenance(folder: str) -> str:
    from shardwise.bench.report import load
    rows = load(os.path.join(ROOT, folder))
    machines = [r.get("machine", {}) for r in rows]
    dates = sorted(m.get("date", "?") for m in machines)
    commits = sorted({str(m.get("commit")) for m in machines})
    dirty = sorted({str(m.get("dirty", "not recorded")) for m in machines})
    m = machines[0] if machines else {}
    return (f"{len(rows)} rows from `{folder}/`, run {dates[0]} to {dates[-1]}; commit(s) "
            f"{', '.join(commits)}; uncommitted changes: {', '.join(dirty)}; {m.get('cpus', '?')} "
            f"CPUs, {m.get('processor', '?')}, torch {m.get('torch', '?')}, GPU: "
            f"{m.get('cuda') or 'none'}.\n")


def gpu_tables(*files: str) -> str:
    from shardwise.bench.report import gpu_table
    return "\n".join(gpu_table(json.load(open(os.path.join(ROOT, f)))) for f in files)


def gpu_summary(*files: str) -> str:
    """One line per case with a peer: shardwise's and PyTorch's tokens/s (medians), the ratio,
    shardwise's MFU and its ledger's gap to the measured peak; where and when it ran."""
    import statistics
    lines = []
    for f in files:
        data = json.load(open(os.path.join(ROOT, f)))
        m = data.get("machine", {})
        for r in data.get("ratios", []):
            mine = [c for c in data["cases"] if (c.get("size"), c.get("case")) ==
                    (r["size"], r["case"]) and c.get("impl") == "shardwise" and "mfu" in c]
            mfu = statistics.median(c["mfu"] for c in mine if c["mfu"] is not None)
            gaps = [c["ledger_gap"] for c in mine if c.get("ledger_gap") is not None]
            gap = f", ledger {100 * statistics.median(gaps):+.1f}% of the measured peak" if gaps else ""
            lines.append(f"- {r['size']} {r['case']}: {r['ratio']:.3f}x the plain PyTorch loop's "
                         f"tokens/s ({r['shardwise_tokens_per_s']:,.0f} vs "
                         f"{r['pytorch_tokens_per_s']:,.0f}), MFU {100 * mfu:.1f}%{gap} "
                         f"({m.get('gpu', '?')}, {m.get('date', '?')[:10]})")
    return "\n".join(lines) + "\n"


def generate_speed(path: str) -> str:
    """shardwise/bench/generate_speed.py's JSON: with and without the KV cache."""
    d = json.load(open(os.path.join(ROOT, path)))
    m, mc = d["model"], d["machine"]
    rows = ["| decoding | runs (s) | median (s) | tokens/s |", "|---|---|---|---|"]
    for key, label in (("cache", "KV cache"), ("no_cache", "recomputing the window")):
        r = d[key]
        rows.append(f"| {label} | {', '.join(f'{x:.2f}' for x in r['seconds'])} | "
                    f"{r['median_s']:.2f} | {r['tokens_per_s']:,.1f} |")
    rows += ["", f"Speed-up {d['speedup']:.1f}x (medians), the same tokens: {d['same_tokens']}. "
             f"Our GPT, {m['n_layer']} layers x {m['n_embd']}, {m['params']:,} parameters, "
             f"prompt {d['prompt_len']} tokens, {d['new_tokens']} new, {d['decoding']}, "
             f"{d['threads']} thread(s); `{d['command']}`; {mc.get('date')}, commit "
             f"{mc.get('commit')}{' (uncommitted changes)' if mc.get('dirty') else ''}, "
             f"{mc.get('cpus')} CPUs {mc.get('processor')}, torch {mc.get('torch')}."]
    return "\n".join(rows)


def _load(path: str) -> dict:
    return json.load(open(os.path.join(ROOT, path)))


def provenance(*paths: str) -> str:
    """Where the files ran: one clause per distinct (date, commit, dirty flag), then the
    machine; what a file does not record is said so."""
    groups: dict = {}
    machines = []
    for path in paths:
        d = _load(path)
        m = d.get("machine") or {}
        machines.append(m)
        date = str(m.get("date") or d.get("when") or "")[:16] or "date not recorded"
        commit = m.get("commit") or "not recorded"
        dirty = m.get("dirty")
        dirty = "not recorded" if dirty is None else ("yes" if dirty else "no")
        key = (date, commit, dirty)
        groups.setdefault(key, []).append(os.path.basename(path))
    clauses = [f"{', '.join(f'`{n}`' for n in names)}: {date}, commit {commit}, uncommitted "
               f"changes {dirty}" for (date, commit, dirty), names in groups.items()]
    m = next((m for m in machines if m), {})
    where = (f"{m.get('cpus', '?')} CPUs, {m.get('processor', '?')}, torch {m.get('torch', '?')}, "
             f"GPU: {m.get('cuda') or 'none'}" if m else "machine not recorded")
    folder = os.path.dirname(paths[0])
    return f"Generated from `{folder}/` ({where}). " + "; ".join(clauses) + ".\n"


def bench_rows(*paths: str) -> str:
    """The benchmark table (shardwise.bench.report.table) of these row files, and where they ran."""
    from shardwise.bench.report import table
    return table([_load(p) for p in paths]) + "\n" + provenance(*paths)


def json_table(path: str) -> str:
    """The markdown table a benchmark stored in its own JSON, and where it ran."""
    return _load(path)["table"].rstrip("\n") + "\n\n" + provenance(path)


def ps_rows(*paths: str) -> str:
    """Parameter-server straggler rows: ours per mode, and the sync row's allreduce peer."""
    rows = ["| run | tokens/s | runs | loss at the last step | max / mean staleness |",
            "|---|---|---|---|---|"]
    peer = None
    for path in paths:
        d = _load(path)
        x = d["ours"]["extra"]
        mode = d["args"].get("ps_mode", "?") + (f", s = {d['args']['staleness']}"
                                                if "staleness" in d["args"] else "")
        rows.append(f"| ps {mode} | {d['ours']['items_per_s']:,.0f} | "
                    f"{' / '.join(f'{v:,.0f}' for v in d['runs']['ours'])} | "
                    f"{x['losses'][-1]:.2f} (step {len(x['losses'])}) | "
                    f"{x.get('staleness_max', 0)} / {x.get('staleness_mean', 0):.2f} |")
        if d.get("peer_result"):
            peer = (d["peer"], d["peer_result"]["items_per_s"], d["runs"]["peer"])
    if peer:
        rows.append(f"| {peer[0]} | {peer[1]:,.0f} | {' / '.join(f'{v:,.0f}' for v in peer[2])} "
                    "| - | - |")
    return "\n".join(rows) + "\n\n" + provenance(*paths)


def bubble(path: str) -> str:
    """The mp-bubble row: each (p, m, schedule)'s measured idle fraction against its formula."""
    rows = ["| p | m | schedule | measured | formula | peak in flight |", "|---|---|---|---|---|---|"]
    for b in _load(path)["ours"]["extra"]["bubble"]:
        name = b["schedule"] + (f" V={b['v']}" if b.get("v", 1) > 1 else "")
        rows.append(f"| {b['p']} | {b['m']} | {name} | {b['bubble_measured']:.3f} | "
                    f"{b['bubble_formula']:.3f} | {b['peak_in_flight']} |")
    return "\n".join(rows) + "\n\n" + provenance(path)


def planner_steps(path: str) -> str:
    """planner_validation.json: predicted / measured model states, buffers and step time."""
    from shardwise.bench import validate_planner as vp
    out = ["| strategy | world | layout | model states pred / meas (MB) | gap | comm buffers "
           "pred / meas (MB) | step pred / meas (s), median (range) | gap | goals (10% / 25%) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in _load(path)["rows"]:
        pm, mm = r["predicted_memory"], r["measured_memory"]
        mem_ok = all(g is None or abs(g) <= vp.MEM_GOAL for k, g in r["memory_gap"].items()
                     if k in vp.STATES)
        ok = ("yes" if mem_ok else "no") + " / " + (
            "yes" if abs(r["step_gap"]) <= vp.TIME_GOAL else "no")
        out.append(f"| {r['strategy']} | {r['world']} | {r['layout']} | "
                   f"{vp._mb(r['states_predicted'])} / {vp._mb(r['states_measured'])} | "
                   f"{vp._pct(r['states_gap'])} | {vp._mb(pm['comm_buffers'])} / "
                   f"{vp._mb(mm['comm_buffers'])} | {r['step_predicted_s']:.3f} "
                   f"{vp._spread(r.get('step_predictions_s'))} / {r['step_measured_s']:.3f} "
                   f"{vp._spread(r.get('step_measurements_s'))} | {vp._pct(r['step_gap'])} | {ok} |")
    return "\n".join(out) + "\n\n" + provenance(path)


def planner_categories(path: str) -> str:
    """planner_validation.json per memory category: predicted / measured MB."""
    from shardwise.bench import validate_planner as vp
    out = ["| strategy | " + " | ".join(vp.STATES) + " |", "|---" * (len(vp.STATES) + 1) + "|"]
    for r in _load(path)["rows"]:
        cells = [f"{vp._mb(r['predicted_memory'][k])} / {vp._mb(r['measured_memory'][k])}"
                 for k in vp.STATES]
        out.append(f"| {r['strategy']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n\n" + provenance(path)


def offload_row(path: str) -> str:
    """The ZeRO-Infinity row at 57M (issue 30's goal): throughput, and how far peak RSS fell
    against the bytes offloaded, from the row's own JSON (both sides' medians, the fullest rank)."""
    d = _load(path)
    ours, peer = d["ours"], d["peer_result"]
    mib = lambda b: f"{b / 2**20:,.0f} MiB"
    drop = peer["peak_rss_max_rank"] - ours["peak_rss_max_rank"]
    off = ours["extra"]["offloaded"]
    rows = ["| figure | offloaded (disk) | not offloaded |", "|---|---:|---:|",
            f"| tokens/s | {ours['items_per_s']:,.1f} | {peer['items_per_s']:,.1f} |",
            f"| peak RSS, fullest rank (training) | {mib(ours['peak_rss_max_rank'])} | "
            f"{mib(peer['peak_rss_max_rank'])} |",
            f"| peak RSS of prepare | {mib(ours['extra']['peak_prepare'])} | "
            f"{mib(peer['extra']['peak_prepare'])} |",
            f"| ledger on disk / in memory at the peak | {mib(off)} / "
            f"{mib(sum(v for k, v in ours['extra']['ledger_at_peak'].items() if k != 'on_disk'))} | "
            f"0 / {mib(sum(v for k, v in peer['extra']['ledger_at_peak'].items() if k != 'on_disk'))} |",
            "",
            f"Throughput {d['throughput_ratio']:.3f}x no offload (goal >= 0.85); peak RSS "
            f"{mib(drop)} lower, {drop / off:.2f}x the {mib(off)} offloaded (goal >= 0.9x)."]
    return "\n".join(rows) + "\n\n" + provenance(path)


def planner_heldout(path: str) -> str:
    """planner_heldout.json: each held-out model and strategy, run by run (the benchmark's
    own table), the cases that missed a goal, and where it ran."""
    from shardwise.bench import validate_planner_heldout as vh
    doc = _load(path)
    s = doc["summary"]
    missed = [f"- step time within 25% in every run: {s['step_ok']} of {s['completed']}; "
              f"missed: {', '.join(s['step_missed']) or 'none'}",
              f"- memory within 10% per category in every run: {s['memory_ok']} of "
              f"{s['completed']}; missed: {', '.join(s['memory_missed']) or 'none'}",
              f"- did not run: {', '.join(s['failed']) or 'none'}"]
    return vh.markdown(doc) + "\n" + "\n".join(missed) + "\n\n" + provenance(path)


def allreduce_sizes(path: str) -> str:
    """allreduce-sizes.json: each world's allreduce times against size and both fits'
    predictions (the benchmark's own table), and where it ran."""
    from shardwise.bench import allreduce_sizes as bench
    return bench.markdown(_load(path)) + "\n" + provenance(path)


def product_ceiling(*paths: str) -> str:
    """The product rows (single-defaults-vs-torch-defaults*): torch's step and its optimizer's
    share, the goal, the fused step on the same model, the most swapping the one for the other
    can give (bench/peers.py step_ceiling), and the ratio the row measured."""
    out = ["| row | torch's step | its optimizer step | share | goal (1 + share) | fused step, "
           "same model | fused step the goal needs | ceiling of the swap | measured ratio | "
           "goal met in this run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        d = _load(path)
        e = d["peer_result"]["extra"]
        ms = lambda s: f"{s * 1e3:,.1f} ms"           # noqa: E731
        out.append(f"| {d['row']} | {ms(e['step_s'])} | {ms(e['optimizer_step_s'])} | "
                   f"{e['optimizer_share']:.1%} | {e['goal']:.3f} | "
                   f"{ms(e['ours_optimizer_step_s'])} | {ms(e['replacement_limit_s'])} | "
                   f"{e['ceiling']:.3f} | {d['throughput_ratio']:.3f} | "
                   f"{'yes' if d['throughput_ratio'] >= e['goal'] else 'no'} |")
    return "\n".join(out) + "\n\n" + provenance(*paths)


def compile_ceiling(path: str) -> str:
    """profile-limit-*.json, both sides (one process; DDP's rank 0): where the step goes, by
    what ``--compile`` leaves as it is and what it could fuse, and the most it could gain
    (profile_limit.compile_ceiling)."""
    from shardwise.bench.profile_limit import compile_ceiling as split
    d = _load(path)
    sides = [split(d[side]["ops_s_per_step"], d[side].get("weight_casts_s_per_step", 0.0))
             for side in ("one", "ddp")]
    precision = "bf16 autocast" if d.get("mixed_precision", "no") == "bf16" else "fp32"
    out = [f"| part of the step ({precision}) | one process (s) | share | DDP world "
           f"{d['world']}, rank 0 (s) | share |", "|---|---|---|---|---|"]
    for name in [*sides[0]["groups"], "the rest"]:
        cells = [c["rest"] if name == "the rest" else c["groups"][name] for c in sides]
        out.append(f"| {name} | " + " | ".join(f"{v:.3f} | {v / c['total']:.1%}"
                                                for v, c in zip(cells, sides)) + " |")
    out.append("| step (self times summed) | " + " | ".join(f"{c['total']:.3f} | 100%"
                                                          for c in sides) + " |")
    out.append("| **ceiling: the rest compiled away** | " + " | ".join(
        f"**{c['ceiling']:.3f}x** | " for c in sides) + " |")
    return "\n".join(out) + "\n\n" + provenance(path)


def compile_split(eager: str, compiled: str) -> str:
    """Two profile-limit JSONs of the same precision, eager and ``--compile``: the one process's
    step by part (profile_limit.compile_ceiling's groups, with Inductor's compiled kernels, the
    self time of its ``CompiledFxGraph`` calls, out of the rest), side by side."""
    from shardwise.bench.profile_limit import compile_ceiling as split
    rows = []
    for path in (eager, compiled):
        one = _load(path)["one"]
        ops = dict(one["ops_s_per_step"])
        kernels = sum(v for k, v in ops.items() if "CompiledFxGraph" in k)
        c = split({k: v for k, v in ops.items() if "CompiledFxGraph" not in k},
                  one.get("weight_casts_s_per_step", 0.0))
        rows.append({**c["groups"], "Inductor's compiled kernels": kernels, "the rest": c["rest"],
                     "step (self times summed)": c["total"] + kernels})
    out = ["| part of the one process's step | eager (s) | --compile (s) | difference (s) |",
           "|---|---|---|---|"]
    for name in rows[0]:
        e, k = rows[0][name], rows[1][name]
        out.append(f"| {name} | {e:.3f} | {k:.3f} | {k - e:+.3f} |")
    return "\n".join(out) + "\n\n" + provenance(eager, compiled)


def cli_reference() -> str:
    """Each command's usage and options, as ``--help`` prints them (one source)."""
    from shardwise import cli
    from shardwise.run import generate
    from shardwise.bench.run import parser as bench_parser
    from shardwise.planner.cli import build_parser as plan_parser
    parsers = [("shardwise train", cli.train_parser()), ("shardwise plan", plan_parser()),
               ("shardwise bench", bench_parser()), ("shardwise checkpoint", cli.checkpoint_parser()),
               ("shardwise generate", generate.parser(cli._OneLineParser))]
    out = ["The options of every command, generated from the parsers that `--help` prints "
           "(`python scripts/gen_docs.py`). `shardwise` alone lists the commands:", "",
           "```text", cli.USAGE, "```", ""]
    for name, ap in parsers:
        ap.prog = name
        os.environ["COLUMNS"] = "100"
        out += [f"## `{name}`", "", "```text", ap.format_help().rstrip(), "```", ""]
    return "\n".join(out)


KINDS = {"bench-table": bench_table, "bench-provenance": bench_provenance,
         "gpu-table": gpu_tables, "gpu-summary": gpu_summary, "generate-speed": generate_speed,
         "cli-reference": cli_reference, "bench-rows": bench_rows, "json-table": json_table,
         "ps-rows": ps_rows, "bubble": bubble, "planner-steps": planner_steps,
         "planner-categories": planner_categories,
         "planner-heldout": planner_heldout, "offload-row": offload_row,
         "allreduce-sizes": allreduce_sizes,
         "product-ceiling": product_ceiling, "compile-ceiling": compile_ceiling,
         "compile-split": compile_split}


VALUE = re.compile(r"(<!-- value: (?P<spec>[^>]*?) -->)(?P<body>[^<\n]*)(<!-- /value -->)")


def value(spec: str) -> str:
    """One inline figure: FILE's value at the dotted KEY, formatted by FORMAT."""
    parts = spec.split()
    if len(parts) != 3:
        raise SystemExit(f"error: inline value {spec!r}: expected FILE KEY FORMAT")
    path, key, fmt = parts
    fmt, _, divisor = fmt.partition("/")
    node = _load(path)
    for step in key.split("."):
        try:
            node = node[int(step)] if isinstance(node, list) else node[step]
        except (KeyError, IndexError, ValueError, TypeError):
            raise SystemExit(f"error: inline value {spec!r}: {path} has no {key!r} "
                             f"(stopped at {step!r})") from None
    return format(node / float(divisor) if divisor else node, fmt)


def render(spec: str) -> str:
    kind, *args = spec.split()
    if kind not in KINDS:
        raise SystemExit(f"error: unknown generated block kind {kind!r}; known: {list(KINDS)}")
    text = KINDS[kind](*args)
    return text if text.endswith("\n") else text + "\n"


def pages() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(
        glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def process(path: str, check: bool) -> list[str]:
    """Rewrite (or check) the blocks of one page; the specs of the blocks that differed."""
    text = open(path).read()
    stale = []

    def fresh(match):
        body = render(match.group("spec"))
        if body != match.group("body"):
            stale.append(match.group("spec"))
        return match.group(1) + body + match.group(4)
    def fresh_value(match):
        body = value(match.group("spec"))
        if body != match.group("body"):
            stale.append(f"value: {match.group('spec')}")
        return match.group(1) + body + match.group(4)
    new = VALUE.sub(fresh_value, BLOCK.sub(fresh, text))
    if not check and new != text:
        with open(path, "w") as fh:
            fh.write(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    args = ap.parse_args(argv)
    sys.path.insert(0, ROOT)
    differ = []
    for path in pages():
        for spec in process(path, args.check):
            differ.append(f"{os.path.relpath(path, ROOT)}: {spec}")
    if differ:
        verb = "differs from its source" if args.check else "rewritten"
        for d in differ:
            print(f"{d}: {verb}", file=sys.stderr if args.check else sys.stdout)
        if args.check:
            print("fix: python scripts/gen_docs.py", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
