"""Import direction and import cost: the core never needs the converters, and configs never need JAX."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

MAXBRIDGE = Path(__file__).resolve().parent.parent / "maxbridge"


def _imports_of(node: ast.AST) -> set[str]:
  names = set()
  for child in ast.walk(node):
    if isinstance(child, ast.Import):
      names.update(alias.name.split(".")[0] for alias in child.names)
    elif isinstance(child, ast.ImportFrom) and child.level == 0:
      names.add(child.module.split(".")[0])
  return names


def test_no_core_module_imports_converters():
  # converters import maxbridge; the reverse would be a cycle. The command
  # line is the one exception: its convert and compare verbs are the
  # converters, imported inside those handlers only.
  offenders = []
  for file in sorted(MAXBRIDGE.rglob("*.py")):
    tree = ast.parse(file.read_text(), str(file))
    if file.parent == MAXBRIDGE / "cli":
      tree.body = [node for node in tree.body if not isinstance(node, ast.FunctionDef)]
    if "converters" in _imports_of(tree):
      offenders.append(str(file.relative_to(MAXBRIDGE.parent)))
  assert not offenders, f"these modules import converters: {offenders}"


def test_no_source_file_is_over_600_lines():
  # A room a reader can take in at once (ARCHITECTURE.md): a file that grows past this splits by what it holds.
  root = MAXBRIDGE.parent
  files = [*MAXBRIDGE.rglob("*.py"), *(root / "linen_models").rglob("*.py"), *(root / "nnx_models").rglob("*.py")]
  long = {str(f.relative_to(root)): n for f in files if (n := len(f.read_text().splitlines())) > 600}
  assert files and not long, f"over 600 lines: {long}"


def test_loading_a_checkpoint_from_the_core_does_not_load_converters():
  code = "import sys, maxbridge.interop.pretrained, maxbridge.core.checkpointing, maxbridge.training.loop; print('converters' in sys.modules)"
  assert _run(code) == "False"


def _run(code: str) -> str:
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_reading_a_config_does_not_import_jax():
  assert _run("import sys, maxbridge.core.config; print('jax' in sys.modules)") == "False"


@pytest.mark.parametrize("verb", ["train", "bench", "compile"])
def test_the_cli_rejects_a_bad_key_before_jax_starts(verb):
  code = (
      f"import sys; from maxbridge import cli; print(cli.main(['{verb}', 'llama-tiny', 'stepz=5']), 'jax' in sys.modules)"
  )
  assert _run(code) == "2 False"


def test_mb_train_stays_the_function_after_its_module_is_imported():
  # `mb.train` is the function, also once the module defining it has been imported.
  code = "import maxbridge as mb; from maxbridge.training.loop import run_directory; print(callable(mb.train), mb.train.__name__)"
  assert _run(code) == "True train"
