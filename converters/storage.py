"""Arrays of an orbax checkpoint moved at the storage level: renamed, re-chunked or written one at a time.
This module writes them (`Destination`); `source.py` reads them, `keys.py` holds what both use: split to keep each small.

Orbax stores the arrays of a tree as zarr arrays in one OCDBT database (a
key-value store with keys `<name>/.zarray` and `<name>/<chunk index>`, `<name>`
the tree keys joined by dots) and describes the tree in `_METADATA`. It saves
and restores whole trees: it has no API to rename an array, to add one array to
a saved tree, or to copy one without decoding it. So a conversion works on that
storage with tensorstore's kvstore and zarr drivers, and writes `_METADATA` in
the form orbax writes for numpy leaves (`tree_metadata`):

- a rename gives an array's keys new names; a stack stored one chunk per layer
  is unstacked by giving each chunk its layer's key (a chunk of shape
  [.., 1, ..] in C order holds the bytes of the layer), and layers stored as
  one chunk each are stacked the same way. In a copy of the source's
  database (`Destination(copy_from=...)`, its data files linked), OCDBT's
  `experimental_copy_range_to` points the new keys at the bytes the old ones
  point at: nothing is read (`Destination.relabel`, one transaction). Into
  an empty database, the encoded bytes are copied (`copy_keys`, `relocate`):
  nothing is decoded.
  Stacks written here have one chunk per layer for that reason;
- a stack stored in a few large chunks (orbax's default is one per array, as
  MaxText saves on one device; a stack sharded over devices has one per
  shard, each holding every layer), in zarr v2 or zarr3 (MaxText's default),
  is unstacked by decoding each chunk front to back in pieces
  (`Source.pieces`): a piece of whole rows holds a piece of every layer,
  which fills whole chunks of the layers (`Destination.unstack`), written
  while the next piece is decoded on another thread (`ahead`);
- anything else (a cast, a moved axis) is decoded and written through the zarr
  driver, a block at a time; arrays read whole are decoded chunk by chunk
  into one buffer (`Source.read_array`).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from converters import ocdbt
from converters.keys import BLOCK_BYTES, COMPRESSOR, chunk_key, key_range, zarray_for
from converters.plan import without_axis
from converters.source import Source, ahead, piece_rows
from maxbridge.core.checkpointing import DIGESTS, DIGESTS_FILE, ITEM

# For arrays written from decoded pieces (`Destination.unstack`, `copy_pieces`): still zstd frames in zarr v2,
# which orbax and tensorstore decode whatever the level, to the same values. A negative level stores literals
# raw: encoding costs half of level 1's CPU and decoding them again (`compare`, a later conversion) is nearly a
# copy (a one-chunk unscan 7% less CPU, its compare 25%), for files ~8% larger for float32 values and ~29% for
# bfloat16 (measured on random normal values; orbax's level 1 compresses their exponents).
STREAMED_COMPRESSOR = {"id": "zstd", "level": -1}
NUMPY_LEAF = {"value_type": "np.ndarray", "skip_deserialize": False}
NONE_LEAF = {"value_type": "None", "skip_deserialize": True}
# What describes the arrays by their old names (orbax's tree, shardings, per-array metadata), and
# orbax's mark of a finished save: only the database is copied.
_SKIPPED = ("_METADATA", "_sharding", "array_metadatas", "commit_success.txt")


class Destination:
  """A new items folder: an OCDBT database, written array by array, then described by `finish`."""

  def __init__(self, items: Path, copy_from: Path | None = None, block_bytes: int = BLOCK_BYTES):
    """`copy_from`: start from a copy of that items folder's database, its data files linked (`_copy_files`;
    its arrays keep their names).
    `block_bytes`: the most bytes written in one piece, and the most left waiting to be written."""
    self.items = Path(items)
    self.block_bytes = block_bytes
    self.items.mkdir(parents=True)
    if copy_from is not None:
      _copy_files(Path(copy_from), self.items)
    self.kv = ocdbt.kvstore(self.items)
    self.copied = False  # whether `relabel` ran: the database shares the source's data files
    self._zarrays: dict[str, dict] = {}  # written with `finish`, in one commit
    self._waiting: list[tuple[Any, int]] = []  # (write future, bytes)

  def relabel(self, renames: dict[str, str], moves: list[tuple[str, tuple, str, tuple]], delete: list[str]) -> None:
    """In the copied database: arrays renamed ({old name: new}), chunks moved to other arrays
    ((old name, chunk index, new name, new index)), and the arrays in `delete` removed.

    OCDBT's `experimental_copy_range_to` points the new keys at the bytes the
    old ones point at. One transaction: one commit for all, and all or none happen.
    """
    txn = ts.Transaction(atomic=True)
    target = self.kv.with_transaction(txn)
    for old, new in renames.items():
      (self.kv / f"{old}/").experimental_copy_range_to(target / f"{new}/").result()
    for old, index, new, new_index in moves:
      # The exact key: a prefix "a/0.1" would also take "a/0.10".
      exact = ts.KvStore.KeyRange(b"", b"\0")
      (self.kv / chunk_key(old, index)).experimental_copy_range_to(target / chunk_key(new, new_index), exact).result()
    for name in [*renames, *delete]:
      target.delete_range(key_range(name)).result()
    txn.commit_async().result()
    self.copied = True

  def copy_keys(self, source: Source, normal: str, name: str) -> None:
    """A source array under a new name (another database: no shared data files): its encoded bytes, copied;
    or, when a value is larger than `block_bytes`, decoded and written again a piece at a time (`copy_pieces`):
    a value written through the kvstore is held ~3 times."""
    old = source.reader.name(normal)
    stored = source.stored(normal)
    if stored is None:
      for key in source.kv.list(key_range(old)).result():
        self._put(f"{name}{key.decode()[len(old):]}", source.read(normal, key).value)
      return
    largest = max(len(v) if isinstance(v, bytes) else v[2] for v in stored.values())
    if largest > self.block_bytes and self.copy_pieces(source, normal, name, source.reader.stored_leaf(normal)):
      return
    for suffix, value in stored.items():
      self._put(f"{name}{suffix.decode()}", source.stored_bytes(normal, value))

  def relocate(self, source: Source, normal: str, index: tuple[int, ...], name: str, new_index: tuple[int, ...]) -> None:
    """Copies one encoded chunk of a source array into the chunk `new_index` of the array `name`."""
    self._put(chunk_key(name, new_index), source.chunk(normal, index))

  def describe(self, name: str, meta: dict) -> None:
    self._zarrays[name] = meta

  def create(
      self,
      name: str,
      shape: tuple[int, ...],
      dtype: np.dtype,
      layer_axis: int | None = None,
      chunks=None,
      compressor: dict = COMPRESSOR,
  ) -> ts.TensorStore:
    """A new zarr array, chunked as `chunks` says, else: a stack gets one chunk per layer, and chunks are
    split along the first other axis to at most `block_bytes`."""
    if chunks is None:
      chunks = list(shape)
      if layer_axis is not None:
        chunks[layer_axis] = 1
      free = [a for a in range(len(shape)) if a != layer_axis]
      if free and shape[free[0]]:
        row = int(np.prod(chunks, dtype=np.int64)) // chunks[free[0]] * np.dtype(dtype).itemsize
        chunks[free[0]] = max(1, min(shape[free[0]], self.block_bytes // max(row, 1)))
    meta = zarray_for(shape, dtype, chunks, compressor)
    self._zarrays[name] = meta
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "ocdbt", "base": f"file://{self.items.absolute()}/", "path": f"{name}/"},
    }
    # assume_metadata: .zarray is written with `finish`, in one commit with the others.
    return ts.open({**spec, "metadata": meta}, open=True, assume_metadata=True, context=ocdbt.CONTEXT).result()

  def write(self, array: ts.TensorStore, index: tuple, block: np.ndarray) -> None:
    self._wait_for(array[index].write(block, can_reference_source_data_indefinitely=True).commit, block.nbytes)

  def write_all(self, array: ts.TensorStore, values: np.ndarray) -> None:
    """Writes `values` chunk row by chunk row, cast and made contiguous one row at a time."""
    for index in blocks(array):
      self.write(array, index, np.asarray(values[index], array.dtype.numpy_dtype, order="C"))

  def copy_pieces(self, source: Source, normal: str, name: str, leaf: Any, layer_axis: int | None = None) -> bool:
    """Writes a source array as the array `name` (shape and dtype: `leaf`, a cast if the dtype differs) from
    its `Source.pieces`, a stack (`layer_axis`) one chunk per layer; False, and nothing written, when the
    source is not `streamable`."""
    found = self._plan_pieces(source, normal, layer_axis)
    if found is None:
      return False
    chunks = found[3]
    if layer_axis is None:
      self._write_pieces(source, normal, found, [self._create_cut(name, leaf, chunks)], None)
      return True
    array = self._create_cut(name, leaf, chunks[:layer_axis] + [1] + chunks[layer_axis:])
    layers = [array[(slice(None),) * layer_axis + (i,)] for i in range(leaf.shape[layer_axis])]
    self._write_pieces(source, normal, found, layers, layer_axis)
    return True

  def unstack(self, source: Source, normal: str, axis: int, outputs: list[tuple[str, Any]]) -> bool:
    """Writes the layers of a stack (layer axis `axis`) as the arrays `outputs` ((name, `Leaf`), by layer)
    from its `Source.pieces`; False, and nothing written, when the stack is not `streamable`."""
    found = self._plan_pieces(source, normal, axis)
    if found is None or len(found[0]["shape"]) < 2:
      return False
    self._write_pieces(source, normal, found, [self._create_cut(n, leaf, found[3]) for n, leaf in outputs], axis)
    return True

  def _plan_pieces(self, source: Source, normal: str, layer_axis: int | None) -> tuple[dict, int, int, list] | None:
    """(zarr metadata, depth, rows) for the `Source.pieces` of a `streamable` array, and the chunks of a
    layer (of the array, when `layer_axis` is None) that its pieces fill whole, so that they are written
    without reading anything back: the stored chunks, cut to `rows` along their first axis. None when the
    array is not streamable.

    A piece of whole rows of a stack's chunk holds the same rows of each of
    its layers, written as one chunk each (with the layer axis first, a piece
    is rows of one layer: depth 1).
    """
    meta = source.streamable(normal)
    if meta is None:
      return None
    depth = 1 if layer_axis == 0 and len(meta["shape"]) > 1 else 0
    writes = meta["chunks"][layer_axis] if layer_axis is not None and depth == 0 else 1
    stored = source.reader.stored_leaf(normal)
    # Each write at most block_bytes / 4 (see `_wait_for`), and a piece at most ~1/32 of a large array, two held
    # at once (`ahead`): fewer, larger chunks than block_bytes allows, still a fraction of the array in memory
    # (pieces of 1/16 peaked 0.1-0.2x the largest array higher, no faster).
    budget = min(max(self.block_bytes // 2, stored.nbytes // 32), self.block_bytes // 4 * writes)
    rows = piece_rows(meta, stored.dtype, depth, budget)
    chunks = list(meta["chunks"] if layer_axis is None else without_axis(meta["chunks"], layer_axis))
    chunks[0] = rows
    return meta, depth, rows, chunks

  def _create_cut(self, name: str, leaf: Any, chunks: list[int]) -> ts.TensorStore:
    chunks = [min(c, n) for c, n in zip(chunks, leaf.shape)]
    return self.create(name, leaf.shape, leaf.dtype, chunks=chunks, compressor=STREAMED_COMPRESSOR)

  def _write_pieces(self, source: Source, normal: str, planned: tuple, targets: list, layer_axis: int | None) -> None:
    """Writes the pieces of a source array into `targets`: one array, or one per layer of a stack."""
    meta, depth, rows, _ = planned

    def write(target: ts.TensorStore, region: tuple, values: np.ndarray) -> None:
      self.write(target, region, np.asarray(values, target.dtype.numpy_dtype, order="C"))

    # The next piece is decoded while this one is written (`ahead`): two pieces held.
    for region, values in ahead(source.pieces(normal, meta, depth, rows)):
      if layer_axis is None:
        write(targets[0], region, values)
      else:
        for i, layer in enumerate(range(region[layer_axis].start, region[layer_axis].stop)):
          write(targets[layer], without_axis(region, layer_axis), values[(slice(None),) * layer_axis + (i,)])
      del values  # so that the piece after the next is decoded without this one held (see `Source.pieces`)

  def _put(self, key: str, value: bytes) -> None:
    self._wait_for(self.kv.write(key.encode(), value), len(value))

  def _wait_for(self, future, nbytes: int) -> None:
    # Writes left in flight share OCDBT commits (one each costs ~16 ms) and
    # encode in parallel; until written, their bytes are held ~4 times (the
    # values, encoded, and on their way through OCDBT: measured), so at most
    # block_bytes / 4 of them (or one larger) wait.
    self._waiting.append((future, nbytes))
    while len(self._waiting) > 1 and sum(n for _, n in self._waiting) > self.block_bytes // 4:
      self._waiting.pop(0)[0].result()

  def settle(self) -> None:
    """Waits for the writes in flight, whatever their outcome: a folder being removed must have no writer left."""
    for future, _ in self._waiting:
      try:
        future.result()
      except Exception:  # pylint: disable=broad-except  # the error that matters is being raised already
        pass
    self._waiting = []

  def finish(self, skeleton: Any, step: int, digests: dict[str, str] | None = None) -> None:
    """Waits for every write, commits the arrays' .zarray keys, writes `_METADATA` (and the `digests` item, as
    `Checkpointer.save` writes it, when given) and fsyncs everything."""
    for future, _ in self._waiting:
      future.result()
    self._waiting = []
    txn = ts.Transaction()
    for name, meta in self._zarrays.items():
      self.kv.with_transaction(txn).write(f"{name}/.zarray".encode(), json.dumps(meta).encode()).result()
    txn.commit_async().result()
    (self.items / "_METADATA").write_text(json.dumps(tree_metadata(skeleton)))
    step_dir = self.items.parent
    handlers = {ITEM: ocp.PyTreeCheckpointHandler}
    if digests:
      (step_dir / DIGESTS).mkdir()
      (step_dir / DIGESTS / DIGESTS_FILE).write_text(json.dumps(digests))
      handlers[DIGESTS] = ocp.JsonCheckpointHandler
    now = time.time_ns()
    # As CheckpointManager(item_handlers={"items": PyTreeCheckpointHandler(), ...}) leaves a step,
    # so our Checkpointer (and MaxText) list and restore it.
    (step_dir / "_CHECKPOINT_METADATA").write_text(
        json.dumps(
            {
                "item_handlers": {name: f"{h.__module__}.{h.__qualname__}" for name, h in handlers.items()},
                "metrics": {},
                "performance_metrics": {},
                "init_timestamp_nsecs": now,
                "commit_timestamp_nsecs": now,
                "custom_metadata": {},
            }
        )
    )
    fsync_tree(step_dir)


def _copy_files(source: Path, destination: Path) -> None:
  """The files of an items folder's database, the data files linked where the file system allows, else copied.

  OCDBT never writes into a data file once it is written (a commit adds new
  ones, and replaces the manifest, which is copied), so the two databases may
  share them: a layout-only conversion then writes no array's bytes at all, and
  the source stays as it was. A link shares the source file's owner and mode,
  so only a file that a copy would give the same ones is linked (the user's
  own, with the mode their umask gives). Linking fails across file systems;
  such files are copied too.
  """
  # Not shutil.copytree: it copies the source's permissions, and what we write follows the user's umask.
  mode = _new_file_mode()
  for folder, folders, names in os.walk(source):
    here = destination / Path(folder).relative_to(source)
    folders[:] = [name for name in folders if Path(folder) != source or name not in _SKIPPED]
    for name in folders:
      (here / name).mkdir()
    for name in names:
      if Path(folder) == source and name in _SKIPPED:
        continue
      path = os.path.join(folder, name)
      if Path(folder).name == "d" and _owned_with_mode(path, mode):  # a data file, as a copy would be
        try:
          os.link(path, here / name)
          continue
        except OSError:
          pass
      shutil.copyfile(path, here / name)  # copy_file_range / sendfile: no user-space copy


def _new_file_mode() -> int | None:
  """The mode a file created now gets (0o666 less the umask), or None where the umask cannot be read without
  setting it (os.umask sets it, which another thread would see): Linux reports it in /proc."""
  try:
    with open("/proc/self/status", encoding="ascii") as status:
      umask = next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
  except (OSError, StopIteration, ValueError):
    return None
  return 0o666 & ~umask


def _owned_with_mode(path: str, mode: int | None) -> bool:
  found = os.stat(path)
  return mode is not None and found.st_uid == os.getuid() and stat.S_IMODE(found.st_mode) == mode


def blocks(array: ts.TensorStore) -> Iterator[tuple]:
  """Index tuples covering `array` in whole chunks, chunk row by chunk row along the chunked axes."""
  shape = array.shape
  if not shape:
    yield ()
    return
  chunks = array.chunk_layout.read_chunk.shape
  ranges = [range(0, n, c) if c < n else [0] for n, c in zip(shape, chunks)]
  for starts in np.ndindex(*[len(r) for r in ranges]):
    yield tuple(
        slice(r[s], min(r[s] + c, n)) if c < n else slice(None) for r, s, c, n in zip(ranges, starts, chunks, shape)
    )


def tree_metadata(skeleton: Any) -> dict:
  """`_METADATA` for a tree of numpy leaves (and None entries), as orbax's PyTreeCheckpointHandler writes it."""
  entries = {}
  for keypath, leaf in jax.tree_util.tree_flatten_with_path(skeleton, is_leaf=lambda x: x is None)[0]:
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath]
    types = [1 if isinstance(k, jax.tree_util.SequenceKey) else 2 for k in keypath]  # orbax's KeyType
    entries[str(tuple(keys))] = {
        "key_metadata": [{"key": key, "key_type": kind} for key, kind in zip(keys, types)],
        "value_metadata": NONE_LEAF if leaf is None else NUMPY_LEAF,
    }
  return {
      "tree_metadata": entries,
      "use_ocdbt": True,
      "use_zarr3": False,
      "store_array_data_equal_to_fill_value": True,
      "custom_metadata": None,
  }


def fsync_tree(root: Path) -> None:
  """Flushes every file and folder under `root` to disk (what tensorstore was told not to do per commit).

  From several threads: the file system then commits their journal entries
  together (~3x faster here for a few hundred data files than one by one).
  """
  paths = [os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names]
  with ThreadPoolExecutor(16) as pool:
    list(pool.map(_fsync, paths))
  for folder, _, _ in os.walk(root):
    _fsync(folder)


def _fsync(path: str) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
