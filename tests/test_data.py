import json

import numpy as np
import pytest

from maxbridge.core.config import load_config
from maxbridge.training.data import BATCH_KEYS, EVAL_EVERY, Dataset, _stdlib_documents, make_dataset, pack


def _config(**overrides):
  return load_config("llama-tiny", **overrides)


def _assert_batches_equal(a, b, what):
  for key in BATCH_KEYS:
    np.testing.assert_array_equal(a[key], b[key], err_msg=f"{what}: {key!r} differs")


def test_pack_gives_hand_written_rows_with_split_document_and_padding():
  # Row length 4. Document B (6 tokens) starts mid-row 0 and runs through
  # row 1 into row 2; each piece is its own segment, positions from 0.
  documents = [np.array([1, 2, 3]), np.array([4, 5, 6, 7, 8, 9]), np.array([], np.int32), np.array([10])]
  rows = pack(documents, 4)
  expected = {
      "inputs": [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 0, 0]],
      "targets": [[2, 3, 0, 0], [6, 7, 8, 0], [0, 0, 0, 0]],
      "inputs_position": [[0, 1, 2, 0], [0, 1, 2, 3], [0, 0, 0, 0]],
      "inputs_segmentation": [[1, 1, 1, 2], [1, 1, 1, 1], [1, 2, 0, 0]],
      "targets_segmentation": [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]],
  }
  assert set(rows) == set(BATCH_KEYS)
  for key, want in expected.items():
    assert rows[key].dtype == np.int32, key
    np.testing.assert_array_equal(rows[key], np.array(want), err_msg=f"pack() {key!r}")


def test_pack_of_nothing_is_zero_rows_and_bad_documents_are_named():
  assert pack([], 8)["inputs"].shape == (0, 8)
  with pytest.raises(ValueError, match="document 1 must be a 1-D integer"):
    pack([np.array([1, 2]), np.zeros((2, 2), np.int32)], 8)
  with pytest.raises(ValueError, match="length must be a positive"):
    pack([np.array([1])], 0)


def test_targets_never_cross_a_document_boundary():
  rng = np.random.default_rng(0)
  # Each document repeats its own id, so a target from another document
  # would show up as a different value.
  documents = [np.full(rng.integers(1, 30), doc_id, np.int32) for doc_id in range(1, 200)]
  rows = pack(documents, 16)
  has_target = rows["targets_segmentation"] > 0
  np.testing.assert_array_equal(rows["targets"][has_target], rows["inputs"][has_target])
  assert np.all(rows["targets"][~has_target] == 0)
  # Where there is a target, it is the next input in the same segment.
  same_segment = rows["inputs_segmentation"][:, 1:] == rows["inputs_segmentation"][:, :-1]
  np.testing.assert_array_equal(has_target[:, :-1], same_segment & (rows["inputs_segmentation"][:, 1:] > 0))
  assert not has_target[:, -1].any()
  assert sum(len(d) for d in documents) == (rows["inputs_segmentation"] > 0).sum()


def test_batch_is_a_pure_function_of_seed_and_step():
  config = _config(dataset_type="synthetic", seed=3)
  first, second = make_dataset(config, global_batch_size=16), make_dataset(config, global_batch_size=16)
  for step in (0, 1, 7, 1000):
    _assert_batches_equal(first.batch(step), second.batch(step), f"step {step}")
  assert first.batch(0)["inputs"].shape == (16, config.max_target_length)
  other_seed = make_dataset(config.replace(seed=4), global_batch_size=16)
  assert not np.array_equal(first.batch(0)["inputs"], other_seed.batch(0)["inputs"])


def test_consecutive_steps_read_different_rows_and_an_epoch_visits_every_row():
  rows = pack([np.arange(1, 1 + 10 * 8)], 8)  # 10 rows, distinct first tokens
  dataset = Dataset(rows, batch_size=4, seed=0)
  assert not np.array_equal(dataset.batch(0)["inputs"], dataset.batch(1)["inputs"])
  # Steps 0..4 read 20 rows = two epochs; batch 2 straddles the boundary.
  seen = np.concatenate([dataset.batch(step)["inputs"][:, 0] for step in range(5)])
  assert sorted(seen[:10]) == sorted(seen[10:]) == sorted(rows["inputs"][:, 0])
  assert not np.array_equal(seen[:10], seen[10:]), "each epoch should use a fresh order"


def test_resumed_run_reads_the_same_batches_as_an_uninterrupted_one():
  config = _config(dataset_type="synthetic")
  uninterrupted = make_dataset(config, global_batch_size=32)
  batches = [uninterrupted.batch(step) for step in range(300)]  # 300*32 > 2 epochs of 4096 rows
  resumed = make_dataset(config, global_batch_size=32)
  for step in range(170, 300):
    _assert_batches_equal(resumed.batch(step), batches[step], f"resumed step {step}")


def test_process_slices_concatenate_to_the_global_batch():
  dataset = make_dataset(_config(dataset_type="synthetic"), global_batch_size=12)
  for step in (0, 5):
    whole = dataset.batch(step)
    slices = [dataset.batch(step, process_index=i, process_count=3) for i in range(3)]
    joined = {key: np.concatenate([s[key] for s in slices]) for key in BATCH_KEYS}
    _assert_batches_equal(joined, whole, f"3 process slices of step {step}")
  with pytest.raises(ValueError, match="12 is not divisible by process_count=5"):
    dataset.batch(0, process_index=0, process_count=5)
  with pytest.raises(ValueError, match="process_index must be in"):
    dataset.batch(0, process_index=3, process_count=3)


def test_embedded_data_is_substantial_bytes_with_a_disjoint_eval_split():
  config = _config()
  assert config.dataset_type == "embedded"
  train, held_out = make_dataset(config, "train"), make_dataset(config, "eval")
  assert train.num_rows > 5000 and held_out.num_rows > 100, (train.num_rows, held_out.num_rows)
  assert train.length == held_out.length == 64
  batch = train.batch(0)
  assert batch["inputs"].max() < 256 and batch["inputs"].min() >= 0
  assert (batch["targets_segmentation"] > 0).mean() > 0.9, "stdlib files are long: rows should be nearly full"

  # The splits are whole documents: packing each split's documents alone
  # reproduces its rows, and no document lands in both.
  documents = _stdlib_documents()
  eval_ids = [i for i in range(len(documents)) if i % EVAL_EVERY == 0]
  train_ids = [i for i in range(len(documents)) if i % EVAL_EVERY != 0]
  assert not set(eval_ids) & set(train_ids) and len(eval_ids) + len(train_ids) == len(documents)
  np.testing.assert_array_equal(held_out.rows["inputs"], pack([documents[i] for i in eval_ids], 64)["inputs"])
  assert train.rows["inputs"].shape == pack([documents[i] for i in train_ids], 64)["inputs"].shape
  assert held_out.rows["inputs"][0].tobytes() != train.rows["inputs"][0].tobytes()


def test_embedded_and_text_need_a_byte_vocab():
  with pytest.raises(ValueError, match="vocab_size=100; set vocab_size >= 256"):
    make_dataset(_config(vocab_size=100))
  synthetic = make_dataset(_config(dataset_type="synthetic", vocab_size=100))
  assert synthetic.num_rows == 4096 and synthetic.batch(0)["inputs"].max() < 100


def test_text_folder_with_txt_and_jsonl(tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "a.txt").write_text("hello world")
  lines = [json.dumps({"text": f"line {i} é"}) for i in range(25)]
  (tmp_path / "sub" / "b.jsonl").write_text("\n".join(lines) + "\n\n")
  (tmp_path / "ignored.md").write_text("not read")
  config = _config(dataset_type="text", dataset_path=str(tmp_path), max_target_length=16)

  # Documents: a.txt (index 0), then the 25 jsonl lines (1..25); 0 and 20 are eval.
  held_out = make_dataset(config, "eval", global_batch_size=2)
  assert bytes(held_out.rows["inputs"][0, :11].astype(np.uint8)) == b"hello world"
  eval_text = held_out.rows["inputs"][held_out.rows["inputs_segmentation"] > 0].astype(np.uint8).tobytes()
  assert eval_text == b"hello world" + "line 19 é".encode()
  train = make_dataset(config, "train", global_batch_size=2)
  train_text = train.rows["inputs"][train.rows["inputs_segmentation"] > 0].astype(np.uint8).tobytes()
  assert b"line 0 " in train_text and b"hello" not in train_text and b"not read" not in train_text
  assert train.batch(3)["inputs"].shape == (2, 16)

  # A glob works too.
  glob_config = config.replace(dataset_path=str(tmp_path / "**" / "*.jsonl"))
  assert make_dataset(glob_config, "eval").rows["inputs"].shape[1] == 16


def test_bad_jsonl_line_names_file_and_line(tmp_path):
  path = tmp_path / "data.jsonl"
  path.write_text('{"text": "fine"}\n{"text": oops}\n')
  with pytest.raises(ValueError, match=r"data\.jsonl:2: not valid JSON"):
    make_dataset(_config(dataset_type="text", dataset_path=str(path)))
  path.write_text('{"text": "fine"}\n\n{"body": "no text"}\n')
  with pytest.raises(ValueError, match=r'data\.jsonl:3: expected a JSON object with a string "text"'):
    make_dataset(_config(dataset_type="text", dataset_path=str(path)))


def test_missing_text_path_is_named(tmp_path):
  missing = str(tmp_path / "nowhere" / "*.txt")
  with pytest.raises(ValueError, match="no files match dataset_path .*nowhere"):
    make_dataset(_config(dataset_type="text", dataset_path=missing))
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match="no .txt or .jsonl files under folder .*empty"):
    make_dataset(_config(dataset_type="text", dataset_path=str(tmp_path / "empty")))


def test_single_document_leaves_train_empty_with_a_clear_error(tmp_path):
  (tmp_path / "one.txt").write_text("just one document")
  config = _config(dataset_type="text", dataset_path=str(tmp_path / "one.txt"))
  assert make_dataset(config, "eval").num_rows == 1
  with pytest.raises(ValueError, match="1 document.*none left for the 'train' split"):
    make_dataset(config, "train")


def test_bad_split_and_dataset_type_list_the_valid_ones():
  with pytest.raises(ValueError, match="unknown split 'test'; valid splits: 'train', 'eval'"):
    make_dataset(_config(), "test")
  config = _config()
  object.__setattr__(config, "dataset_type", "bogus")  # bypass Config's own validation
  with pytest.raises(ValueError, match="unknown dataset_type 'bogus'; valid values: 'embedded'"):
    make_dataset(config)


def test_cached_rows_are_read_only_but_batches_are_not():
  dataset = make_dataset(_config())
  with pytest.raises(ValueError):
    dataset.rows["inputs"][0, 0] = 1
  batch = dataset.batch(0)
  batch["inputs"][0, 0] = 1  # a copy the caller owns
