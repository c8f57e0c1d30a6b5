"""Words a user understands: no numbered source-note reference anywhere a user or a reader sees.

The project's source notes were once cited by their file numbers (seed, a space, then three
digits from 000), which mean nothing outside the repository. Each is now named for what it is
(the strategy guide, LeNet (LeCun et al. 1998), Dive into Deep Learning's multi-GPU chapter,
...). This scans the package (code, docstrings, help texts, printed text), the tests, the
examples, the README and the docs, and names every offending line. The examples below are
built from pieces so that this file holds no hit itself.
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
# "seed" or "seeds", an optional space / underscore / hyphen, then 0NN: a note's number, not a
# random seed's value (those are written --seed N / seed=N, never with a leading zero).
NUMBERED = re.compile(r"\bseeds?[ _-]?0\d\d\b", re.IGNORECASE)
PLACES = ["shardwise", "tests", "examples", "docs", "README.md"]
SUFFIXES = {".py", ".md", ".txt", ".toml", ".yml", ".yaml"}
NOTE = "0" + "01"                      # a note's number, spelled so that this file is clean


def files():
    for place in PLACES:
        path = ROOT / place
        if path.is_file():
            yield path
        elif path.is_dir():
            yield from (p for p in sorted(path.rglob("*"))
                        if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts)


def offending_lines() -> list[str]:
    found = []
    for path in files():
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if NUMBERED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return found


def test_the_pattern_catches_every_spelling_and_spares_real_seeds():
    for text in (f"seed {NOTE}", f"Seed {NOTE}'s LeNet", f"Guide (seed {NOTE}): one node",
                 f"seed{NOTE}", f"seed_{NOTE}", f"(seeds {NOTE})", f"SEED-{NOTE}"):
        assert NUMBERED.search(text), text
    for text in ("--seed 0", "seed=42", "seeds differ per rank", "seed 10", f"seed {NOTE}1",
                 "manual_seed(0)"):
        assert not NUMBERED.search(text), text


def test_no_numbered_seed_references():
    found = offending_lines()
    assert not found, ("numbered source-note references a user cannot read; name what each "
                       "stands for (e.g. 'the strategy guide'):\n" + "\n".join(found))
