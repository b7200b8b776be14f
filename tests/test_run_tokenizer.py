"""A run trained with `tokenizer_path` keeps its tokenizer, and every reader of the model uses it (issue #46).

generate, serve's codec, `mb.Engine.from_pretrained`, export-hf and import-hf read the copy in the run folder;
a `tokenizer_path=` override is used (or refused when its ids do not fit); a model without a tokenizer warns
once, naming the byte fallback; a resume with other tokenizer files is refused naming the file.
"""

import argparse
import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest

import maxbridge as mb
from maxbridge import cli
from maxbridge.cli import serving
from maxbridge.core import checkpointing
from maxbridge.core.config import ConfigError, load_config
from maxbridge.interop import pretrained
from maxbridge.training import hooks, loop, recipe

tokenizers = pytest.importorskip("tokenizers")

WORDS = ["<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "and", "slept"]
TEMPLATE = "{% for m in messages %}<s> {{ m.content }} </s>{% endfor %}"
PROMPT = "the cat sat"  # ids 3 4 5 in the run's tokenizer


def _word_tokenizer(folder: Path, words: list[str]) -> Path:
  folder.mkdir(parents=True, exist_ok=True)
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
  tokenizer.save(str(folder / "tokenizer.json"))
  return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(overrides, trainer, the run folder, the run's tokenizer folder, another tokenizer's) after 2 steps."""
  root = tmp_path_factory.mktemp("run-tokenizer")
  tok = _word_tokenizer(root / "my_tok", WORDS)
  (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": TEMPLATE}))
  other = _word_tokenizer(root / "other_tok", [f"w{i}" for i in range(256)])
  rng = np.random.default_rng(0)
  docs = [" ".join(rng.choice(WORDS[3:], rng.integers(3, 20))) for _ in range(60)]
  (root / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  overrides = dict(
      dataset_type="grain",
      grain_train_files=str(root / "docs.jsonl"),
      tokenizer_path=str(tok),
      add_bos=False,
      add_eos=False,
      max_target_length=32,
      max_prefill_predict_length=16,
      per_device_batch_size=2,
      steps=2,
      checkpoint_period=2,
      eval_interval=0,
      base_output_directory=str(root / "runs"),
  )
  trainer = recipe.create_trainer(load_config("llama-tiny", **overrides))
  loop.train(load_config("llama-tiny", **overrides, run_name="mine"), trainer=trainer, progress=False)
  return overrides, trainer, root / "runs" / "mine", tok, other


def _generate(capsys, source, *extra) -> list[str]:
  capsys.readouterr()
  assert cli.main(["generate", str(source), "--prompt", extra[0], "--max-new-tokens", "3", *extra[1:]]) == 0
  return capsys.readouterr().out.split()


def test_the_run_folder_holds_its_tokenizer(setup):
  _, _, run_dir, tok, _ = setup
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (run_dir / name).read_bytes() == (tok / name).read_bytes(), name


def test_generate_and_the_engine_use_the_runs_tokenizer_and_an_override_is_used_or_refused(setup, capsys):
  _, _, run_dir, tok, other = setup
  with warnings.catch_warnings():
    warnings.filterwarnings("error", ".*byte fallback")  # the run has its tokenizer: no byte-fallback warning
    words = _generate(capsys, run_dir, PROMPT)
    engine = mb.Engine.from_pretrained(run_dir)
  assert engine.tokenizer.folder == run_dir and engine.tokenizer.encode(PROMPT) == [3, 4, 5]
  model = mb.from_pretrained(run_dir)
  want = [int(t) for t in model.generate(np.array([3, 4, 5]), max_new_tokens=3)]
  assert want[:3] == [3, 4, 5]
  assert words == engine.tokenizer.decode(want).split()  # the prompt as 3 of its words, not 11 bytes
  # tokenizer_path= on the command line is used: its words for the same ids.
  assert _generate(capsys, run_dir, "w3 w4 w5", f"tokenizer_path={other}") == [f"w{t}" for t in want]
  assert mb.Engine.from_pretrained(run_dir, tokenizer_path=str(other)).tokenizer.encode("w7 w200") == [7, 200]
  # ... or refused, naming it, when its ids do not fit the model's vocab_size.
  big = _word_tokenizer(tok.parent / "big_tok", [f"b{i}" for i in range(300)])
  assert cli.main(["generate", str(run_dir), "--prompt", "b1", f"tokenizer_path={big}"]) == 2
  err = capsys.readouterr().err
  assert f"tokenizer_path={str(big)!r}" in err and "makes token ids up to 299" in err, err


def test_serve_encodes_with_the_runs_tokenizer_and_chat_template(setup):
  _, _, run_dir, _, other = setup
  args = argparse.Namespace(source=str(run_dir), overrides=[])
  codec = serving.serve_codec(args, serving.model_tokenizer(args, 256))
  assert codec.encode("the dog ran") == [3, 9, 10] and codec.decode([3, 9, 10]) == "the dog ran"
  assert codec.chat_template == TEMPLATE and codec.tokenizer_class == "PreTrainedTokenizerFast"
  args = argparse.Namespace(source=str(run_dir), overrides=[f"tokenizer_path={other}"])
  assert serving.serve_codec(args, serving.model_tokenizer(args, 256)).encode("w3 w250") == [3, 250]


def test_the_served_codec_adds_the_tokenizers_bos_unless_told_not_to(tmp_path):
  # lm-evaluation-harness tokenizes a context and its continuation on the server with add_special_tokens false.
  folder = _word_tokenizer(tmp_path / "bos", WORDS)
  tokenizer = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
  tokenizer.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
  tokenizer.save(str(folder / "tokenizer.json"))
  args = argparse.Namespace(source=str(folder), overrides=[])
  codec = serving.serve_codec(args, serving.model_tokenizer(args, 256))
  assert codec.encode("the dog") == [1, 3, 9] and codec.encode("the dog", add_special_tokens=False) == [3, 9]
  assert codec.token_strs([1, 3, 9]) == ["<s>", "the", "dog"]
  assert pretrained.TextTokenizer().token_strs([104, 233]) == ["h", "é"]  # bytes: one Latin-1 character each


def test_export_hf_and_import_hf_carry_the_tokenizer(setup, tmp_path):
  _, _, run_dir, tok, _ = setup
  assert cli.main(["export-hf", str(run_dir), str(tmp_path / "hf")]) == 0
  for name in ("tokenizer.json", "tokenizer_config.json"):
    assert (tmp_path / "hf" / name).read_bytes() == (tok / name).read_bytes(), name
  assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
  assert pretrained.model_tokenizer(tmp_path / "back", 256).encode("the mat") == [3, 8]


def test_serve_and_generate_on_an_imported_folder_use_its_tokenizer(setup, tmp_path, capsys):
  # A Hugging Face folder with a tokenizer (export-hf's, here), imported: the checkpoint keeps the same files.
  _, _, run_dir, tok, _ = setup
  assert cli.main(["export-hf", str(run_dir), str(tmp_path / "hf")]) == 0
  assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
  prints = hooks.tokenizer_fingerprint(tmp_path / "imported")
  assert {name: prints.get(name) for name in ("tokenizer.json", "tokenizer_config.json")} == hooks.tokenizer_fingerprint(
      tok
  )
  args = argparse.Namespace(source=str(tmp_path / "imported"), overrides=[])
  codec = serving.serve_codec(args, serving.model_tokenizer(args, 256))
  assert codec.encode("the dog ran") == [3, 9, 10] and codec.chat_template == TEMPLATE
  words = _generate(capsys, tmp_path / "imported", PROMPT, "--backend", "nnx")
  assert words[:3] == PROMPT.split() and set(words) <= set(WORDS), words  # the run's words, not bytes
  assert words == _generate(capsys, run_dir, PROMPT, "--backend", "nnx")


def test_a_model_without_a_tokenizer_warns_once_naming_the_byte_fallback(setup, tmp_path):
  _, _, run_dir, _, _ = setup
  plain = tmp_path / "plain"
  shutil.copytree(run_dir, plain, ignore=shutil.ignore_patterns("tokenizer*"))
  with pytest.warns(UserWarning) as seen:
    engine = mb.Engine.from_pretrained(plain)
  fallback = [w for w in seen if "byte fallback" in str(w.message)]
  assert len(fallback) == 1 and str(plain) in str(fallback[0].message)
  assert engine.tokenizer.encode("hi") == [104, 105] and engine.tokenizer.folder is None
  # tokenizer_path= (empty) asks for bytes: no warning.
  with warnings.catch_warnings():
    warnings.filterwarnings("error", ".*byte fallback")
    assert pretrained.model_tokenizer(plain, 256, "").decode([104, 105]) == "hi"


def test_a_resume_with_other_tokenizer_files_is_refused_naming_the_file(setup):
  overrides, trainer, _, tok, other = setup
  overrides = {**overrides, "run_name": "resumed", "checkpoint_period": 1}
  loop.train(load_config("llama-tiny", **overrides), trainer=trainer, until_step=1, progress=False)
  # Other files (here under another key, with restart_data_on_resume, which lets the data keys change): refused.
  changed = {**overrides, "tokenizer_path": str(other), "restart_data_on_resume": True}
  with pytest.raises(checkpointing.CheckpointError, match="tokenizer.json.*differs from"):
    loop.train(load_config("llama-tiny", **changed), trainer=trainer, progress=False)
  records = loop.train(load_config("llama-tiny", **overrides), trainer=trainer, progress=False)
  assert [r["step"] for r in records] == [1]
  run_dir = Path(overrides["base_output_directory"], "resumed")
  assert (run_dir / "tokenizer.json").read_bytes() == (tok / "tokenizer.json").read_bytes()


def test_a_run_fine_tuned_from_an_imported_folder_keeps_its_tokenizer(setup, tmp_path, capsys):
  # import-hf keeps the Hugging Face folder's tokenizer; a run from its checkpoint without tokenizer_path takes it
  # as its own (copied, checked on resume), and tokenizes its data with it: one tokenizer for the model.
  overrides, trainer, run_dir, _, _ = setup
  assert cli.main(["export-hf", str(run_dir), str(tmp_path / "hf")]) == 0
  assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "imported")]) == 0
  imported = tmp_path / "imported"
  tuned = {
      **overrides,
      "tokenizer_path": "",
      "load_parameters_path": str(imported / "0" / "items"),
      "base_output_directory": str(tmp_path / "runs"),
      "run_name": "tuned",
  }
  config = load_config("llama-tiny", **tuned)
  assert hooks.inherited_tokenizer(config) == ("load_parameters_path", imported)
  source = hooks.Data(config)  # the documents in the model's words (ids < 15), not bytes
  try:
    assert int(np.max(source.train.batch(0, 0, 1)["inputs"])) < len(WORDS)
  finally:
    source.close()
  loop.train(config, trainer=trainer, progress=False)
  tuned_dir = tmp_path / "runs" / "tuned"
  prints = hooks.tokenizer_fingerprint(imported)
  assert prints and hooks.tokenizer_fingerprint(tuned_dir) == prints
  with warnings.catch_warnings():
    warnings.filterwarnings("error", ".*byte fallback")
    assert mb.Engine.from_pretrained(tuned_dir).tokenizer.folder == tuned_dir
    words = _generate(capsys, tuned_dir, PROMPT)
  assert words[:3] == PROMPT.split() and set(words) <= set(WORDS), words  # the model's words, not bytes
  # Data that is bytes whatever the tokenizer is refused for that model, naming the folder.
  with pytest.raises(ConfigError, match=f"tokenizer in {imported}.*byte tokens"):
    hooks.data_config(load_config("llama-tiny", **{**tuned, "dataset_type": "sft", "use_sft": False}))
