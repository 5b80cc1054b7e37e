"""The README and docs/ hold together: every relative link in README.md and docs/*.md points to a file of the
repository (and, with ``#anchor``, to a heading of that page, as GitHub spells anchors); the README stays a
five-minute read and keeps the test command CI runs (``.ci/run`` reads the line after its marker)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
TEST_COMMAND = 'pip install torch==2.13.0 && pip install -e ".[test,docs]" && ruff check . && NO_MKDOCS_2_WARNING=1 mkdocs build --strict -d /tmp/finetune-site && python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=25'


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of ``page``: lower case, punctuation but ``-``/``_`` dropped, spaces to ``-``."""
    found = set()
    in_code = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        if not in_code and re.match(r"^#{1,6} ", line):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def links(page: Path) -> list[str]:
    """The relative links of ``page`` (not http(s), mailto or in indented code blocks)."""
    text = "\n".join(line for line in page.read_text().splitlines() if not line.startswith("    "))
    return [target for target in LINK.findall(text) if not re.match(r"^[a-z]+:", target)]


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file, or heading, does not exist; each with why."""
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page):
    assert not broken_links(page)


def test_the_link_check_catches_a_broken_link(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title: `x`\n\n[ok](page.md#a-title-x) [missing](nowhere.md) [bad](page.md#nope)\n"
                    "    [in code](skipped.md)\n")
    assert links(page) == ["page.md#a-title-x", "nowhere.md", "page.md#nope"]
    assert [line.split(":")[0] for line in broken_links(page)] == ["nowhere.md", "page.md#nope"]


FIGURE = re.compile(r"(?<![\w.\-/])\d+(?:[.,]\d+)*(?!\w)")  # a number standing alone (not SmolLM2, L6, step_N)


def test_the_readme_is_a_front_door_and_keeps_the_ci_test_command():
    """At most 150 lines; clone and the main job in the first 15; at most 10 figures in the first 40 (measurements
    live in docs/); no bullet over 3 lines; the test command CI runs after its marker; the pages it must link."""
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 150, len(lines)
    first = "\n".join(lines[:15])
    assert "git clone" in first and "finetune train --recipe bbc-news" in first
    figures = FIGURE.findall("\n".join(lines[:40]))
    assert len(figures) <= 10, figures
    bullets, length = [], 0
    for line in lines + [""]:
        if line.startswith("- "):
            bullets.append(length)
            length = 1
        elif line.startswith("  ") and length:
            length += 1
        else:
            bullets.append(length)
            length = 0
    assert max(bullets) <= 3
    marker = lines.index("<!-- test-command -->")
    assert lines[marker + 1] == f"    {TEST_COMMAND}"
    for page in ("contributing.md", "flags.md", "recipes.md", "resume.md", "multi-node.md"):
        assert f"(docs/{page})" in text, page


def test_the_figure_count_sees_figures():
    assert FIGURE.findall("accuracy 0.9742 at 278 s, 1,701 rows; SmolLM2 L6 step_3 x2") == ["0.9742", "278", "1,701"]


def runnable_blocks(text: str) -> list[str]:
    """The indented code blocks that follow a ``<!-- runnable -->`` line, one command per line."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() == "<!-- runnable -->":
            block = []
            for following in lines[i + 1:]:
                if not following.startswith("    "):
                    break
                block.append(following[4:])
            blocks.append("\n".join(block))
    return blocks


def test_the_readmes_runnable_commands_run_offline(tmp_path):
    import os
    import subprocess

    blocks = runnable_blocks((REPO / "README.md").read_text())
    assert blocks
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for block in blocks:
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], capture_output=True, text=True, cwd=REPO,
                                env=env, timeout=300)
        assert result.returncode == 0, (block, result.stderr[-2000:])


def test_the_recipe_table_is_one_table():
    """README.md and docs/recipes.md show the same recipe table, and it names every registered recipe."""
    from finetune.recipes import RECIPES

    def table(page):
        return page.read_text().split("<!-- recipe-table -->\n")[1].split("<!-- end recipe-table -->")[0]

    ours = table(REPO / "README.md")
    assert ours == table(REPO / "docs" / "recipes.md")
    assert all(f"`{name}`" in ours for name in RECIPES)


def test_the_verify_page_shows_the_threshold_line():
    """The verdict line with the sizes verify's small controls claim (``verify.SMALL_CONTROLS``), as it prints it
    (``verify.detects_line``), not a paraphrase."""
    from finetune.commands import verify

    detects = [{"target": target, "threshold": size} for target, size in verify.SMALL_CONTROLS]
    text = " ".join((REPO / "docs" / "verify.md").read_text().split())
    assert f"**Verdict: exact: {verify.detects_line(detects)}**" in text


def test_the_flag_reference_is_generated_and_current():
    """docs/flags.md's table is ``finetune.config.reference.flags_table()``: every training flag has its row, as the
    configuration gives it; a removed or stale row is named (the check's own mutant: one row taken out)."""
    from finetune.config.reference import stale_rows

    page = (REPO / "docs" / "flags.md").read_text()
    assert stale_rows(page) == [], "regenerate: python -m finetune.config.reference (below docs/flags.md's marker)"
    without = "\n".join(line for line in page.splitlines() if not line.startswith("| `--dataset_name`"))
    assert stale_rows(without) == ["--dataset_name"]
    assert stale_rows(page.replace("| `--lora_r` | LoRA adapters (peft) | `16` |", "| `--lora_r` | LoRA adapters (peft) | `8` |")) \
        == ["--lora_r"]


def test_the_site_builds_strict_and_fails_on_a_broken_link(tmp_path):
    """``mkdocs build --strict`` (CI runs it) passes on docs/ as it is, and fails on a copy with one broken link, or
    with one page left out of the navigation."""
    import os
    import shutil
    import subprocess

    pytest.importorskip("mkdocs")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}

    def build(root: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                              capture_output=True, text=True, cwd=root, env=env, timeout=300)

    assert build(REPO).returncode == 0
    for name, change in (("link", lambda d: (d / "docs" / "plan.md").write_text(
                             (d / "docs" / "plan.md").read_text() + "\n[gone](no-such-page.md)\n")),
                         ("nav", lambda d: (d / "docs" / "extra.md").write_text("# Not in the navigation\n"))):
        copy = tmp_path / name
        shutil.copytree(REPO / "docs", copy / "docs")
        shutil.copy(REPO / "mkdocs.yml", copy / "mkdocs.yml")
        change(copy)
        result = build(copy)
        assert result.returncode != 0, name
        assert ("no-such-page.md" if name == "link" else "extra.md") in result.stdout + result.stderr


def test_the_docs_are_at_most_22_pages():
    assert len(list((REPO / "docs").glob("*.md"))) <= 22
