"""The docs name what the code has: docs/architecture.md every module of the packages it maps,
docs/cli.md every environment variable; their links and citations resolve."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_architecture_names_every_module() -> None:
    named = set(re.findall(r"`(?:[\w/]+/)?(\w+\.py)`", (ROOT / "docs" / "architecture.md").read_text()))
    # kernels/ is mapped op by op (`kernels/<op>/{reference,cuda,triton}.py`), not module by module
    modules = {
        str(path.relative_to(ROOT))
        for top in ("server", "engine", "models")
        for path in (ROOT / top).rglob("*.py")
        if path.name != "__init__.py"
    }
    missing = sorted(m for m in modules if pathlib.Path(m).name not in named)
    assert not missing, f"docs/architecture.md does not name {missing}"


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif not in_code and (match := re.match(r"#{1,6} (.*)", line)):
            slug = _slug(match.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_markdown_links_resolve() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: outside the repository
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def _headings(path: pathlib.Path) -> list[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return [re.sub(r"[`*]", "", h).strip() for h in re.findall(r"^#{1,6} (.*)$", text, flags=re.M)]


def test_code_cites_measurements_by_a_section_that_exists() -> None:
    """A comment's citation of a docs page by section (`docs/<page>.md, "<section>"`) names the start of
    one of its headings, and one of the performance pages in parentheses names its section:
    performance.md keeps current results only and moves the rest to history/, so a bare citation
    of it, or of a section since moved, leads the reader nowhere."""
    cite = re.compile(r'docs/([\w/.-]+\.md)(?:, "([^"]+)"|\))')
    bad = []
    for path in sorted([*ROOT.rglob("*.py"), *ROOT.rglob("*.sh")]):
        if any(part.startswith(".") or part.endswith("venv") for part in path.relative_to(ROOT).parts):
            continue
        for page, section in cite.findall(path.read_text(errors="replace")):
            where = f"{path.relative_to(ROOT)}: docs/{page}"
            if not section:
                if "performance" in page:
                    bad.append(f"{where} (cited without its section)")
                continue
            section = re.sub(r"\s*\n\s*#?\s*", " ", section)  # a citation wrapped over comment lines
            target = ROOT / "docs" / page
            if not target.exists() or not any(h.startswith(section) for h in _headings(target)):
                bad.append(f'{where}, "{section}" (no such heading)')
    assert not bad, "\n".join(bad)


def test_cli_lists_every_environment_variable_the_code_reads() -> None:
    """docs/cli.md's table of environment variables has a row for each DELTASERVE_ variable the
    packages name, and no row for one they do not."""
    read = {
        name
        for top in ("deltaserve", "server", "engine", "models", "kernels")
        for path in (ROOT / top).rglob("*.py")
        for name in re.findall(r"\bDELTASERVE_[A-Z0-9_]+\b", path.read_text())
    }
    table = set(re.findall(r"^\| `(DELTASERVE_[A-Z0-9_]+)`", (ROOT / "docs" / "cli.md").read_text(), re.M))
    assert len(table) >= 10
    assert read == table, (
        f"read, not listed: {sorted(read - table)}; listed, not read: {sorted(table - read)}"
    )
