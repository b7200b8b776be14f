"""Grain pipelines (`dataset_type: grain`): packing as `data.pack`, every file format, shards, tokenizers,
exact resume through checkpoints (also after kill -9, with worker processes), and bad input named."""

import concurrent.futures
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
from maxbridge.training import data, grain_data, grain_packing, grain_sources, loop, recipe

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
  rows = list(grain_packing.PackIterDataset(grain.MapDataset.source(documents).to_iter_dataset(), 4))
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


def test_a_parquet_file_read_from_many_threads_at_once_gives_every_row(tmp_path):
  # Grain's prefetch calls a source from a thread pool; one shared pyarrow reader crashed there.
  texts = [f"doc {i} " + "w" * (i % 50) for i in range(2000)]
  pq.write_table(pa.table({"text": texts}), tmp_path / "docs.parquet", row_group_size=10)
  source = grain_sources._ParquetSource(str(tmp_path / "docs.parquet"), "text")
  order = np.random.default_rng(0).permutation(len(texts)).tolist() * 2
  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    assert list(pool.map(source.__getitem__, order)) == [texts[i] for i in order]


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


# --- SFT and DPO rows through Grain -------------------------------------------------------


POSTTRAIN_LENGTH = 96  # byte tokens: an example's prompt fits, with some of its completion


def _sft_rows(count=60, seed=2):
  rng = np.random.default_rng(seed)
  words = ["one", "two", "three", "four", "the", "cat", "sat"]
  text = lambda low, high: " ".join(rng.choice(words, rng.integers(low, high)))  # noqa: E731
  rows = []
  for i in range(count):
    if i % 3 == 0:
      chat = [{"role": "system", "content": text(1, 3)}] if i % 2 else []
      chat += [{"role": "user", "content": text(1, 6)}, {"role": "assistant", "content": text(1, 8)}]
      rows.append({"messages": chat})
    else:
      rows.append({"prompt": text(1, 5), "completion": text(1, 9)})
  return rows


def _pairs(count=60, seed=3):
  rng = np.random.default_rng(seed)
  words = ["yes", "no", "maybe", "the", "cat"]
  text = lambda low, high: " ".join(rng.choice(words, rng.integers(low, high)))  # noqa: E731
  return [{"prompt": text(1, 5), "chosen": text(1, 8), "rejected": text(1, 12)} for _ in range(count)]


@pytest.fixture(scope="module")
def posttrain_files(tmp_path_factory, bpe):
  folder = tmp_path_factory.mktemp("posttrain")
  for name, rows in (("sft", _sft_rows()), ("dpo", _pairs())):
    (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  chat = folder / "chat-tokenizer"  # the BPE tokenizer with a chat template, as an instruct model's folder has
  chat.mkdir()
  for file in ("tokenizer.json", "tokenizer_config.json"):
    (chat / file).write_bytes((bpe[0] / file).read_bytes())
  (chat / "chat_template.jinja").write_text(
      "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }}</s>{% endfor %}"
      "{% if add_generation_prompt %}<s>assistant {% endif %}"
  )
  return folder, chat


def _in_memory(kind, path, split="train", **overrides):
  extra = {"use_dpo": True} if kind == "dpo" else {}
  values = dict(dataset_type="sft", dataset_path=str(path), max_target_length=POSTTRAIN_LENGTH, **extra)
  config = load_config("llama-tiny", **{**values, **overrides})
  return data.make_dataset(config, split, 1).rows


def _grain(kind, path, **overrides):
  return _config(path, **{f"use_{kind}": True, "max_target_length": POSTTRAIN_LENGTH, **overrides})


@pytest.mark.parametrize(
    "kind, overrides",
    [("sft", {}), ("sft", {"sft_train_on_completion_only": True}), ("sft", {"tokenizer": True}), ("dpo", {})],
)
def test_sft_and_dpo_rows_equal_the_in_memory_paths(posttrain_files, kind, overrides):
  folder, chat = posttrain_files
  if overrides.pop("tokenizer", False):
    overrides = {"tokenizer_path": str(chat), "vocab_size": 64}
  path = folder / f"{kind}.jsonl"
  for split in ("train", "eval"):
    want = _in_memory(kind, path, split, **overrides)
    dataset = grain_data.GrainDataset(_grain(kind, path, **overrides), split, 1, num_epochs=1, shuffle=False)
    rows = list(dataset.dataset())
    assert sorted(rows[0]) == sorted(want)
    for key in want:  # prompt masks, chosen/rejected in step, whole examples per row, padding: all as in memory
      np.testing.assert_array_equal(np.concatenate([r[key] for r in rows]), want[key], err_msg=f"{split} {key}")


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_sft_and_dpo_resume_exactly_and_read_only_their_share(posttrain_files, kind):
  folder, _ = posttrain_files
  config = _grain(kind, folder / f"{kind}.jsonl", per_device_batch_size=2)
  dataset = data.make_dataset(config, "train", 2)
  for step in range(3):
    dataset.batch(step)
  state = json.loads(json.dumps(dataset.get_state()))
  assert state["iterator"]["pending"]  # the example that did not fit the last row starts the next
  want = [dataset.batch(step) for step in range(3, 6)]
  resumed = data.make_dataset(config, "train", 2)
  resumed.set_state(state)
  for step, batch in zip(range(3, 6), want):
    for key in batch:
      np.testing.assert_array_equal(resumed.batch(step)[key], batch[key], err_msg=f"step {step} {key}")
  from maxbridge.training.posttrain import dpo, sft

  train = [r for i, r in enumerate(_sft_rows() if kind == "sft" else _pairs()) if i % data.EVAL_EVERY]
  for process in range(2):  # each process packs exactly its share of the examples, in order
    rows = list(grain_data.GrainDataset(config, "train", 2, process, 2, num_epochs=1, shuffle=False).dataset())
    share = train[process::2]
    if kind == "sft":
      want = sft.pack_examples(
          [sft.fit(sft.record_example(r), POSTTRAIN_LENGTH, "") for r in share], POSTTRAIN_LENGTH, False
      )
    else:
      want = dpo.pack_pairs([dpo.fit_pair(dpo.record_pair(r), POSTTRAIN_LENGTH, "") for r in share], POSTTRAIN_LENGTH)
    for key in want:
      np.testing.assert_array_equal(np.concatenate([r[key] for r in rows]), want[key], err_msg=f"{process} {key}")


# --- damaged records ---------------------------------------------------------------------


def test_damaged_records_are_an_error_naming_the_offset_unless_skipped_and_counted(corpus, tmp_path):
  folder, texts, jsonl = corpus
  clean = jsonl.read_bytes().splitlines(keepends=True)
  damaged = tmp_path / "damaged.jsonl"
  lines = list(clean)
  lines.insert(5, b'{"text": "cut short\n')  # a torn write
  lines.insert(30, b'{"text": "caf\xe9"}\n')  # Latin-1
  damaged.write_bytes(b"".join(lines))
  torn = sum(map(len, lines[:5]))
  with pytest.raises(ValueError, match=f"{damaged}: byte offset {torn}: not valid JSON"):
    _all_rows(_config(damaged))
  # Skipped: the rows of the corpus without them (its held-out split is by position, so compare to the same
  # positions), and the count kept in the iterator's state.
  config = _config(damaged, grain_skip_damaged_records=True, grain_eval_files=str(jsonl))
  dataset = grain_data.GrainDataset(config, "train", 1, num_epochs=1, shuffle=False)
  want = data.pack([np.frombuffer(t.encode(), np.uint8) for t in texts], LENGTH)
  iterator = iter(dataset.dataset())
  rows = list(iterator)
  np.testing.assert_array_equal(np.concatenate([r["inputs"] for r in rows]), want["inputs"])
  assert iterator.get_state()["damaged"] == 2
  stream = data.make_dataset(config, "train", 4)
  stream.batch(100)  # past an epoch: both damaged records read once each epoch
  assert stream.damaged >= 2
  resumed = data.make_dataset(config, "train", 4)
  resumed.set_state(json.loads(json.dumps(stream.get_state())))
  assert resumed.damaged == stream.damaged


# --- windowed shuffle ----------------------------------------------------------------------


def test_windowed_shuffle_permutes_within_windows_by_seed_and_resumes_exactly(corpus):
  import grain

  order = lambda seed: list(grain_data.WindowShuffle(grain.MapDataset.range(10), 4, seed))  # noqa: E731
  assert order(0) == order(0) != order(1)
  for got in (order(0), order(1)):
    assert [sorted(got[i : i + 4]) for i in (0, 4, 8)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]], got
  folder, texts, jsonl = corpus
  config = _config(jsonl, grain_shuffle_buffer_size=8)
  dataset = data.make_dataset(config, "train", 4)
  batches = [dataset.batch(step) for step in range(4)]
  globally = data.make_dataset(_config(jsonl), "train", 4).batch(0)
  assert not np.array_equal(batches[0]["inputs"], globally["inputs"])
  state = json.loads(json.dumps(dataset.get_state()))
  want = [dataset.batch(step) for step in range(4, 8)]
  resumed = data.make_dataset(config, "train", 4)
  resumed.set_state(state)
  for step, batch in zip(range(4, 8), want):
    np.testing.assert_array_equal(resumed.batch(step)["inputs"], batch["inputs"], err_msg=f"step {step}")
  np.testing.assert_array_equal(data.make_dataset(config, "train", 4).batch(2)["inputs"], batches[2]["inputs"])


# --- restarting the data on resume ---------------------------------------------------------


def test_restart_data_on_resume_starts_the_new_data_from_its_beginning(run, corpus, tmp_path):
  overrides, trainer, reference = run
  folder, texts, jsonl = corpus
  other = _write_jsonl(tmp_path / "other.jsonl", _documents(80, seed=5))
  loop.train(load_config("llama-tiny", **overrides, run_name="restart"), trainer=trainer, until_step=2, progress=False)
  changed = {**overrides, "run_name": "restart", "grain_train_files": str(other)}
  with pytest.raises(checkpointing.CheckpointError, match=f"grain_train_files: '{jsonl}' -> '{other}'"):
    loop.train(load_config("llama-tiny", **changed), trainer=trainer, progress=False)
  restarted_run = load_config("llama-tiny", **changed, restart_data_on_resume=True)
  resumed = loop.train(restarted_run, trainer=trainer, until_step=4, progress=False)
  assert [r["step"] for r in resumed] == [2, 3]
  # The state saved at step 4: two batches into the new data, which started at step 2.
  run_dir = Path(overrides["base_output_directory"], "restart")
  state = json.loads((run_dir / "checkpoints/4/data/process_0-of-1.json").read_text())
  assert (state["step"], state["origin"], state["settings"]["grain_train_files"]) == (2, 2, str(other))
  fresh = data.make_dataset(load_config("llama-tiny", **changed), "train", 4)
  want = [fresh.batch(step) for step in range(3)]
  restarted = data.make_dataset(load_config("llama-tiny", **changed), "train", 4)
  restarted.set_state(state)
  np.testing.assert_array_equal(restarted.batch(4)["inputs"], want[2]["inputs"])
  # Resumed again without the key: the new data goes on (the run's data keys are now the new ones).
  again = loop.train(load_config("llama-tiny", **changed), trainer=trainer, progress=False)
  assert [r["step"] for r in again] == [4, 5]


def test_two_processes_resume_from_their_own_saved_iterator_states(corpus, tmp_path):
  import socket

  folder, texts, jsonl = corpus
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = str(s.getsockname()[1])
  script = str(REPO / "tests" / "grain_multiprocess_check.py")
  procs = [
      subprocess.Popen(
          [sys.executable, script, str(tmp_path), str(i), port, str(jsonl)],
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for i in range(2)
  ]
  outputs = []
  for proc in procs:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    outputs.append(out)
  reports = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
  assert reports[0]["resumed"] == reports[0]["reference"][2:], "the resumed run read other batches"
  for process, report in enumerate(reports):  # each process saved its own iterator's state, and went on from it
    assert (tmp_path / f"resumed/checkpoints/2/data/process_{process}-of-2.json").is_file()
    assert report["restored"] == [[2, 2]], report
