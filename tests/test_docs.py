"""docs/architecture.md, which says it maps every module, names every module of the packages it maps."""

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
