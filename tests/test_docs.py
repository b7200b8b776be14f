"""What the README and `make run` show: the Python snippet runs as written, and the plot is written like any file."""

import importlib.util
import os
import re
import stat
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_python_snippet_runs():
  (snippet,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
  names: dict = {}
  exec(compile(snippet, str(README), "exec"), names)  # pylint: disable=exec-used
  tokens, logits, config = names["tokens"], names["logits"], names["cfg"]
  assert logits.shape == (*tokens.shape, config.vocab_size) and logits.dtype == "float32"


def test_make_runs_plot_is_written_with_the_users_umask(tmp_path):
  spec = importlib.util.spec_from_file_location("flip", README.parent / "examples" / "linen_to_nnx_flip.py")
  flip = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(flip)
  records = [{"step": step, "loss": 2.0 - 0.1 * step} for step in range(4)]
  previous = os.umask(0o022)
  try:
    flip.save_plot(tmp_path / "loss.png", records, records, flip=2)
  finally:
    os.umask(previous)
  assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
  assert stat.S_IMODE((tmp_path / "loss.png").stat().st_mode) == 0o644
