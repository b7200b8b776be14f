"""Checkpoint converters and comparator: exact round trips, resumed training, clear failures."""

import errno
import os
import shutil
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorstore as ts
from flax import nnx

import converters
import maxbridge as mb
from converters.source import Source, same_bytes
from maxbridge.core import checkpointing, layouts
from maxbridge.training import recipe
from maxbridge import cli
from conftest import tiny_config

NNX = (True, True, True)
TRAIN = dict(steps=6, per_device_batch_size=2, checkpoint_period=3, eval_interval=0, max_to_keep=5)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  """A tiny Linen run directory, scanned, with a step-6 checkpoint of random values (no training:
  fast, and every array differs, optimizer state included)."""
  directory = tmp_path_factory.mktemp("runs") / "src"
  config = tiny_config(base_output_directory=str(directory.parent), run_name="src", **TRAIN)
  config.to_yaml(directory / "config.yml")
  rng = np.random.default_rng(0)
  tree = jax.tree.map(
      lambda leaf: rng.standard_normal(leaf.shape).astype(leaf.dtype)
      if jnp.issubdtype(leaf.dtype, jnp.floating)
      else np.full(leaf.shape, 6, leaf.dtype),
      recipe.create_trainer(config).checkpoint_target(),
  )
  ckpt = checkpointing.Checkpointer(directory / "checkpoints")
  ckpt.save(6, tree)
  ckpt.wait()
  return directory


def convert(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main(["convert", *map(str, argv)])
  out, err = capsys.readouterr()
  return code, out, err


def compare(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main(["compare", *map(str, argv)])
  out, err = capsys.readouterr()
  return code, out, err


def stored_tree(path) -> dict:
  return checkpointing.CheckpointReader(path).tree


def read_all(path) -> dict:
  """A checkpoint's arrays in the Linen layout, as numpy."""
  reader = checkpointing.CheckpointReader(path)
  return layouts.build_tree({p: reader.read(p) for p in reader.leaves}, "linen")


def listing(path) -> dict[str, bytes]:
  return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# --- exact round trips ------------------------------------------------------------


def test_linen_to_nnx_to_linen_is_exact(source, tmp_path, capsys):
  untouched = listing(source)
  code, out, _ = convert(capsys, source, tmp_path / "nnx", "--layout", "nnx")
  assert code == 0, out
  assert "source:      " in out and "linen layout (MaxText), scanned" in out
  tree = stored_tree(tmp_path / "nnx")
  assert set(tree) == {"model", "optimizer"}
  assert set(tree["optimizer"]["opt_state"]) == {"0", "2"}  # orbax keeps int keys as strings
  assert tree["optimizer"]["step"].dtype == np.uint32
  assert tree["model"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].shape == (64, 2, 128)
  assert convert(capsys, tmp_path / "nnx", tmp_path / "back", "--layout", "linen")[0] == 0
  assert jax.tree.structure(stored_tree(tmp_path / "back")) == jax.tree.structure(stored_tree(source))
  code, out, _ = compare(capsys, source, tmp_path / "back", "--atol", 0, "--rtol", 0)
  assert code == 0, out
  assert "equal: 39 arrays" in out
  assert listing(source) == untouched, "the source is only read"


def test_scanned_to_unscanned_to_scanned_is_exact_with_optimizer_state(source, tmp_path, capsys):
  unscanned = converters.convert(source, tmp_path / "u", scan_layers=False, group_bytes=64 << 10)
  assert unscanned.arrays_read == 39, "each source array is read once"
  tree = stored_tree(tmp_path / "u")
  adam, empty, schedule = tree["opt_state"]
  assert empty is None and set(schedule) == {"count"}
  assert adam["mu"]["params"]["decoder"]["layers_1"]["mlp"]["wi_0"]["kernel"].shape == (64, 128)
  assert mb.load_config(str(tmp_path / "u" / "config.yml")).scan_layers is False
  assert convert(capsys, tmp_path / "u", tmp_path / "s", "--scan-layers", "true")[0] == 0
  code, out, _ = compare(capsys, source, tmp_path / "s")
  assert code == 0, out
  # Unscanned against scanned compares layer by layer, optimizer state included.
  code, out, _ = compare(capsys, source, tmp_path / "u")
  assert code == 0 and "equal: 66 arrays" in out, out


def test_converted_checkpoint_restores_into_a_trainer(source, tmp_path):
  converters.convert(source, tmp_path / "ckpt", layout="nnx")
  trainer = recipe.create_trainer(tiny_config(NNX))
  ckpt = checkpointing.Checkpointer(tmp_path / "ckpt")
  restored = trainer.params(trainer.from_checkpoint(ckpt.restore(6, trainer.checkpoint_target())))
  expected, _ = converters.load_params(source)
  chex.assert_trees_all_equal(restored, expected)


def test_params_only_bfloat16_unscanned(source, tmp_path, capsys):
  code, out, _ = convert(
      capsys, source, tmp_path / "decode", "--params-only", "--dtype", "bfloat16", "--scan-layers", "false"
  )
  assert code == 0, out
  tree = stored_tree(tmp_path / "decode")
  assert set(tree) == {"params"}
  params, info = converters.load_params(tmp_path / "decode")
  assert info.layout.params_only and not info.layout.scanned and info.layout.dtype == "bfloat16"
  assert "params only" in out
  reference, _ = converters.load_params(source)
  np.testing.assert_array_equal(
      params["decoder"]["layers_1"]["mlp"]["wo"]["kernel"],
      reference["decoder"]["layers"]["mlp"]["wo"]["kernel"][:, 1].astype(jnp.bfloat16),
  )
  assert info.config.weight_dtype == "bfloat16" and info.config.scan_layers is False
  code, out, _ = compare(capsys, source, tmp_path / "decode", "--params-only", "--metadata-only")
  assert code == 1 and "dtype float32 vs bfloat16" in out


def test_older_nnx_checkpoint_with_value_wrappers_and_integer_layer_keys(source, tmp_path, capsys):
  """Older MaxText NNX checkpoints: {"value": array} leaves, layers/<i>/ keys, and nnx_aux."""
  linen = read_all(source)
  nnx_tree = converters.to_nnx(linen, scan_layers=False)

  def older(node):
    if isinstance(node, dict):
      node = dict(node)
      layers = {int(k[len("layers_") :]): node.pop(k) for k in list(node) if str(k).startswith("layers_")}
      if layers:
        node["layers"] = {i: v for i, v in layers.items()}
      return {k: older(v) for k, v in node.items()}
    return {"value": node}

  tree = older(nnx_tree)
  tree["nnx_aux"] = {"rngs": {"default": {"count": jnp.zeros((), jnp.uint32)}}}
  ckpt = checkpointing.Checkpointer(tmp_path / "old" / "checkpoints")
  ckpt.save(6, tree)
  ckpt.wait()
  layout = converters.detect_layout(tmp_path / "old")
  assert (layout.kind, layout.value_wrappers, layout.integer_layer_keys, layout.scanned) == ("nnx", True, True, False)
  assert layout.ignored == ("nnx_aux",)
  assert converters.detect_layout(tree) == layout
  code, out, _ = convert(capsys, tmp_path / "old", tmp_path / "new", "--layout", "linen", "--scan-layers", "true")
  assert code == 0, out
  assert "{'value': ...} leaf wrappers, integer layer keys" in out and "ignoring nnx_aux" in out
  code, out, _ = compare(capsys, source, tmp_path / "new")
  assert code == 0, out
  # And in memory: the same normalisation.
  back = converters.to_linen(tree, scan_layers=True)
  chex.assert_trees_all_equal(back, linen)


def test_in_memory_converters_fill_an_nnx_train_state():
  trainer = recipe.create_trainer(tiny_config(NNX, scan_layers=False))
  state = trainer.init_state(0)
  linen = converters.to_linen(state)
  assert linen["step"].dtype == jnp.int32 and linen["opt_state"][1] is None
  scanned = converters.to_linen(state, scan_layers=True)
  assert converters.detect_layout(scanned).scanned
  pure = converters.to_nnx(scanned, scan_layers=False)
  assert pure["optimizer"]["step"].dtype == jnp.uint32 and set(pure["optimizer"]["opt_state"]) == {0, 2}
  fresh = jax.tree.map(lambda x: x, trainer.abstract_state())
  nnx.replace_by_pure_dict(fresh, pure)
  chex.assert_trees_all_equal(nnx.to_pure_dict(fresh), nnx.to_pure_dict(state))
  params = converters.to_linen(state)["params"]["params"]
  stacked = converters.stack_layers(params, 1)
  assert stacked["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].shape[1] == 2  # llama-tiny's two layers
  chex.assert_trees_all_equal(converters.unstack_layers(stacked, 1), params)


def test_the_nnx_trainer_saves_what_the_converters_read():
  # Two readers of one mapping: the trainer's (driven by its abstract tree) and
  # the converters' (driven by paths alone) must give the same linen tree.
  trainer = recipe.create_trainer(tiny_config(NNX, scan_layers=False))
  state = trainer.init_state(0)
  saved = trainer.to_checkpoint(state)
  chex.assert_trees_all_equal(saved, converters.to_linen(state))
  chex.assert_trees_all_equal(nnx.to_pure_dict(trainer.from_checkpoint(saved)), nnx.to_pure_dict(state))


# --- at the storage level: renamed or moved, not decoded ----------------------------------


def stored(path) -> Source:
  return Source(checkpointing.CheckpointReader(path))


def data_files(path) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in path.rglob("*") if p.is_file() and p.parent.name == "d"}


def test_layout_only_conversion_renames_arrays_byte_for_byte_and_orbax_restores_them(source, tmp_path, capsys):
  there = converters.convert(source, tmp_path / "nnx", layout="nnx", progress=True)
  back = converters.convert(tmp_path / "nnx", tmp_path / "back", layout="linen")
  assert there.arrays_decoded == back.arrays_decoded == 1, "only the step changes type (int32 <-> uint32)"
  progress = capsys.readouterr().err
  assert "39/39 arrays" in progress and "B/s" in progress, f"progress counts arrays and bytes: {progress}"
  # The source's data files are in the result as they were: the arrays point at them under new names.
  assert data_files(source).items() <= data_files(tmp_path / "back").items()
  first, last = stored(source), stored(tmp_path / "back")
  different = [p for p in first.reader.leaves if not same_bytes(first, (p,), last, (p,))]
  assert different == [], "every array is stored as in the source (the step, cast twice, encodes the same)"
  # Orbax's own restore reads the result.
  trainer = recipe.create_trainer(tiny_config())
  restored = checkpointing.Checkpointer(tmp_path / "back").restore(6, trainer.checkpoint_target())
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, restored), read_all(source))


def data_inodes(path) -> dict[str, int]:
  return {p.name: p.stat().st_ino for p in path.rglob("*") if p.is_file() and p.parent.name == "d"}


def test_a_layout_only_conversion_shares_the_source_data_files_and_leaves_the_source_as_it_was(source, tmp_path):
  copy = tmp_path / "src"
  shutil.copytree(source, copy)
  before = listing(copy)
  converters.convert(copy, tmp_path / "nnx", layout="nnx")
  # The result links the source's data files (no array's bytes written), and the source is untouched.
  assert data_inodes(copy).items() <= data_inodes(tmp_path / "nnx").items()
  assert listing(copy) == before
  want = read_all(copy)
  shutil.rmtree(copy)  # the links keep the data
  chex.assert_trees_all_equal(read_all(tmp_path / "nnx"), want)


def test_data_files_that_cannot_be_linked_are_copied(source, tmp_path, monkeypatch):
  def refuse(*_):
    raise OSError(errno.EXDEV, "Invalid cross-device link")  # as between two file systems

  monkeypatch.setattr(os, "link", refuse)
  converters.convert(source, tmp_path / "nnx", layout="nnx")
  assert data_files(source).items() <= data_files(tmp_path / "nnx").items()
  assert not set(data_inodes(source).values()) & set(data_inodes(tmp_path / "nnx").values())
  assert converters.compare(source, tmp_path / "nnx").equal


def test_stacks_unstack_and_restack_by_moving_chunks(source, tmp_path):
  kernel = "params/params/decoder/layers/mlp/wi_0/kernel"
  # Our Checkpointer stores one chunk per layer, so unstacking moves chunks and decodes nothing.
  assert stored(source).zarray(kernel)["chunks"] == [64, 1, 128]
  unstacked = converters.convert(source, tmp_path / "u", scan_layers=False, params_only=True)
  assert unstacked.arrays_decoded == 0
  # Layers are one chunk each: stacking them moves their chunks too, pointing at the bytes of the
  # layers' data files, copied as they are.
  stacked = converters.convert(tmp_path / "u", tmp_path / "s", scan_layers=True)
  assert stacked.arrays_decoded == 0
  assert data_files(tmp_path / "u").items() <= data_files(tmp_path / "s").items()
  assert stored(tmp_path / "s").zarray(kernel)["chunks"] == [64, 1, 128]
  assert converters.compare(source, tmp_path / "u", params_only=True).equal
  assert converters.compare(source, tmp_path / "s", params_only=True).equal


def orbax_save(directory, tree, zarr3: bool = False) -> None:
  """Saved as orbax saves by default (and MaxText, on one device): each array one chunk; zarr3 as MaxText's
  default checkpoint_storage_use_zarr3 (one shard per array, holding one inner chunk)."""
  manager = ocp.CheckpointManager(directory, item_handlers={"items": ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)})
  manager.save(6, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
  manager.wait_until_finished()
  manager.close()


def orbax_restore(path) -> dict:
  """The arrays of a step, restored by orbax itself as numpy, by normal path."""
  items = checkpointing.CheckpointReader(path).items
  handler = ocp.PyTreeCheckpointHandler()
  metadata = handler.metadata(items).tree
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
  restored = handler.restore(items, args=ocp.args.PyTreeRestore(item=metadata, restore_args=restore_args))
  return {p.replace("/", "."): a for p, a in layouts.flatten_tree(restored).items()}


def assert_layers_are_the_stacks(stacked, unstacked) -> int:
  """Each layer of `unstacked` holds the bytes of its stack in `stacked` (decoded by tensorstore) at layer
  axis 1, and orbax restores the same bytes; returns the number of layers checked."""
  first, second = checkpointing.CheckpointReader(stacked), checkpointing.CheckpointReader(unstacked)
  restored = orbax_restore(unstacked)
  checked = 0
  for path in first.leaves:
    if "/layers/" not in path:
      continue
    stack = first.read(path)
    for i in range(stack.shape[1]):
      layer_path = path.replace("/layers/", f"/layers_{i}/")
      layer = second.read(layer_path)
      assert layer.dtype == stack.dtype and layer.tobytes() == stack[:, i].tobytes(), layer_path
      assert restored[second.name(layer_path)].tobytes() == stack[:, i].tobytes(), layer_path
      checked += 1
  return checked


@pytest.mark.parametrize("zarr3", [False, True], ids=["zarr", "zarr3"])
def test_a_one_chunk_stack_unstacks_piece_by_piece_byte_for_byte(source, tmp_path, zarr3):
  """Orbax's default (MaxText's on one device, layer axis 1): each stack one chunk, decoded as a stream in
  pieces of whole rows, each layer chunked by those rows so that every piece is written as whole chunks."""
  tree = {"params": read_all(source)["params"]}
  mlp = tree["params"]["params"]["decoder"]["layers"]["mlp"]
  mlp["wo"]["kernel"] = mlp["wo"]["kernel"].astype(jnp.bfloat16)
  orbax_save(tmp_path / "orbax", tree, zarr3=zarr3)
  if not zarr3:
    assert stored(tmp_path / "orbax").zarray("params/params/decoder/layers/mlp/wi_0/kernel")["chunks"] == [64, 2, 128]
  # Small pieces, so that a stack is read in several: 8 rows of [64, 2, 128] (2 layers of 8 x 128 float32).
  result = converters.convert(tmp_path / "orbax", tmp_path / "u", scan_layers=False, group_bytes=16 << 10)
  assert result.arrays_decoded == (12 if zarr3 else 9), "each stack decoded once (zarr3: every array)"
  unstacked = stored(tmp_path / "u")
  assert unstacked.zarray("params/params/decoder/layers_1/mlp/wi_0/kernel")["chunks"] == [8, 128]
  assert unstacked.zarray("params/params/decoder/layers_1/mlp/wo/kernel")["chunks"] == [32, 64]  # bfloat16: 2 bytes
  # Written at zstd's cheapest level (see storage.STREAMED_COMPRESSOR); orbax restores the same bytes (below).
  assert unstacked.zarray("params/params/decoder/layers_1/mlp/wi_0/kernel")["compressor"] == {"id": "zstd", "level": -1}
  assert assert_layers_are_the_stacks(tmp_path / "orbax", tmp_path / "u") == 18
  comparison = converters.compare(tmp_path / "orbax", tmp_path / "u")
  assert comparison.equal and comparison.compared == 21, comparison.report()


def test_a_truncated_one_chunk_stack_fails_clearly_and_writes_nothing(source, tmp_path, capsys):
  orbax_save(tmp_path / "orbax", {"params": read_all(source)["params"]})
  data = max((p for p in (tmp_path / "orbax").rglob("*") if p.is_file() and p.parent.name == "d"), key=os.path.getsize)
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
  code, _, err = convert(capsys, tmp_path / "orbax", tmp_path / "out", "--scan-layers", "false")
  # Orbax spreads arrays and their .zarray values over its data files as its writes finish: the largest file
  # holds a stack, and maybe other arrays' data or metadata (read before any array).
  named = (
      "cannot read params/params/" in err and "damaged or incomplete" in err
  ) or "cannot read the checkpoint metadata" in err
  assert code == 2 and named, err
  assert not (tmp_path / "out").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["orbax"], "no staging folder left behind"


# Saves the parameters of a checkpoint as MaxText does on 8 devices (fsdp 4 x tensor 2), in bfloat16: each
# array stored one chunk per shard, each chunk of a stack holding every layer.
SHARDED_SAVE = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, jax.numpy as jnp, numpy as np, orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from maxbridge.core import checkpointing, layouts
reader = checkpointing.CheckpointReader(sys.argv[1])
flat = {p: reader.read(p) for p in reader.leaves if p.startswith("params/")}
mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("fsdp", "tensor"))
def place(x):
    spec = ["fsdp" if x.shape[0] % 4 == 0 else None] + [None] * (x.ndim - 1)
    if x.ndim == 3 and x.shape[2] % 2 == 0:
        spec[2] = "tensor"
    return jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, PartitionSpec(*spec)))
tree = jax.tree.map(place, layouts.build_tree(flat, "linen"))
manager = ocp.CheckpointManager(sys.argv[2], item_handlers={"items": ocp.PyTreeCheckpointHandler()})
manager.save(6, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
manager.wait_until_finished()
"""


def test_a_device_sharded_stack_unstacks_chunk_by_chunk_byte_for_byte(source, tmp_path):
  run = subprocess.run(
      [sys.executable, "-c", SHARDED_SAVE, str(source), str(tmp_path / "sharded")],
      capture_output=True,
      text=True,
      timeout=300,
      env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
  )
  assert run.returncode == 0, run.stderr[-3000:]
  kernel = "params/params/decoder/layers/mlp/wi_0/kernel"
  assert stored(tmp_path / "sharded").zarray(kernel)["chunks"] == [16, 2, 64]
  # One stack rewritten with chunks that do not divide it (edge chunks of 16 rows and 32 columns).
  items = checkpointing.CheckpointReader(tmp_path / "sharded").items
  name = "params.params.decoder.layers.mlp.wi_1.kernel"
  values = checkpointing.CheckpointReader(tmp_path / "sharded").read(kernel.replace("wi_0", "wi_1"))
  spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{items}/", "path": f"{name}/"}}
  meta = {**stored(tmp_path / "sharded").zarray(kernel.replace("wi_0", "wi_1")), "chunks": [24, 2, 48]}
  ts.open({**spec, "metadata": meta}, create=True, delete_existing=True).result().write(values).result()
  assert stored(tmp_path / "sharded").zarray(kernel.replace("wi_0", "wi_1"))["chunks"] == [24, 2, 48]

  converters.convert(tmp_path / "sharded", tmp_path / "u", scan_layers=False)
  # Each layer chunked as its stack's chunks, without the layer axis: pieces fill them whole.
  assert stored(tmp_path / "u").zarray("params/params/decoder/layers_0/mlp/wi_0/kernel")["chunks"] == [16, 64]
  assert stored(tmp_path / "u").zarray("params/params/decoder/layers_0/mlp/wi_1/kernel")["chunks"] == [24, 48]
  assert assert_layers_are_the_stacks(tmp_path / "sharded", tmp_path / "u") == 18
  assert converters.compare(tmp_path / "sharded", tmp_path / "u").equal
  reference, _ = converters.load_params(source, dtype=jnp.bfloat16)
  unscanned, _ = converters.load_params(tmp_path / "u")
  np.testing.assert_array_equal(
      unscanned["decoder"]["layers_1"]["mlp"]["wi_1"]["kernel"],
      reference["decoder"]["layers"]["mlp"]["wi_1"]["kernel"][:, 1],
  )


def test_a_conversion_failing_midway_leaves_no_destination_and_no_staging_folder(source, tmp_path, capsys):
  damaged = tmp_path / "damaged"
  shutil.copytree(source / "checkpoints" / "6", damaged / "6")
  data = max((p for p in damaged.rglob("*") if p.is_file() and p.parent.name == "d"), key=os.path.getsize)
  data.write_bytes(data.read_bytes()[: data.stat().st_size * 3 // 4])  # the first arrays still read
  code, _, err = convert(capsys, damaged, tmp_path / "out", "--scan-layers", "false")
  assert code == 2 and "cannot read" in err, err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged"], "no destination, no staging folder"


# --- training resumes from a converted checkpoint --------------------------------------


def test_training_resumed_from_a_converted_checkpoint_continues_the_source_losses(tmp_path, capsys):
  config = tiny_config(base_output_directory=str(tmp_path), run_name="src", **TRAIN)
  losses = [r["loss"] for r in mb.train(config, progress=False)]  # checkpoints at steps 3 and 6
  # Linen -> NNX layout and scanned -> unscanned, from the step-3 checkpoint, into a new run.
  code, out, _ = convert(
      capsys,
      tmp_path / "src" / "checkpoints" / "3",
      tmp_path / "new" / "checkpoints",
      "--layout",
      "nnx",
      "--scan-layers",
      "false",
  )
  assert code == 0, out
  config = mb.load_config(str(tmp_path / "new" / "config.yml"))
  assert not config.scan_layers and config.run_name == "new"
  tail = mb.train(config.replace(pure_nnx=True, enable_nnx=True, pure_nnx_decoder=True), progress=False)
  assert [r["step"] for r in tail] == [3, 4, 5]
  np.testing.assert_allclose([r["loss"] for r in tail], losses[3:], rtol=1e-5)


# --- compare ------------------------------------------------------------------------


def test_compare_names_a_single_changed_element(source, tmp_path, capsys):
  tree = read_all(source)
  kernel = tree["params"]["params"]["decoder"]["layers"]["mlp"]["wi_1"]["kernel"]
  kernel[3, 1, 7] += 0.25
  tree["params"]["params"]["decoder"]["layers"]["mlp"]["wi_1"]["kernel"] = kernel
  ckpt = checkpointing.Checkpointer(tmp_path / "changed")
  ckpt.save(6, tree)
  ckpt.wait()
  code, out, _ = compare(capsys, source, tmp_path / "changed")
  assert code == 1
  assert "params/params/decoder/layers/mlp/wi_1/kernel: max abs diff 0.25 (1 of 16384 elements differ)" in out
  assert "1 path(s) differ" in out
  assert compare(capsys, source, tmp_path / "changed", "--atol", "0.3")[0] == 0
  assert compare(capsys, source, tmp_path / "changed", "--metadata-only")[0] == 0
  # Against an unscanned copy, the difference is named per layer.
  converters.convert(tmp_path / "changed", tmp_path / "unscanned", scan_layers=False)
  code, out, _ = compare(capsys, source, tmp_path / "unscanned")
  assert code == 1 and "params/params/decoder/layers_1/mlp/wi_1/kernel: max abs diff 0.25" in out


def test_compare_matches_nan_with_nan_in_arrays_it_decodes(source, tmp_path):
  tree = read_all(source)
  kernel = tree["params"]["params"]["decoder"]["layers"]["mlp"]["wi_1"]["kernel"]
  kernel[3, 1, 7] = np.nan
  # Stored differently (one chunk per stack, one per layer), so compared by decoding both.
  orbax_save(tmp_path / "orbax", tree)
  ckpt = checkpointing.Checkpointer(tmp_path / "ours")
  ckpt.save(6, tree)
  ckpt.wait()
  assert converters.compare(tmp_path / "orbax", tmp_path / "ours").equal
  kernel[3, 1, 8] = np.nan
  ckpt.save(7, tree)
  ckpt.wait()
  comparison = converters.compare(tmp_path / "orbax", tmp_path / "ours" / "7")
  assert [d.path for d in comparison.differences] == ["params/params/decoder/layers/mlp/wi_1/kernel"]
  assert "(1 of 16384 elements differ)" in comparison.differences[0].what


def test_compare_reports_at_most_20_paths(source, tmp_path, capsys):
  converters.convert(source, tmp_path / "half", dtype="bfloat16")
  code, out, _ = compare(capsys, source, tmp_path / "half")
  assert code == 1
  assert "... and 16 more" in out and "36 path(s) differ" in out  # 39 arrays, 3 integer ones
  assert len([line for line in out.splitlines() if "dtype float32 vs bfloat16" in line]) == 20


# --- safety and clear failures -------------------------------------------------------------


def test_refused_overwrite_leaves_the_destination_intact(source, tmp_path, capsys):
  destination = tmp_path / "dst"
  converters.convert(source, destination, scan_layers=False)
  before = listing(destination)
  code, _, err = convert(capsys, source, destination, "--layout", "nnx")
  assert code == 2
  assert f"{destination} already exists; pass --force to replace it" in err
  assert listing(destination) == before
  assert [p.name for p in tmp_path.iterdir()] == ["dst"], "no staging folder is left behind"
  assert convert(capsys, source, destination, "--layout", "nnx", "--force")[0] == 0
  assert converters.detect_layout(destination).kind == "nnx"


def test_missing_source_and_non_checkpoint_folder_exit_two(tmp_path, capsys):
  code, _, err = convert(capsys, tmp_path / "nowhere", tmp_path / "dst")
  assert code == 2 and f"{tmp_path / 'nowhere'}: no such file or directory" in err
  (tmp_path / "plain").mkdir()
  (tmp_path / "plain" / "notes.txt").write_text("not a checkpoint")
  code, _, err = convert(capsys, tmp_path / "plain", tmp_path / "dst")
  assert code == 2 and "is not a checkpoint: expected a run directory" in err
  code, _, err = compare(capsys, tmp_path / "plain", tmp_path / "nowhere")
  assert code == 2 and "is not a checkpoint" in err
  assert not (tmp_path / "dst").exists()


def test_truncated_array_file_exits_two_and_writes_nothing(source, tmp_path, capsys):
  damaged = tmp_path / "damaged"
  shutil.copytree(source / "checkpoints" / "6", damaged / "6")
  data = max(
      (p for p in (damaged / "6" / "items").rglob("*") if p.is_file() and p.parent.name == "d"), key=os.path.getsize
  )
  data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
  code, _, err = convert(capsys, damaged, tmp_path / "new" / "checkpoints")
  assert code == 2 and "cannot read" in err and str(damaged / "6" / "items") in err
  assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged"], "nothing written, no folder made"


def test_stacking_with_a_missing_layer_exits_two(source, tmp_path, capsys):
  converters.convert(source, tmp_path / "three", scan_layers=False, params_only=True)
  tree = read_all(tmp_path / "three")
  decoder = tree["params"]["params"]["decoder"]
  decoder["layers_2"] = decoder.pop("layers_1")  # layers_0 and layers_2, no layers_1
  ckpt = checkpointing.Checkpointer(tmp_path / "gap")
  ckpt.save(6, tree)
  ckpt.wait()
  code, _, err = convert(capsys, tmp_path / "gap", tmp_path / "dst", "--scan-layers", "true")
  assert code == 2
  assert "cannot stack params/params/decoder/layers/" in err and "layer(s) [1] missing" in err
  assert not (tmp_path / "dst").exists()


def test_param_scan_axis_that_does_not_match_exits_two(source, tmp_path, capsys):
  code, _, err = convert(capsys, source, tmp_path / "dst", "--scan-layers", "false", "--param-scan-axis", "0")
  assert code == 2
  assert "param_scan_axis 0 does not match the stacked layers" in err
  assert "axes where every array agrees: [1]" in err
  assert not (tmp_path / "dst").exists()


def test_unknown_layout_is_named(tmp_path, capsys):
  ckpt = checkpointing.Checkpointer(tmp_path / "odd")
  ckpt.save(1, {"weights": {"w": jnp.zeros((2,))}})
  ckpt.wait()
  code, _, err = convert(capsys, tmp_path / "odd", tmp_path / "dst")
  assert code == 2 and "top-level keys ['weights']" in err and "model/optimizer (NNX)" in err


def test_layout_paths_round_trip():
  normal = [
      "params/params/decoder/layers_0/mlp/wi_0/kernel",
      "opt_state/0/mu/params/decoder/layers_0/mlp/wi_0/kernel",
      "opt_state/0/count",
      "opt_state/2/count",
      "step",
  ]
  nnx_paths = [layouts.layout_path(p, "nnx") for p in normal]
  assert nnx_paths == [
      "model/decoder/layers_0/mlp/wi_0/kernel",
      "optimizer/opt_state/0/mu/decoder/layers_0/mlp/wi_0/kernel",
      "optimizer/opt_state/0/count",
      "optimizer/opt_state/2/count",
      "optimizer/step",
  ]
  flat = {p: np.zeros(()) for p in nnx_paths}
  assert list(layouts.normal_paths(flat, layouts.detect(flat)).values()) == normal
