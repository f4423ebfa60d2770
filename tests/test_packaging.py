"""Every importable folder of the code is in the distribution (`pip install .`, not only -e)."""

from __future__ import annotations

import pathlib
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10 has no tomllib
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE = {"engine", "models", "kernels", "server", "deltaserve"}


@pytest.mark.slow
def test_every_subpackage_is_listed_in_pyproject():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages, dirs = set(config["packages"]), config["package-dir"]
    found = set()
    for init in ROOT.glob("*/**/__init__.py"):
        rel = init.parent.relative_to(ROOT)
        if rel.parts[0] in CODE:
            found.add("deltaserve" if rel.parts[0] == "deltaserve" else "deltaserve." + ".".join(rel.parts))
    assert found <= packages, f"missing from [tool.setuptools] packages: {sorted(found - packages)}"
    for pkg in packages:
        assert pkg in dirs and (ROOT / dirs[pkg] / "__init__.py").is_file(), pkg
