"""The README's Python snippet runs as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_python_snippet_runs():
  (snippet,) = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
  names: dict = {}
  exec(compile(snippet, str(README), "exec"), names)  # pylint: disable=exec-used
  tokens, logits, config = names["tokens"], names["logits"], names["cfg"]
  assert logits.shape == (*tokens.shape, config.vocab_size) and logits.dtype == "float32"
