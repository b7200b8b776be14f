"""The import contracts of ARCHITECTURE.md hold, and `make lint`'s check of them fails on a break."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("maxbridge", "linen_models", "nnx_models", "converters")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
  # A fresh process whose import path starts at `root`: grimp reads the packages found there.
  code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True))"
  return subprocess.run(
      [sys.executable, "-c", code], cwd=root, env={"PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=120
  )


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
  """A copy of the packages and their contracts, to break."""
  root = tmp_path_factory.mktemp("tree")
  for package in PACKAGES:
    shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "configs"))
  shutil.copy(ROOT / "pyproject.toml", root)
  return root


def _with_import(tree: Path, module: str, line: str, tmp_path: Path) -> Path:
  copy = tmp_path / "broken"
  shutil.copytree(tree, copy)
  path = copy / (module.replace(".", "/") + ".py")
  path.write_text(path.read_text() + f"\n\ndef _added():\n  {line}\n")
  return copy


def test_the_tree_keeps_every_contract(tree):
  result = _lint_imports(tree)
  assert result.returncode == 0, result.stdout + result.stderr
  for contract in ("Layers", "never import each other", "No import cycles"):
    assert any(contract in line and "KEPT" in line for line in result.stdout.splitlines()), result.stdout


@pytest.mark.parametrize(
    "module, line, broken",
    [
        # Up a layer, from inside a function (such imports count).
        ("maxbridge.core.files", "from maxbridge.training import loop", "Layers"),
        ("maxbridge.models.dispatch", "from maxbridge.serving import engine", "Layers"),
        # One backend's model package reaching into the other's.
        ("linen_models.llama", "from nnx_models import llama", "never import each other"),
        # A cycle inside one layer: config imports files.
        ("maxbridge.core.files", "from maxbridge.core import config", "No import cycles"),
    ],
)
def test_a_broken_contract_fails_the_check_naming_it(tree, tmp_path, module, line, broken):
  result = _lint_imports(_with_import(tree, module, line, tmp_path))
  assert result.returncode != 0
  assert any(broken in line and "BROKEN" in line for line in result.stdout.splitlines()), result.stdout
