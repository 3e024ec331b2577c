"""The front page and the manual stay true: links resolve, and the loops on README.md run.

Every relative link and ``#anchor`` in README.md, docs/*.md and
benchmarks/README.md must name an existing file and, for a Markdown file, one
of its headings, with GitHub's anchor rules. Every ```python block on the front page must follow an
``<!-- example: ... -->`` comment and is run as written, in one process and
on 2 ring ranks.
"""

import glob
import os
import re
from urllib.parse import unquote

import pytest

from launch import ROOT, run_script

PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
#: Checked for links too: the benchmarks' page links back into the manual.
LINKED = [*PAGES, os.path.join(ROOT, "benchmarks", "README.md")]
LINK = re.compile(r"(?<!\!)\[(?:[^\]\\]|\\.)*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lowercase, punctuation but - and _ dropped, spaces to -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: str) -> set:
    """Every anchor the headings of a Markdown file give, duplicates numbered -1, -2, ..."""
    seen, result, fenced = {}, set(), False
    for line in open(path, encoding="utf-8").read().splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            result.add(base if n == 0 else f"{base}-{n}")
    return result


def test_slug_follows_githubs_rules():
    assert slug("Sharding the parameters too: `fully_shard`") == "sharding-the-parameters-too-fully_shard"
    assert slug("Fully sharded training (`--mode fully_shard`)") == "fully-sharded-training---mode-fully_shard"
    assert slug("Will it fit? The memory planner") == "will-it-fit-the-memory-planner"
    assert slug("`mlx.launch` exits with 0 even when a rank failed") == "mlxlaunch-exits-with-0-even-when-a-rank-failed"


def test_duplicate_headings_are_numbered(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("# A\n## Notes\n```\n# not a heading\n```\n## Notes\n### Notes\n")
    assert anchors(str(page)) == {"a", "notes", "notes-1", "notes-2"}


@pytest.mark.parametrize("page", LINKED, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_relative_link_and_anchor_resolves(page):
    broken = []
    for target in LINK.findall(prose(open(page, encoding="utf-8").read())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = unquote(target).partition("#")
        file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        if not os.path.exists(file):
            broken.append(f"{target}: no file {os.path.relpath(file, ROOT)}")
        elif anchor and file.endswith(".md") and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {os.path.relpath(file, ROOT)}")
    assert not broken, f"{os.path.relpath(page, ROOT)}:\n" + "\n".join(broken)


def test_the_manual_is_linked_from_the_front_page():
    front = open(PAGES[0], encoding="utf-8").read()
    for page in PAGES[1:]:
        assert f"(docs/{os.path.basename(page)}" in front, f"README.md does not link {page}"


def examples():
    """The ```python blocks of README.md, each with the example marker before it."""
    text = open(PAGES[0], encoding="utf-8").read()
    blocks = re.findall(r"((?:<!-- example:[^>]*-->\n)?)```python\n(.*?)^```", text, re.S | re.M)
    unmarked = [code.splitlines()[0] for marker, code in blocks if not marker]
    assert not unmarked, f"README.md has Python blocks without <!-- example: ... -->: {unmarked}"
    return [code for _, code in blocks]


def test_the_front_page_has_a_loop_for_each_mode():
    codes = examples()
    assert len(codes) == 3
    assert any("fsdp_step" in c and "fully_shard" not in c for c in codes)
    assert any("ddp_step" in c for c in codes)
    assert any("fully_shard" in c for c in codes)


def losses(out: str):
    return [float(v) for v in re.findall(r"^step \d+: loss (\S+),", out, re.M)]


@pytest.mark.parametrize("index", range(3))
def test_front_page_loops_run_at_one_and_two_ranks(index, tmp_path):
    code = examples()[index]
    script = tmp_path / "loop.py"
    script.write_text(code)
    one = losses(run_script(1, str(script), cwd=str(tmp_path), timeout=60))
    # Through mlx.launch, as the front page starts it.
    two = losses(run_script(2, str(script), cwd=str(tmp_path), timeout=90, mlx_launch=True))
    assert len(one) == len(two) >= 2, (one, two)
    assert one[-1] < one[0] / 10, f"the loss did not fall: {one}"
    assert two[0] == pytest.approx(one[0], rel=1e-5), (one, two)  # the same first step at N=1 and N=2
    assert two[-1] < two[0] / 10, f"the loss did not fall at N=2: {two}"
