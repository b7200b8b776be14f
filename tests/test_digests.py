"""Checksummed checkpoints (issue 27, item 3): a flipped byte in any array is caught by restore, `compare` and
`maxbridge verify`, naming the array and the intact step before it; a clean checkpoint verifies."""

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import converters
import maxbridge as mb
from converters import ocdbt
from maxbridge import cli
from maxbridge.core import checkpointing
from maxbridge.training import recipe
from conftest import LINEN_FLAGS, tiny_config


def _random_tree(target, seed: int):
  """Values for every leaf of `target`: random floats (every array differs), the step as `seed`."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda leaf: rng.standard_normal(leaf.shape).astype(leaf.dtype)
      if jnp.issubdtype(leaf.dtype, jnp.floating)
      else np.full(leaf.shape, seed, leaf.dtype),
      target,
  )


@pytest.fixture(scope="module")
def trainer():
  return recipe.create_trainer(tiny_config())


@pytest.fixture(scope="module")
def run(tmp_path_factory, trainer) -> Path:
  """A run folder with checkpoints at steps 1 and 2 of random values, saved by `Checkpointer` (no training)."""
  run = tmp_path_factory.mktemp("digests") / "run"
  ckpt = checkpointing.Checkpointer(run / "checkpoints")
  for step in (1, 2):
    ckpt.save(step, _random_tree(trainer.checkpoint_target(), step))
  ckpt.close()
  return run


def _verify(capsys, path) -> tuple[int, str, str]:
  code = cli.main(["verify", str(path)])
  out, err = capsys.readouterr()
  return code, out, err


def _stored_values(items: Path) -> dict[str, tuple[Path, int, int]]:
  """{stored path: (data file, offset, length)} of the first chunk of each array stored in a data file (the
  smallest ones lie inline in OCDBT's index instead)."""
  found = {}
  for key, value in sorted(ocdbt.index(items).items()):
    name, _, chunk = key.decode().partition("/")
    if isinstance(value, tuple) and chunk != ".zarray":
      found.setdefault(name.replace(".", "/"), value)
  return found


def _flip(file: Path, offset: int) -> None:
  data = bytearray(file.read_bytes())
  data[offset] ^= 0x10
  file.write_bytes(bytes(data))


def test_a_clean_run_verifies_restores_and_compares(run, trainer, capsys):
  code, out, _ = _verify(capsys, run)
  assert code == 0, out
  lines = out.splitlines()
  assert len(lines) == 2 and all("ok: 39 arrays match their digests" in line for line in lines), out
  assert lines[0].startswith(str(run / "checkpoints" / "1"))
  restored = checkpointing.Checkpointer(run / "checkpoints").restore(2, trainer.checkpoint_target())
  expected = _random_tree(trainer.checkpoint_target(), 2)
  jax.tree.map(np.testing.assert_array_equal, restored, expected)
  assert converters.compare(run / "checkpoints" / "1", run / "checkpoints" / "2").differences  # values differ
  assert _verify(capsys, run / "checkpoints" / "2" / "items")[0] == 0  # one step, by its items folder


def test_digests_are_of_dtype_shape_and_bytes():
  a = np.arange(6, dtype=np.float32)
  assert checkpointing.digest(a) == checkpointing.digest(a.copy())
  assert checkpointing.digest(a) != checkpointing.digest(a.reshape(2, 3))
  assert checkpointing.digest(a) != checkpointing.digest(a.view(np.int32))
  assert checkpointing.digest(a.reshape(2, 3).T) == checkpointing.digest(np.ascontiguousarray(a.reshape(2, 3).T))
  assert checkpointing.digest(np.float32(1)) != checkpointing.digest(np.ones(1, np.float32))
  assert checkpointing.digest(jnp.ones(3, jnp.bfloat16)).startswith("xxh3_64:")


# Where in an array's stored chunk the byte is flipped: inside its compressed values (zstd frames carry no
# checksum here, so they decode to wrong values: only the digest sees it), or in the frame's magic number (the
# chunk no longer decodes: the error must still name the array).
@pytest.mark.parametrize("where", ["values", "frame header"])
def test_a_flipped_byte_in_any_array_is_caught_naming_it_and_the_intact_step(run, trainer, tmp_path, capsys, where):
  clean = run / "checkpoints"
  values = _stored_values(clean / "2" / "items")
  assert len(values) >= 20, sorted(values)  # every kernel, optimizer state included
  for i, (array, (file, offset, length)) in enumerate(values.items()):
    damaged = tmp_path / str(i)
    shutil.copytree(clean, damaged)
    _flip(
        damaged / "2" / "items" / file.relative_to(clean / "2" / "items"),
        offset + (length // 2 if where == "values" else 1),
    )

    with pytest.raises(checkpointing.CheckpointError) as error:
      checkpointing.Checkpointer(damaged).restore(2, trainer.checkpoint_target())
    message = str(error.value)
    assert "\n" not in message and array in message and f"{damaged / '2'} is damaged" in message, message
    assert "step 1 is intact" in message, message

    with pytest.raises(checkpointing.CheckpointError, match=f"{array} .*step 1 is intact") as error:
      converters.compare(damaged, clean / "2")
    assert "\n" not in str(error.value)

    code, out, err = _verify(capsys, damaged)
    assert code == 2, (array, out)
    assert out.splitlines()[0] == f"{damaged / '1'}: ok: 39 arrays match their digests"
    assert out.splitlines()[1].startswith(f"{damaged / '2'}: damaged: {array} "), out
    assert f"the latest step that verified is {damaged / '1'}" in err
    shutil.rmtree(damaged)


def test_a_non_ocdbt_checkpoint_with_digests_is_checked_too(trainer, tmp_path, capsys):
  """Orbax's other store (one zarr folder per array, as older MaxText wrote): digests recorded as ours are."""
  tree = _random_tree(trainer.checkpoint_target(), 3)
  manager = ocp.CheckpointManager(
      tmp_path / "clean",
      item_handlers={
          checkpointing.ITEM: ocp.PyTreeCheckpointHandler(use_ocdbt=False),
          checkpointing.DIGESTS: ocp.JsonCheckpointHandler(checkpointing.DIGESTS_FILE),
      },
  )
  manager.save(
      3,
      args=ocp.args.Composite(
          items=ocp.args.PyTreeSave(tree), digests=ocp.args.JsonSave(checkpointing.tree_digests(tree))
      ),
  )
  manager.close()
  assert _verify(capsys, tmp_path / "clean")[0] == 0
  items = tmp_path / "clean" / "3" / "items"
  arrays = {"params/params/decoder/logits_dense/kernel", "opt_state/0/nu/params/token_embedder/embedding"}
  for array in arrays:
    damaged = tmp_path / array.replace("/", "_")
    shutil.copytree(tmp_path / "clean", damaged)
    chunk = next(p for p in (damaged / "3" / "items" / array.replace("/", ".")).iterdir() if not p.name.startswith("."))
    _flip(chunk, chunk.stat().st_size // 2)
    with pytest.raises(checkpointing.CheckpointError, match=f"{damaged / '3'} is damaged: .*{array}"):
      checkpointing.Checkpointer(damaged).restore(3, trainer.checkpoint_target())
    with pytest.raises(checkpointing.CheckpointError, match=array):
      converters.compare(damaged, items)
    code, out, _ = _verify(capsys, damaged)
    assert code == 2 and f"damaged: {array} " in out, out


def test_a_checkpoint_without_digests_still_restores_and_verify_says_so(trainer, tmp_path, capsys):
  """Plain orbax, as MaxText saves: no digests item. Nothing to check against, still readable."""
  tree = _random_tree(trainer.checkpoint_target(), 4)
  manager = ocp.CheckpointManager(tmp_path / "maxtext", item_handlers={checkpointing.ITEM: ocp.PyTreeCheckpointHandler()})
  manager.save(4, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
  manager.close()
  restored = checkpointing.Checkpointer(tmp_path / "maxtext").restore(4, trainer.checkpoint_target())
  jax.tree.map(np.testing.assert_array_equal, restored, tree)
  code, out, _ = _verify(capsys, tmp_path / "maxtext")
  assert code == 0
  assert out == f"{tmp_path / 'maxtext' / '4'}: no digests recorded: 39 arrays read, nothing to check them against\n"


def test_a_damaged_digests_file_is_named(run, tmp_path, trainer, capsys):
  damaged = shutil.copytree(run / "checkpoints", tmp_path / "checkpoints")
  (damaged / "2" / checkpointing.DIGESTS / checkpointing.DIGESTS_FILE).write_text('{"params": ')
  with pytest.raises(checkpointing.CheckpointError, match="digests.json is not readable JSON"):
    checkpointing.Checkpointer(damaged).restore(2, trainer.checkpoint_target())
  code, out, _ = _verify(capsys, damaged)
  assert code == 2 and "2: damaged: " in out and "digests.json is not readable JSON" in out, out
  # Removed: the step's orbax metadata says it was saved with digests, so their absence is damage too.
  (damaged / "2" / checkpointing.DIGESTS / checkpointing.DIGESTS_FILE).unlink()
  with pytest.raises(checkpointing.CheckpointError, match="digests.json is missing, but .* was saved with digests"):
    checkpointing.Checkpointer(damaged).restore(2, trainer.checkpoint_target())
  code, out, _ = _verify(capsys, damaged)
  assert code == 2 and "2: damaged: " in out and "was saved with digests" in out, out


def test_verify_names_a_path_that_is_no_checkpoint(tmp_path, capsys):
  code, _, err = _verify(capsys, tmp_path)
  assert code == 2 and f"{tmp_path} holds no checkpoint" in err
  code, _, err = _verify(capsys, tmp_path / "nothing")
  assert code == 2 and "no such file or directory" in err
  (tmp_path / "a-file").write_text("")
  code, _, err = _verify(capsys, tmp_path / "a-file")
  assert code == 2 and "a-file is a file: give a run, checkpoints, step or items folder" in err


def test_a_conversion_carries_the_digests_of_arrays_it_renames_and_records_those_it_decodes(run, tmp_path, capsys):
  converters.convert(run / "checkpoints" / "2", tmp_path / "nnx", layout="nnx")  # renamed: nothing decoded
  code, out, _ = _verify(capsys, tmp_path / "nnx")
  assert code == 0 and out.endswith(": ok: 39 arrays match their digests\n"), out
  converters.convert(run / "checkpoints" / "2", tmp_path / "axis0", param_scan_axis=0)  # stacks decoded, moved
  code, out, _ = _verify(capsys, tmp_path / "axis0")
  assert code == 0 and out.endswith(": ok: 39 arrays match their digests\n"), out
  # Layers made of moved chunks, or cast a piece at a time, were never whole in memory: they get no digest,
  # and verify says how many it could not check.
  converters.convert(run / "checkpoints" / "2", tmp_path / "unscanned", scan_layers=False)
  code, out, _ = _verify(capsys, tmp_path / "unscanned")
  assert code == 0 and ": ok: 12 arrays match their digests; 54 have no digest recorded" in out, out


def test_a_trained_run_records_the_digests_of_what_it_saved(tmp_path, capsys):
  """The train loop donates its state right after a save: the digests must still be of the bytes saved."""
  config = mb.load_config(
      "llama-tiny",
      base_output_directory=str(tmp_path),
      run_name="run",
      steps=2,
      per_device_batch_size=2,
      checkpoint_period=1,
      eval_interval=0,
      **LINEN_FLAGS,
  )
  mb.train(config, progress=False)
  code, out, _ = _verify(capsys, tmp_path / "run")
  assert code == 0 and out.count("ok: 39 arrays match their digests") == 2, out
