"""The ideal timeline of each schedule as a PNG, the README's pictures:

    python -m shardwise.parallel.pipeline.pictures OUT_DIR [P M V]

draws ``OUT_DIR/pp-schedule-<name>.png`` for gpipe, 1f1b, interleaved-1f1b (V chunks) and zb-h1
at P stages and M micro-batches (default 4 4 2) from schedule.simulate: a stage's forward costs
1 unit, its backward 2 (ZB-H1: B 1 + W 1), an interleaved chunk 1/V of those; transfers free.
Each title gives the simulated bubble and the formula, which agree for M >= P.
"""
from __future__ import annotations

import os
import sys

from shardwise.parallel.pipeline import schedule as sched
from shardwise.parallel.pipeline import timeline


def draw_ideal(name: str, p: int, m: int, v: int, path: str) -> str:
    """One schedule's ideal timeline (module docstring's costs) drawn to ``path``."""
    v = v if name == "interleaved-1f1b" else 1
    sim = sched.simulate(sched.build(name, p, m, v), 1.0 / v, 2.0 / v, t_w=1.0)
    shape = f"p={p}" + (f" v={v}" if v > 1 else "") + f" m={m}"
    title = (f"{name} {shape}, ideal: bubble {sim['bubble']:.3f} (formula "
             f"{sched.FORMULA[name]} = {sched.bubble_formula(p, m, name, v):.3f}); "
             f"blue F, green B, orange W, lighter: chunk 1")
    return timeline.draw(timeline.ideal_records(sim, 1e-3), path, title,
                         xlabel="time (a stage's forward = 1 unit, its backward = 2)")


def main(argv: list[str]) -> None:
    out = argv[0] if argv else "."
    p, m, v = (int(a) for a in (argv[1:4] if len(argv) >= 4 else (4, 4, 2)))
    for name in sched.NAMES:
        print(draw_ideal(name, p, m, v, os.path.join(out, f"pp-schedule-{name}.png")))


if __name__ == "__main__":
    main(sys.argv[1:])
