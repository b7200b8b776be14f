"""Grain pipelines (`dataset_type: grain`): packing as `data.pack`, every file format, shards, tokenizers,
exact resume through checkpoints (also after kill -9, with worker processes), and bad input named."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from maxbridge import cli
from maxbridge.core import checkpointing
from maxbridge.core.config import load_config
from maxbridge.training import data, grain_data, loop, recipe

REPO = Path(__file__).resolve().parents[1]
LENGTH = 32


def _documents(count=120, seed=0):
  rng = np.random.default_rng(seed)
  words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "and", "then", "slept"]
  return [" ".join(rng.choice(words, rng.integers(1, 25))) for _ in range(count)]


def _write_jsonl(path, texts, column="text"):
  path.write_text("".join(json.dumps({column: t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
  return path


def _config(files, **overrides):
  values = dict(dataset_type="grain", grain_train_files=str(files), max_target_length=LENGTH, per_device_batch_size=4)
  return load_config("llama-tiny", **{**values, **overrides})


def make_text_rows(folder):
  """`dataset_type: text`'s packed rows of `folder` (the in-memory path), in file order."""
  return data.make_dataset(
      load_config("llama-tiny", dataset_type="text", dataset_path=str(folder), max_target_length=LENGTH), "train", 1
  ).rows


def _stream(rows):
  """The real tokens of rows, in order: what packing laid out, whatever the cuts."""
  return np.concatenate([r["inputs"][r["inputs_segmentation"] > 0] for r in rows])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  folder = tmp_path_factory.mktemp("corpus")
  texts = _documents()
  return folder, texts, _write_jsonl(folder / "docs.jsonl", texts)


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A small BPE tokenizer folder (tokenizer.json, tokenizer_config.json with BOS/EOS), trained here."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
  tokenizer.train_from_iterator(_documents(200, seed=1), trainer)
  folder = tmp_path_factory.mktemp("bpe")
  tokenizer.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
  return folder, tokenizer


def _all_rows(config, split="train", **options):
  dataset = grain_data.GrainDataset(config, split, 1, num_epochs=1, shuffle=False, **options)
  rows = list(dataset.dataset())
  return {key: np.concatenate([r[key] for r in rows]) for key in data.BATCH_KEYS}


# --- packing -------------------------------------------------------------------------


def test_stream_packer_equals_todays_packer_on_hand_made_documents():
  import grain

  documents = [np.arange(1, 4), np.arange(4, 10), np.zeros(0, np.int32), np.array([10]), np.arange(11, 31)]
  rows = list(grain_data.PackIterDataset(grain.MapDataset.source(documents).to_iter_dataset(), 4))
  expected = data.pack(documents, 4)
  for key in data.BATCH_KEYS:
    np.testing.assert_array_equal(np.stack([r[key] for r in rows]), expected[key], err_msg=key)


def test_packed_rows_equal_todays_packer_on_the_same_corpus(corpus):
  folder, texts, jsonl = corpus
  got = _all_rows(_config(jsonl))
  train = [np.frombuffer(t.encode(), np.uint8) for i, t in enumerate(texts) if i % data.EVAL_EVERY]
  want = data.pack(train, LENGTH)
  for key in data.BATCH_KEYS:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  held = [np.frombuffer(t.encode(), np.uint8) for i, t in enumerate(texts) if i % data.EVAL_EVERY == 0]
  np.testing.assert_array_equal(_all_rows(_config(jsonl), "eval")["inputs"], data.pack(held, LENGTH)["inputs"])


def test_a_folder_of_text_files_packs_as_dataset_type_text_does(corpus, tmp_path):
  folder, texts, jsonl = corpus
  for i, text in enumerate(texts[:45]):
    (tmp_path / f"doc{i:03d}.txt").write_text(text)
  got = _all_rows(_config(tmp_path))
  want = make_text_rows(tmp_path)
  for key in data.BATCH_KEYS:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)


def test_parquet_arrayrecord_and_datasets_folders_give_the_batches_of_their_jsonl(corpus, tmp_path):
  folder, texts, jsonl = corpus
  table = pa.table({"text": texts, "id": list(range(len(texts)))})
  pq.write_table(table, tmp_path / "docs.parquet", row_group_size=16)  # several row groups
  arrow = tmp_path / "hf"  # what `datasets.save_to_disk` writes: Arrow IPC streams and a state.json naming them
  arrow.mkdir()
  with pa.ipc.new_stream(str(arrow / "data-00000-of-00001.arrow"), table.schema) as writer:
    writer.write_table(table)
  (arrow / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
  assert cli.main(["data", "convert", str(jsonl), str(tmp_path / "ar")]) == 0
  reference = data.make_dataset(_config(jsonl), "train", 4)
  want = [reference.batch(step) for step in range(6)]  # more than an epoch: reshuffled per epoch
  for files in (tmp_path / "docs.parquet", tmp_path / "ar", arrow):
    dataset = data.make_dataset(_config(files), "train", 4)
    for step in range(6):
      for key in data.BATCH_KEYS:
        np.testing.assert_array_equal(dataset.batch(step)[key], want[step][key], err_msg=f"{files} step {step} {key}")


def test_each_process_reads_only_its_share(corpus):
  folder, texts, jsonl = corpus
  train = [t for i, t in enumerate(texts) if i % data.EVAL_EVERY]
  config = _config(jsonl, per_device_batch_size=2)
  for process in range(2):
    dataset = grain_data.GrainDataset(config, "train", 2, process, 2, num_epochs=1, shuffle=False)
    stream = _stream(list(dataset.dataset())).astype(np.uint8).tobytes().decode()
    assert stream == "".join(train[process::2]), f"process {process} read documents outside its share"
  with pytest.raises(ValueError, match="built for process 0 of 2"):
    grain_data.GrainDataset(config, "train", 2, 0, 2).batch(0, 1, 2)


def test_hugging_face_tokenizer_with_bos_and_eos(corpus, bpe):
  folder, texts, jsonl = corpus
  path, tokenizer = bpe
  rows = _all_rows(_config(jsonl, tokenizer_path=str(path)))
  bos, eos = tokenizer.token_to_id("<s>"), tokenizer.token_to_id("</s>")
  train = [t for i, t in enumerate(texts) if i % data.EVAL_EVERY]
  want = np.concatenate([[bos, *tokenizer.encode(t, add_special_tokens=False).ids, eos] for t in train])
  np.testing.assert_array_equal(_stream([rows]), want)
  no_bos = _all_rows(_config(jsonl, tokenizer_path=str(path), add_bos=False, add_eos=False))
  assert _stream([no_bos]).size == want.size - 2 * len(train)


# --- resume ----------------------------------------------------------------------------


def test_saved_state_resumes_exactly_and_other_data_settings_are_refused(corpus):
  folder, texts, jsonl = corpus
  config = _config(jsonl)
  dataset = data.make_dataset(config, "train", 4)
  for step in range(5):
    dataset.batch(step)
  state = json.loads(json.dumps(dataset.get_state()))  # as Grain's handler stores it
  want = [dataset.batch(step) for step in range(5, 9)]
  resumed = data.make_dataset(config, "train", 4)
  resumed.set_state(state)
  for step, batch in zip(range(5, 9), want):
    np.testing.assert_array_equal(resumed.batch(step)["inputs"], batch["inputs"], err_msg=f"step {step}")
  # Without a state it replays to the step: the same batch, as a pure function of (seed, step).
  np.testing.assert_array_equal(data.make_dataset(config, "train", 4).batch(7)["inputs"], want[2]["inputs"])
  for key, value in (("max_target_length", 64), ("add_bos", False), ("seed", 3), ("per_device_batch_size", 2)):
    other = data.make_dataset(_config(jsonl, **{key: value}), "train", 8 if key == "per_device_batch_size" else 4)
    named = "global_batch_size: 4 -> 8" if key == "per_device_batch_size" else f"{key}: "
    with pytest.raises(checkpointing.CheckpointError, match=named):
      other.set_state(state)


KILLED_RUN = textwrap.dedent("""
    import os, signal, sys
    import maxbridge as mb
    from maxbridge.core import checkpointing
    save = checkpointing.Checkpointer.save
    def save_then_die(self, step, tree, data=None):
      save(self, step, tree, data)
      if step == int(sys.argv[2]):
        self.wait()
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run: later steps never run, nothing is closed
    checkpointing.Checkpointer.save = save_then_die
    mb.train(mb.load_config("llama-tiny", *sys.argv[3:], run_name=sys.argv[1]), progress=False)
    """)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
  folder, texts, jsonl = corpus
  overrides = dict(
      dataset_type="grain",
      grain_train_files=str(jsonl),
      max_target_length=LENGTH,
      per_device_batch_size=4,
      steps=6,
      checkpoint_period=2,
      eval_interval=0,
      base_output_directory=str(tmp_path_factory.mktemp("runs")),
  )
  trainer = recipe.create_trainer(load_config("llama-tiny", **overrides))
  reference = loop.train(load_config("llama-tiny", **overrides, run_name="reference"), trainer=trainer, progress=False)
  return overrides, trainer, [r["loss"] for r in reference]


@pytest.mark.parametrize("workers", [0, 2])
def test_kill_9_mid_run_and_resume_reads_the_uninterrupted_batches(run, workers):
  overrides, trainer, reference = run
  overrides = {**overrides, "grain_worker_count": workers}
  name = f"killed-{workers}"
  args = [f"{k}={v}" for k, v in overrides.items()]
  env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  proc = subprocess.run(
      [sys.executable, "-c", KILLED_RUN, name, "4", *args], env=env, capture_output=True, text=True, timeout=300
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
  run_dir = Path(overrides["base_output_directory"], name)
  assert (run_dir / "checkpoints/4/data/process_0-of-1.json").is_file()  # Grain's handler wrote the state
  resumed = loop.train(load_config("llama-tiny", **overrides, run_name=name), trainer=trainer, progress=False)
  assert [r["step"] for r in resumed] == [4, 5]
  losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert losses == reference, "the resumed run read other batches than the uninterrupted one"


def test_resume_with_another_data_setting_is_refused_naming_it(run, corpus, tmp_path):
  overrides, trainer, reference = run
  folder, texts, jsonl = corpus
  loop.train(load_config("llama-tiny", **overrides, run_name="changed"), trainer=trainer, until_step=2, progress=False)
  # Refused by the run's fixed keys (config.yml), and by the data state saved with the step.
  for key, value, named in (("add_bos", False, "add_bos: True -> False"), ("grain_worker_count", 1, "count: 0 -> 1")):
    changed = load_config("llama-tiny", **{**overrides, "run_name": "changed", key: value})
    with pytest.raises(checkpointing.CheckpointError, match=named):
      loop.train(changed, trainer=trainer, progress=False)


# --- bad input: exit 2 naming the file ---------------------------------------------------


def _inspect(capsys, files, **overrides):
  args = [
      "data",
      "inspect",
      "llama-tiny",
      "dataset_type=grain",
      f"grain_train_files={files}",
      f"max_target_length={LENGTH}",
  ]
  code = cli.main(args + [f"{k}={v}" for k, v in overrides.items()])
  return code, capsys.readouterr()


def test_bad_input_exits_2_naming_the_file(corpus, bpe, tmp_path, capsys):
  folder, texts, jsonl = corpus
  code, out = _inspect(capsys, jsonl)
  assert code == 0 and "training documents" in out.out and "padding" in out.out and "row 0:" in out.out, out
  cases = []
  bad = tmp_path / "latin1.jsonl"
  bad.write_bytes(b'{"text": "fine"}\n' * 3 + '{"text": "caf\u00e9"}\n'.encode("latin-1"))
  cases.append((bad, {}, f"{bad}: not UTF-8 text at byte offset {3 * 17 + 13}"))
  cases.append((jsonl, {"data_columns": "body"}, f"{jsonl}: byte offset 0: has no column 'body'"))
  empty = tmp_path / "empty.jsonl"
  empty.write_text("")
  cases.append((empty, {}, f"{empty}: the file is empty"))
  blank = _write_jsonl(tmp_path / "blank.jsonl", [""] * 5)
  cases.append((blank, {}, "documents in a row hold no tokens"))
  cases.append((tmp_path / "none-*.jsonl", {}, "matches no files"))
  cases.append((jsonl, {"tokenizer_path": bpe[0], "vocab_size": 32}, "makes token ids up to"))
  pq.write_table(pa.table({"body": ["x"]}), tmp_path / "p.parquet")
  cases.append((tmp_path / "p.parquet", {}, f"{tmp_path / 'p.parquet'}: has no column 'text'"))
  for files, overrides, message in cases:
    code, out = _inspect(capsys, files, **overrides)
    assert code == 2 and message in out.err, (files, overrides, out.err)
