"""What an allreduce costs against its size, and how well the calibration's fit predicts it.

    python -m shardwise.bench.allreduce_sizes [--worlds 2,4] [--save]

In a forked world of each size, waiting as training will (``runtime.spins``: ranks poll where
each has a core, else block), ``Comm.all_reduce`` (gloo) and data parallelism's ``Reducer``
(shared memory where it applies) each time 1 KiB, 1, 4, 16, 32 and 64 MiB (the slowest rank's
median; ``calibrate_links._timed_sizes``, as the calibration times them). Two fits of the
ring's alpha-beta model ``2 (N-1) alpha + 2 (N-1)/N K / bw`` are then graded on every size,
through the planner's own formula (``planner.comm.allreduce_time``): the calibration's
(``calibrate_links._bus_bw``: the line through 1 KiB and 32 MiB) and the line through 1 KiB and
4 MiB it used before 2026-12-07. Writes
allreduce-sizes.{json,md} (``--save``: into shardwise/bench/results/). About a minute here.
"""
from __future__ import annotations

import argparse
import time

import torch

from shardwise.launch.calibrate_links import LARGE, SMALL, XLARGE, _bus_bw
from shardwise.planner.comm import allreduce_time

SIZES = (SMALL, 1 << 18, LARGE, 1 << 22, XLARGE, 1 << 24)
"""fp32 elements: 1 KiB, 1, 4, 16, 32 and 64 MiB."""


def _reps(numel: int) -> int:
    return 20 if numel <= LARGE else 5


def _probe(rank: int, world: int, sizes) -> dict:
    from shardwise.comm.collectives import Comm
    from shardwise.comm.reducer import Reducer
    from shardwise.launch.calibrate_links import _timed_sizes
    from shardwise.mesh import Mesh
    from shardwise.run.runtime import spins
    torch.set_num_threads(1)
    device = torch.device("cpu")
    comm = Comm(spin=spins("auto", device, world))
    group = Mesh.build(1, world, 1).world
    reducer = Reducer(comm, group, "auto", device)
    reps = {numel: _reps(numel) for numel in sizes}
    barrier = lambda: comm.barrier(group)   # noqa: E731
    out = {"gloo": _timed_sizes(lambda t: comm.all_reduce(t, group), reps, barrier),
           "reducer": _timed_sizes(lambda t: reducer.all_reduce(t, False, "allreduce-sizes"),
                                   reps, barrier),
           "shared_memory": reducer.uses_shared_memory, "spins": comm.spin}
    reducer.close()
    return out


def _line(times: dict, world: int) -> tuple[float, float]:
    """The fit before 2026-12-07: (bus bandwidth, alpha) of the line through 1 KiB and 4 MiB."""
    steps = 2 * (world - 1)
    return (steps / world * (LARGE - SMALL) * 4 / max(times[LARGE] - times[SMALL], 1e-9),
            times[SMALL] / steps)


def measure(world: int, sizes=None) -> dict:
    """One world's table: per kind, per size (default SIZES), the measured seconds and both
    fits' predictions."""
    from shardwise.launch.world import run_world
    sizes = sizes or SIZES
    ranks = run_world(_probe, world, sizes, timeout=600)
    out = {"world": world, "spins": ranks[0]["spins"],
           "shared_memory": ranks[0]["shared_memory"], "kinds": {}}
    for kind in ("gloo", "reducer"):
        slowest = {n: max(r[kind][n] for r in ranks) for n in sizes}
        fits = {"calibration": _bus_bw([{k: slowest[k] for k in (SMALL, XLARGE)}], world),
                "line_1k_4m": _line(slowest, world)}
        rows = []
        for n in sizes:
            row = {"bytes": n * 4, "measured_s": slowest[n]}
            for name, (bw, alpha) in fits.items():
                pred = allreduce_time(n * 4, world, bw, alpha)
                row[f"{name}_s"] = pred
                row[f"{name}_gap"] = pred / slowest[n] - 1
            rows.append(row)
        out["kinds"][kind] = {"fits": {k: {"bus_bw": bw, "alpha": a} for k, (bw, a)
                                       in fits.items()}, "rows": rows}
    return out


def markdown(doc: dict) -> str:
    out = ["| world | waits | allreduce | size | measured (ms) | calibration's fit (ms) | gap | "
           "1 KiB-4 MiB line (ms) | gap |", "|---|---|---|---|---|---|---|---|---|"]
    for w in doc["worlds"]:
        waits = "poll" if w["spins"] else "block"
        for kind, k in w["kinds"].items():
            name = "gloo" if kind == "gloo" else (
                "dp (shared memory)" if w["shared_memory"] else "dp (gloo)")
            for r in k["rows"]:
                size = r["bytes"]
                label = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
                out.append(f"| {w['world']} | {waits} | {name} | {label} | "
                           f"{r['measured_s'] * 1e3:.2f} | {r['calibration_s'] * 1e3:.2f} | "
                           f"{r['calibration_gap']:+.0%} | {r['line_1k_4m_s'] * 1e3:.2f} | "
                           f"{r['line_1k_4m_gap']:+.0%} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    import os
    from shardwise.bench.validate_planner import write_results
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--save", action="store_true", help="write into shardwise/bench/results/")
    args = ap.parse_args(argv)
    try:
        worlds = [int(w) for w in args.worlds.split(",")]
        if any(w < 2 for w in worlds):
            raise ValueError
    except ValueError:
        print(f"--worlds {args.worlds!r}: give world sizes of 2 or more, e.g. --worlds 2,4")
        return 2
    t0 = time.perf_counter()
    doc = {"worlds": [measure(w) for w in worlds], "seconds": time.perf_counter() - t0,
           "load": os.getloadavg(), "cpus": os.cpu_count()}
    write_results(args.save, "allreduce-sizes", doc, markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
