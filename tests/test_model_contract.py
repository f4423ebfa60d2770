"""The engine's backends and forward context satisfy the Protocols of `models/forward.py`, and the
models call them as the Protocols say: checked by mypy over a copy of the code laid out as the
installed package (`deltaserve/engine`, ...), where `deltaserve.*` imports resolve to real types.

The repository's own `mypy` run sees the folders as top-level `engine`, `models`, ..., so its
`deltaserve.*` imports resolve to nothing (Any) and a backend could drift from the Protocol
unseen; this test closes that gap for the contract."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# the engine side of the contract, assigned to the models' Protocols
PROBE = """
from deltaserve.engine.runner.attention_backend import AttentionBackend
from deltaserve.engine.runner.linear_backend import LinearAttentionBackend
from deltaserve.engine.runner.model_runner import LayerBackends
from deltaserve.models.forward import AttentionOps, ForwardContext, LinearOps


def check(ctx: LayerBackends, attn: AttentionBackend, linear: LinearAttentionBackend) -> None:
    _ctx: ForwardContext = ctx
    _attn: AttentionOps = attn
    _linear: LinearOps = linear
"""

CHECKED = [
    "probe.py",
    "deltaserve/models",
    "deltaserve/engine/runner/attention_backend.py",
    "deltaserve/engine/runner/linear_backend.py",
    "deltaserve/engine/runner/model_runner.py",
]


def package_copy(dst: pathlib.Path) -> pathlib.Path:
    """The four folders under `dst/deltaserve/`, as pyproject maps them, plus the probe."""
    shutil.copytree(ROOT / "deltaserve", dst / "deltaserve", ignore=shutil.ignore_patterns("__pycache__"))
    for top in ("engine", "models", "kernels", "server"):
        shutil.copytree(ROOT / top, dst / "deltaserve" / top, ignore=shutil.ignore_patterns("__pycache__"))
    (dst / "probe.py").write_text(PROBE)
    return dst


def mypy(root: pathlib.Path) -> subprocess.CompletedProcess[str]:
    args = ["--python-version", "3.11", "--ignore-missing-imports", "--follow-imports", "silent"]
    args += ["--cache-dir", str(root / ".mypy_cache")]
    return subprocess.run(
        [sys.executable, "-m", "mypy", *args, *CHECKED],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )


def edit(path: pathlib.Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{path}: {old!r} not found"
    path.write_text(text.replace(old, new, 1))


@pytest.mark.slow
def test_backends_and_models_keep_to_the_contract(tmp_path):
    root = package_copy(tmp_path)
    proc = mypy(root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the same check fails when a backend's op and a model's call leave the contract
    edit(
        root / "deltaserve/engine/runner/linear_backend.py",
        "        g: torch.Tensor,\n        beta: torch.Tensor,\n    ) -> torch.Tensor:\n",
        "        g: torch.Tensor,\n    ) -> torch.Tensor:\n        beta = g\n",
    )
    edit(root / "deltaserve/models/layers/mla.py", "self.v_head_dim, self.scale\n", "self.v_head_dim\n")
    proc = mypy(root)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert 'Signature of "kda" incompatible with supertype' in proc.stdout, proc.stdout
    assert 'Missing positional argument "scale" in call to "mla_attention"' in proc.stdout, proc.stdout
