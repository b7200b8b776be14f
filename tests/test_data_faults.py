"""Faults around a run's data and its keys, each refused by name: damaged data files (exit 2 naming the file), data
files changed in place between a checkpoint and its resume, paths spelled otherwise, distillation keys without a
teacher, and sequence lengths past what XLA or an int32 can hold."""

import json
import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from array_record.python.array_record_module import ArrayRecordWriter

from maxbridge import cli
from maxbridge.core import array_limits, checkpointing
from maxbridge.core.config import ConfigError, load_config
from maxbridge.training import data, distill, loop, recipe

LENGTH = 32


def _texts(count=120, seed=0):
  rng = np.random.default_rng(seed)
  words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away"]
  return [" ".join(rng.choice(words, rng.integers(1, 20))) for _ in range(count)]


def _write_jsonl(path, texts):
  path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
  return path


def _write_arrayrecord(path, texts):
  # Uncompressed, a record per chunk: a record's bytes can be found in the file, and damaged.
  writer = ArrayRecordWriter(str(path), "group_size:1,uncompressed")
  for text in texts:
    writer.write(json.dumps({"text": text}).encode())
  writer.close()
  return path


def _flip(path, offset, count=8):
  raw = bytearray(path.read_bytes())
  for i in range(offset, offset + count):
    raw[i] ^= 0x5A
  path.write_bytes(bytes(raw))


def _cli(capsys, verb, files, *extra):
  args = [verb, "llama-tiny", "dataset_type=grain", f"grain_train_files={files}", f"max_target_length={LENGTH}"]
  code = cli.main(args + list(extra))
  return code, capsys.readouterr().err


def _overrides(files, base, **more):
  values = dict(
      dataset_type="grain",
      grain_train_files=str(files),
      max_target_length=LENGTH,
      per_device_batch_size=4,
      steps=4,
      checkpoint_period=2,
      eval_interval=0,
      base_output_directory=str(base),
      run_name="run",
  )
  return {**values, **more}


# --- damaged files --------------------------------------------------------------------


def test_damaged_data_files_of_every_format_exit_2_naming_the_file(tmp_path, capsys):
  texts = _texts()
  ar = _write_arrayrecord(tmp_path / "good.arrayrecord", texts)
  pq.write_table(pa.table({"text": texts}), tmp_path / "good.parquet", row_group_size=10)
  table = pa.table({"text": texts})
  with pa.ipc.new_stream(str(tmp_path / "good.arrow"), table.schema) as writer:
    writer.write_table(table)
  cases = []
  for name in ("good.arrayrecord", "good.parquet", "good.arrow"):  # cut short, as a copy that died midway
    cut = tmp_path / f"cut-{name.split('.')[1]}.{name.split('.')[1]}"
    raw = (tmp_path / name).read_bytes()
    cut.write_bytes(raw[: len(raw) // 2])
    cases.append((cut, "cannot read"))
  # Bits flipped in a record read late in the run, not as the file opens: the reader's hash check finds it then.
  late = tmp_path / "late.arrayrecord"
  late.write_bytes(ar.read_bytes())
  _flip(late, late.read_bytes().index(json.dumps({"text": texts[57]}).encode()))
  cases.append((late, "cannot read record"))
  # A page header of a later row group overwritten: found as that group is read.
  header = tmp_path / "header.parquet"
  raw = (tmp_path / "good.parquet").read_bytes()
  header.write_bytes(raw)
  meta = pq.ParquetFile(header).metadata
  _flip(header, meta.row_group(5).column(0).data_page_offset, 4)
  cases.append((header, "cannot read row group"))
  for path, message in cases:
    code, err = _cli(capsys, "train", path, "steps=8", "per_device_batch_size=8", "eval_interval=0", "log_period=100")
    assert code == 2 and f"{path}: {message}" in err and "internal error" not in err, (path, code, err[-2000:])
  for path in (tmp_path / "cut-parquet.parquet", header):  # `maxbridge data convert` reads them too
    assert cli.main(["data", "convert", str(path), str(tmp_path / f"converted-{path.stem}")]) == 2
    assert f"{path}: cannot read" in capsys.readouterr().err, path


def test_a_damaged_file_read_by_worker_processes_exits_2_naming_it(tmp_path, capsys):
  texts = _texts()
  late = _write_arrayrecord(tmp_path / "late.arrayrecord", texts)
  _flip(late, late.read_bytes().index(json.dumps({"text": texts[57]}).encode()))
  code, err = _cli(capsys, "train", late, "steps=8", "eval_interval=0", "grain_worker_count=2", "log_period=100")
  assert code == 2 and f"{late}: cannot read record" in err, err[-2000:]


# --- files changed in place, paths spelled otherwise ------------------------------------


@pytest.fixture(scope="module")
def trainer():
  return recipe.create_trainer(load_config("llama-tiny", **_overrides("x.jsonl", "/tmp")))


def test_a_data_file_changed_in_place_is_refused_on_resume_naming_it(tmp_path, trainer):
  corpus = _write_jsonl(tmp_path / "docs.jsonl", _texts())
  overrides = _overrides(corpus, tmp_path / "runs")
  loop.train(load_config("llama-tiny", **overrides), trainer=trainer, until_step=2, progress=False)
  size = corpus.stat().st_size
  _write_jsonl(corpus, _texts(seed=1))  # replaced in place: same path, same keys, other records
  with pytest.raises(checkpointing.CheckpointError, match=f"{corpus}: changed since the checkpoint .*restart_data"):
    loop.train(load_config("llama-tiny", **overrides), trainer=trainer, progress=False)
  # The same size and other bytes are found too (the fingerprint reads contents, not only the size).
  same = corpus.read_bytes()[:size].replace(b"cat", b"dog")
  corpus.write_bytes(same + b"\n" * (size - len(same)))
  with pytest.raises(checkpointing.CheckpointError, match=f"{corpus}: changed since the checkpoint"):
    loop.train(load_config("llama-tiny", **overrides), trainer=trainer, progress=False)
  # The user's say-so: the new data from its beginning, at the step the run had reached.
  resumed = loop.train(
      load_config("llama-tiny", **overrides, restart_data_on_resume=True), trainer=trainer, progress=False
  )
  assert [r["step"] for r in resumed] == [2, 3]


def test_an_in_memory_datasets_file_changed_in_place_is_refused_on_resume_naming_it(tmp_path, trainer):
  folder = tmp_path / "texts"
  folder.mkdir()
  for i, text in enumerate(_texts(40)):
    (folder / f"doc{i:02d}.txt").write_text(text)
  overrides = _overrides("", tmp_path / "runs", dataset_type="text", dataset_path=str(folder), grain_train_files="")
  loop.train(load_config("llama-tiny", **overrides), trainer=trainer, until_step=2, progress=False)
  (folder / "doc07.txt").write_text("another text entirely")
  with pytest.raises(checkpointing.CheckpointError, match=f"{folder / 'doc07.txt'}: changed in place"):
    loop.train(load_config("llama-tiny", **overrides), trainer=trainer, until_step=3, progress=False)
  (tmp_path / "runs/run/data_files.json").unlink()  # as a run from before runs recorded their files
  resumed = loop.train(load_config("llama-tiny", **overrides), trainer=trainer, until_step=3, progress=False)
  assert [r["step"] for r in resumed] == [2]
  (folder / "doc40.txt").write_text("one more")  # recorded by that resume: checked from then on
  with pytest.raises(checkpointing.CheckpointError, match=f"{folder / 'doc40.txt'}: new since the run started"):
    loop.train(load_config("llama-tiny", **overrides), trainer=trainer, progress=False)
  restarted = {**overrides, "restart_data_on_resume": True}
  assert [r["step"] for r in loop.train(load_config("llama-tiny", **restarted), trainer=trainer, progress=False)] == [3]


def test_a_state_saved_before_fingerprints_resumes_and_a_file_added_to_a_glob_is_named(tmp_path):
  folder = tmp_path / "shards"
  folder.mkdir()
  _write_jsonl(folder / "a.jsonl", _texts())
  config = load_config("llama-tiny", **_overrides(folder / "*.jsonl", tmp_path))
  dataset = data.make_dataset(config, "train", 4)
  for step in range(3):
    dataset.batch(step)
  state = json.loads(json.dumps(dataset.get_state()))
  assert [Path(path).name for path, _ in state["files"]] == ["a.jsonl"], state["files"]
  older = {key: value for key, value in state.items() if key != "files"}  # as runs before this change saved it
  resumed = data.make_dataset(config, "train", 4)
  resumed.set_state(older)
  np.testing.assert_array_equal(resumed.batch(3)["inputs"], dataset.batch(3)["inputs"])
  _write_jsonl(folder / "b.jsonl", _texts(seed=2))
  with pytest.raises(checkpointing.CheckpointError, match=f"{folder / 'b.jsonl'}: new since the checkpoint"):
    data.make_dataset(config, "train", 4).set_state(state)


def test_a_path_spelled_relative_or_absolute_resumes_as_the_same_data(tmp_path, trainer, monkeypatch):
  corpus = _write_jsonl(tmp_path / "docs.jsonl", _texts())
  monkeypatch.chdir(tmp_path)
  relative = _overrides("docs.jsonl", tmp_path / "runs")
  loop.train(load_config("llama-tiny", **relative), trainer=trainer, until_step=2, progress=False)
  # Each resumes where the last stopped (one step each): the config.yml check and the data state's both pass.
  for step, spelling in enumerate((str(corpus), f"./../{tmp_path.name}//docs.jsonl")):
    config = load_config("llama-tiny", **{**relative, "grain_train_files": spelling, "checkpoint_period": 1})
    resumed = loop.train(config, trainer=trainer, until_step=3 + step, progress=False)
    assert [r["step"] for r in resumed] == [2 + step], spelling
  assert data.same_setting("grain_train_files", "docs.jsonl", str(corpus))
  assert not data.same_setting("grain_train_files", "docs.jsonl", str(tmp_path / "other.jsonl"))


# --- distillation keys without a teacher --------------------------------------------------


@pytest.mark.parametrize(
    "key, value", [("distill_alpha", 0.7), ("distill_temperature", 2.0), ("distill_feature_loss_type", "l2")]
)
def test_distillation_keys_without_a_teacher_are_refused_naming_the_teacher_keys(key, value, capsys):
  config = load_config("llama-tiny", **{key: value})
  with pytest.raises(
      ConfigError, match=f"{key}={value!r} is read only by distillation .*teacher_overrides.*distill_logits_path"
  ):
    recipe.create_loss(config)
  assert cli.main(["train", "llama-tiny", f"{key}={value}", "steps=1"]) == 2
  assert f"{key}={value!r}" in capsys.readouterr().err
  assert distill.ignored_keys(config.replace(teacher_overrides="{}")) == []  # with a teacher they are read
  assert distill.ignored_keys(load_config("llama-tiny")) == []  # the defaults say nothing


# --- sequence lengths past XLA's and int32's bounds -----------------------------------------


def test_max_target_length_past_what_xla_or_int32_can_hold_is_refused_with_the_bound(capsys):
  config = load_config("llama-tiny")
  longest = array_limits.longest_attention(config, config.per_device_batch_size)
  # The bound is where the scanned layers' float32 scores [layers, rows, heads, T, T] pass 2**63 - 1 bytes.
  per_pair = 4 * config.num_decoder_layers * config.per_device_batch_size * config.num_query_heads
  assert per_pair * longest**2 <= 2**63 - 1 < per_pair * (longest + 1) ** 2
  with pytest.raises(ConfigError, match=rf"max_target_length=1000000000: .* max_target_length <= {longest}"):
    load_config("llama-tiny", max_target_length=10**9)
  load_config("llama-tiny", max_target_length=longest)  # at the bound: accepted
  with pytest.raises(ConfigError, match=r"max_target_length=3000000000 .*int32 .* at most 2147483647"):
    load_config("llama-tiny", max_target_length=3 * 10**9, attention="flash")
  load_config("llama-tiny", max_target_length=10**9, attention="flash")  # block by block: no T x T array
  for verb in ("compile", "train"):
    assert cli.main([verb, "llama-tiny", "max_target_length=1000000000"]) == 2, verb
    assert f"max_target_length <= {longest}" in capsys.readouterr().err, verb
  # A step's arrays are global: more devices, more rows, a lower bound (checked as the trainer is made).
  devices = 4
  rows = config.per_device_batch_size * devices
  assert math.isqrt((2**63 - 1) // (per_pair * devices)) == array_limits.longest_attention(config, rows)
  with pytest.raises(ConfigError, match=f"{rows} rows \\({devices} devices\\)"):
    array_limits.check_length(config.replace(max_target_length=longest), rows, ConfigError, f" ({devices} devices)")
