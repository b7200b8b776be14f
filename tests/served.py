"""A model folder and a `maxbridge serve` subprocess, as the serving tests (test_serve, test_eval_harness) use them.

The model is llama-tiny with random weights, written as a Hugging Face folder
with a word-level tokenizer (w0..w255, one word per token, so text and tokens
map one to one and equal text means equal tokens) and a chat template.
"""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import tokenizers

from maxbridge.interop.hf import folders
from maxbridge.models import dispatch
from conftest import tiny_config

TEMPLATE = "{% for m in messages %}w1 {{ m.content }} w2 {% endfor %}{% if add_generation_prompt %}w3{% endif %}"
MODEL = "llama-tiny-hf"  # the folder's name, the served model's


def write_folder(parent):
  """llama-tiny's random weights, its word-level tokenizer and chat template, as `parent/MODEL`."""
  path = parent / MODEL
  model = dispatch.create_model(tiny_config())
  folders.save_hf(model.params(), model.config, path)
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
  tokenizer.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
  return path


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def get(url: str) -> tuple[int, str]:
  try:
    with urllib.request.urlopen(url, timeout=10) as response:
      return response.status, response.read().decode()
  except urllib.error.HTTPError as e:
    return e.code, e.read().decode()


class Server:
  """`maxbridge serve folder --backend backend *args` on a free port, up (its /health answers 200)."""

  def __init__(self, folder, backend: str, *args: str):
    self.port = free_port()
    self.url = f"http://127.0.0.1:{self.port}"
    argv = [sys.executable, "-m", "maxbridge.cli", "serve", str(folder), "--backend", backend, "--port", str(self.port)]
    self.process = subprocess.Popen([*argv, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
      if self.process.poll() is not None:
        raise RuntimeError(f"the server exited {self.process.returncode}: {self.process.stdout.read()}")
      try:
        if get(self.url + "/health")[0] == 200:
          break
      except OSError:
        time.sleep(0.2)
    else:
      raise TimeoutError("the server did not come up in 120 s")

  def stop(self):
    if self.process.poll() is None:
      self.process.kill()
      self.process.wait()
