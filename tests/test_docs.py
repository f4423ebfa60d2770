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
