"""The package's modules import in any order, engine/ and models/ have no import cycles, and the
imports run one way (models/ and kernels/ import nothing of the engine or the server).

A cycle hidden by a lazy import or a TYPE_CHECKING block still ties two modules into one (neither
can be read, moved or tested without the other), so the scan counts every import statement of
a module, wherever it stands."""

from __future__ import annotations

import ast
import pathlib
import random
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE = ("deltaserve", "engine", "models", "kernels", "server")


def module_files(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Every module of the package by its import name (`engine/cache/kv_pool.py` is
    `deltaserve.engine.cache.kv_pool`, as pyproject maps the folders)."""
    mods = {}
    for top in CODE:
        for path in sorted((root / top).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            if parts[0] != "deltaserve":
                parts.insert(0, "deltaserve")
            mods[".".join(parts)] = path
    return mods


def imports_of(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    """The package's modules that `name` imports anywhere: at the top, in a TYPE_CHECKING block
    or inside a function. `from pkg import sub` counts as importing `pkg.sub`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in mods}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from .x import y` in package p is p.x
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in mods:
                    found.add(sub)
                elif base in mods:
                    found.add(base)
    found.discard(name)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_scan_finds_a_cycle_through_a_lazy_import(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text("from deltaserve.engine.b import f\n")
    (tmp_path / "engine" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from deltaserve.engine import c\n"
    )
    (tmp_path / "engine" / "c.py").write_text("def g():\n    from deltaserve.engine import a\n")
    for top in CODE[:1] + CODE[2:]:
        (tmp_path / top).mkdir()
    mods = module_files(tmp_path)
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    assert cycles(graph) == [["deltaserve.engine.a", "deltaserve.engine.b", "deltaserve.engine.c"]]


@pytest.mark.slow
def test_engine_has_no_import_cycles():
    mods = module_files()
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    assert "deltaserve.engine.sampling.sampler" in graph["deltaserve.engine.parts"]  # the scan sees imports
    in_engine = [c for c in cycles(graph) if any(m.startswith("deltaserve.engine.") for m in c)]
    assert in_engine == []


def test_models_have_no_import_cycles():
    mods = module_files()
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    assert "deltaserve.models.checkpoints.quantization" in graph["deltaserve.models.checkpoints.loader"]
    in_models = [c for c in cycles(graph) if any(m.startswith("deltaserve.models.") for m in c)]
    assert in_models == []


def layering_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs against `server -> engine -> models -> kernels`: models/ and
    kernels/ import neither the engine nor the server (the contract lives in models/forward.py),
    and kernels/ import no model."""
    forbidden = {
        "deltaserve.models": ("deltaserve.engine", "deltaserve.server"),
        "deltaserve.kernels": ("deltaserve.engine", "deltaserve.server", "deltaserve.models"),
    }
    found = []
    for name, imported in sorted(graph.items()):
        for layer, above in forbidden.items():
            if name == layer or name.startswith(layer + "."):
                bad = [m for m in imported if any(m == a or m.startswith(a + ".") for a in above)]
                found += [(name, m) for m in sorted(bad)]
    return found


def test_layering_scan_finds_an_engine_import_under_type_checking(tmp_path):
    for top in CODE:
        (tmp_path / top).mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "ctx.py").write_text("class ForwardContext: ...\n")
    (tmp_path / "kernels" / "op.py").write_text("def f():\n    from deltaserve.engine import ctx\n")
    (tmp_path / "models" / "layer.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from deltaserve.engine.ctx import ForwardContext\n"
    )
    (tmp_path / "models" / "fine.py").write_text("from deltaserve.kernels.op import f\n")
    mods = module_files(tmp_path)
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    assert layering_violations(graph) == [
        ("deltaserve.kernels.op", "deltaserve.engine.ctx"),
        ("deltaserve.models.layer", "deltaserve.engine.ctx"),
    ]


@pytest.mark.slow
def test_models_and_kernels_import_nothing_of_the_engine_or_server():
    mods = module_files()
    graph = {name: imports_of(name, path, mods) for name, path in mods.items()}
    assert "deltaserve.models.forward" in graph["deltaserve.models.layers.attention"]  # the scan sees imports
    assert layering_violations(graph) == []


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_module_imports_in_a_shuffled_order(seed):
    """All modules imported in a fresh interpreter in a shuffled order: a module that works
    only when something else was imported before it, or a cycle live at import, fails here."""
    names = sorted(module_files())
    names.remove("deltaserve.__main__")  # runs the CLI
    random.Random(seed).shuffle(names)
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"importing in the order {names}: {proc.stderr[-2000:]}"
