"""The README and the documentation site: a README a newcomer reads in minutes, starting with
the two commands; a site (mkdocs.yml, docs/) that builds strictly, with every page in its nav
and every command of the README's setups one the CLI has."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; at most 300 (the rest goes to docs/)"
    assert lines[0] == "# lmtier"
    body = [line for line in lines[1:] if line.strip()]
    assert body[0] == "```bash"
    assert body[1].startswith("make demo ") and body[2].startswith("make test ") and body[3] == "```"


def _nav_pages(nav) -> list[str]:
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += _nav_pages(value) if isinstance(value, list) else [value]
    return pages


def test_every_page_under_docs_is_in_the_nav_once():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["docs_dir"] == "docs"
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(nav) == pages, f"in the nav, not in docs/: {set(nav) - set(pages)}; left out: {set(pages) - set(nav)}"
    assert len(nav) == len(set(nav))
    # What strict mode fails on: a page left out, a broken link, a missing anchor.
    validation = config["validation"]
    assert validation["nav"]["omitted_files"] == "warn" and validation["nav"]["not_found"] == "warn"
    assert validation["links"]["not_found"] == "warn" and validation["links"]["anchors"] == "warn"


def test_the_site_builds_strictly(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "results" / "results.html").exists()


def test_no_wrapped_line_reads_as_a_heading():
    """A line that starts with `#` outside a code block is a heading to Markdown: a wrapped
    `#1234` (an issue number) would become one."""
    for path in [README, *(ROOT / "docs").rglob("*.md")]:
        fenced = False
        for number, line in enumerate(path.read_text().splitlines(), 1):
            fenced ^= line.lstrip().startswith("```")
            assert fenced or not re.match(r"#+[^#\s]", line), f"{path.relative_to(ROOT)}:{number}: {line}"


def test_the_readme_links_to_pages_that_exist():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert any(link.startswith("docs/") for link in links)
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing


def _help(*args: str) -> str:
    run = subprocess.run([sys.executable, "-m", "lmtier", *args, "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_the_commands_shown_use_subcommands_and_flags_the_cli_has():
    """Each `lmtier SUBCOMMAND --flag ...` in a code block of the README or a page of docs/ is a
    subcommand with that flag, and each `python -m lmtier...` module they name exists."""
    import importlib.util

    texts = {path.relative_to(ROOT).as_posix(): path.read_text() for path in [README, *(ROOT / "docs").glob("*.md")]}
    helps: dict[str, str] = {}
    for name, text in texts.items():
        blocks = "\n".join(re.findall(r"```(?:bash|console)\n(.*?)```", text, re.S))
        for sub, rest in re.findall(r"^(?:\$ )?lmtier (\w+)((?:.*\\\n)*.*)$", blocks, re.M):
            helps.setdefault(sub, _help(sub))
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", rest):
                assert flag in helps[sub], f"{name}: `lmtier {sub} {flag}`: no such flag"
        for module in re.findall(r"python -m (lmtier[\w.]*)", text):
            assert importlib.util.find_spec(module) is not None, f"{name}: python -m {module}"
    assert {"serve", "size", "keys", "match"} <= set(helps), sorted(helps)
