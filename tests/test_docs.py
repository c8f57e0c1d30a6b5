"""The docs: every generated block equals what its source generates today (measured figures from
result JSON, the CLI reference from the parsers), and a changed number is caught.

``python scripts/gen_docs.py`` rewrites the blocks; ``--check`` (this test, and CI through it)
fails naming each block that differs. ``mkdocs build --strict`` (broken links, pages missing from
the navigation) runs in .ci/run, where the docs extra is installed.
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import gen_docs  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_every_generated_block_matches_its_source():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "gen_docs.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def _pages_with(kind: str) -> list[str]:
    return [p for p in gen_docs.pages() if f"<!-- generated: {kind}" in open(p).read()]


MEASURED = ["bench-table", "gpu-table", "bench-rows", "json-table", "ps-rows", "bubble",
            "planner-steps", "planner-categories", "product-ceiling",
            "compile-ceiling", "compile-split"]


@pytest.mark.parametrize("kind", MEASURED)
def test_a_changed_figure_is_caught(tmp_path, kind):
    """Change one number in a measured table: the check names that block."""
    pages = _pages_with(kind)
    assert pages, f"no page carries a generated {kind} block"
    text = open(pages[0]).read()
    block = gen_docs.BLOCK.search(text[text.index(f"<!-- generated: {kind}"):])
    number = re.search(r"\d[\d,]*\.\d+|\d{2,}", block.group("body"))
    body = block.group("body")
    changed = body[:number.start()] + str(int(number.group().replace(",", "")[0]) % 9 + 1) + \
        body[number.start() + 1:]
    assert changed != body
    page = tmp_path / "page.md"
    page.write_text(text.replace(body, changed, 1))
    assert gen_docs.process(str(page), check=True), "a changed figure went unnoticed"
    page.write_text(text)
    assert not gen_docs.process(str(page), check=True)


@pytest.mark.parametrize("kind", MEASURED[2:])
def test_a_measured_block_says_where_its_json_ran(kind):
    """Each concept page's measured table ends with its files' date, commit, dirty flag and
    machine ("not recorded" where an old JSON lacks one)."""
    pages = _pages_with(kind)
    assert pages, f"no page carries a generated {kind} block"
    for page in pages:
        text = open(page).read()
        for m in gen_docs.BLOCK.finditer(text):
            if m.group("spec").split()[0] == kind:
                tail = m.group("body").rstrip().rsplit("\n", 1)[-1]
                assert tail.startswith("Generated from `") and "commit " in tail, tail
                assert "uncommitted changes " in tail, tail
                assert "CPUs" in tail or "machine not recorded" in tail, tail


def test_a_changed_inline_figure_is_caught(tmp_path):
    """A figure inside a sentence (<!-- value: FILE KEY FORMAT -->) is checked like a table."""
    pages = [p for p in gen_docs.pages() if "<!-- value: " in open(p).read()]
    assert pages, "no page carries an inline value"
    for path in pages:
        text = open(path).read()
        m = gen_docs.VALUE.search(text)
        digit = re.search(r"\d", m.group("body"))
        body = m.group("body")
        changed = body[:digit.start()] + str(int(digit.group()) % 9 + 1) + body[digit.start() + 1:]
        page = tmp_path / "page.md"
        page.write_text(text[:m.start("body")] + changed + text[m.end("body"):])
        assert gen_docs.process(str(page), check=True), f"{path}: a changed figure went unnoticed"
        page.write_text(text)
        assert not gen_docs.process(str(page), check=True)
