"""Arrays of an orbax checkpoint moved at the storage level: renamed, re-chunked or written one at a time.

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
  one chunk each are stacked the same way. In a copy of the source's files
  (`Destination(copy_from=...)`), OCDBT's `experimental_copy_range_to` points
  the new keys at the bytes the old ones point at: nothing is read
  (`Destination.relabel`, one transaction). Into an empty database, the
  encoded bytes are copied (`copy_keys`, `relocate`): nothing is decoded.
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

Pieces are decoded by hand (`ocdbt.Chunk`, with zstd's streaming decoder) because
tensorstore decodes a chunk only whole, holding its encoded and decoded bytes
at once: a stack stored as one chunk peaked at 4-4.5x its size there, and a
layer sliced from it costs a decode of the whole stack.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
import zstandard  # its errors: a damaged chunk

from converters import ocdbt
from converters.plan import without_axis
from maxbridge.checkpointing import ITEM, CheckpointReader

COMPRESSOR = {"id": "zstd", "level": 1}  # orbax's default for zarr arrays
# For arrays written from decoded pieces (`Destination.unstack`, `copy_pieces`): still zstd frames in zarr v2,
# which orbax and tensorstore decode whatever the level, to the same values. A negative level stores literals
# raw: encoding costs half of level 1's CPU and decoding them again (`compare`, a later conversion) is nearly a
# copy (a one-chunk unscan 7% less CPU, its compare 25%), for files ~8% larger for float32 values and ~29% for
# bfloat16 (measured on random normal values; orbax's level 1 compresses their exponents).
STREAMED_COMPRESSOR = {"id": "zstd", "level": -1}
BLOCK_BYTES = 32 << 20  # see Destination
NUMPY_LEAF = {"value_type": "np.ndarray", "skip_deserialize": False}
NONE_LEAF = {"value_type": "None", "skip_deserialize": True}
# What describes the arrays by their old names (orbax's tree, shardings, per-array metadata), and
# orbax's mark of a finished save: only the database is copied.
_SKIPPED = ("_METADATA", "_sharding", "array_metadatas", "commit_success.txt")


def _range(name: str) -> ts.KvStore.KeyRange:
  # Every key of the array `name`: "name/" up to "name0" ("0" follows "/").
  return ts.KvStore.KeyRange(f"{name}/".encode(), f"{name}0".encode())


class Source:
  """The raw keys of a checkpoint read by `reader`, when orbax stored it as zarr v2 in OCDBT."""

  def __init__(self, reader: CheckpointReader):
    self.reader = reader
    self.raw = reader.zarr_driver == "zarr"  # zarr v2: its encoded chunks are reused as they are
    self.kv = ocdbt.kvstore(reader.items) if reader.zarr_driver else None
    self._by_name: dict[bytes, dict[bytes, Any]] | None = None  # from `index`, when first needed

  @contextlib.contextmanager
  def reading(self, normal: str) -> Iterator[None]:
    """Around a read of the stored bytes of the array `normal` from its data files (`ocdbt`): a truncated
    or damaged file is the reader's damaged-data error, naming the array."""
    try:
      yield
    except (OSError, zstandard.ZstdError) as e:
      raise self.reader.damaged(normal, e) from e

  def stored_bytes(self, normal: str, value: bytes | tuple[Path, int, int]) -> bytes:
    """One stored value of the array `normal` (`stored`), from its data file in one read: read through the
    kvstore, a value is held ~3 times (see `ocdbt.index`)."""
    if isinstance(value, bytes):
      return value
    with self.reading(normal):
      return ocdbt.stored_bytes(value)

  def read(self, normal: str, key: bytes) -> ts.KvStore.ReadResult:
    try:
      return self.kv.read(key).result()
    except Exception as e:  # tensorstore reports damaged data in several types
      raise self.reader.damaged(normal, e) from e

  def zarray(self, normal: str) -> dict | None:
    if not self.raw:
      return None
    found = self.read(normal, f"{self.reader.name(normal)}/.zarray".encode())
    return json.loads(found.value) if found.state == "value" else None

  def chunks(self, normal: str) -> list[tuple[int, ...]]:
    """The chunk grid indices stored for an array (absent chunks are all fill value)."""
    name = self.reader.name(normal)
    keys = [k.decode()[len(name) + 1 :] for k in self.kv.list(_range(name)).result()]
    ndim = len(self.reader.leaves[normal].shape)
    return [tuple(int(i) for i in k.split("."))[:ndim] for k in keys if k != ".zarray"]

  def chunk(self, normal: str, index: tuple[int, ...]) -> bytes:
    return self.read(normal, _chunk_key(self.reader.name(normal), index).encode()).value

  def stored(self, normal: str) -> dict[bytes, Any] | None:
    """{key suffix: stored value} of an array, from the index; None when the index does not list it all."""
    if self.kv is None:
      return None
    if self._by_name is None:
      self._by_name = {}
      for key, value in ocdbt.index(self.reader.items).items():
        name, _, suffix = key.partition(b"/")
        self._by_name.setdefault(name, {})[b"/" + suffix] = value
    name = self.reader.name(normal)
    found = self._by_name.get(name.encode(), {})
    listed = {k[len(name) :] for k in self.kv.list(_range(name)).result()}
    return found if set(found) == listed else None

  def view(self, normal: str, axis: int | None = None, layer: int | None = None) -> tuple[dict, dict] | None:
    """(zarr metadata, {chunk key: stored value}) of an array, or of one layer of a stack stored one
    chunk per layer along `axis` (its chunks, keyed as the layer's own); None when not stored so."""
    found, meta = self.stored(normal), self.zarray(normal)
    if found is None or meta is None:
      return None
    chunks = {k[1:].decode(): v for k, v in found.items() if k != b"/.zarray"}
    if axis is None:
      return meta, chunks
    if not per_layer(meta, axis):
      return None
    meta = {**meta, "shape": without_axis(meta["shape"], axis), "chunks": without_axis(meta["chunks"], axis)}
    ndim = len(meta["shape"]) + 1
    indices = {k: tuple(int(i) for i in k.split("."))[:ndim] for k in chunks}
    return meta, {_chunk_key("", without_axis(i, axis))[1:]: chunks[k] for k, i in indices.items() if i[axis] == layer}

  def streamable(self, normal: str) -> dict | None:
    """How `pieces` decodes an array, {"shape", "chunks", "compressed" (zstd, else raw), "values": {chunk
    index: its stored bytes}}: zarr v2 (zstd or uncompressed, `plain`) or zarr3 (little-endian bytes, zstd
    or not, one inner chunk per shard as orbax writes with use_zarr3) in OCDBT, the dtype as stored, every
    chunk stored, at least one axis. Else None."""
    leaf, stored = self.reader.stored_leaf(normal), self.stored(normal)
    if stored is None or not leaf.shape or not leaf.nbytes:
      return None
    found = self._zarr2(normal, leaf) if self.raw else self._zarr3(normal, leaf)
    if found is None or found["shape"] != list(leaf.shape):
      return None
    values = {}
    for key, value in stored.items():
      if key not in (b"/.zarray", b"/zarr.json"):  # a chunk: "/0.1" (zarr v2), "/c/0/1" (zarr3)
        parts = key[1:].decode().split(".") if self.raw else key[len(b"/c/") :].decode().split("/")
        values[tuple(int(i) for i in parts)] = value
    grid = int(np.prod([-(-n // c) for n, c in zip(found["shape"], found["chunks"])]))
    if len(values) != grid:
      return None
    if found.pop("shard_index"):
      tail = found.pop("index_bytes")
      with self.reading(normal):
        values = {index: ocdbt.inner_chunk(value, tail) for index, value in values.items()}
      if None in values.values():
        return None  # an inner chunk not stored: all fill value
    return {**found, "values": values}

  def _zarr2(self, normal: str, leaf: Any) -> dict | None:
    meta = self.zarray(normal)
    if meta is None or not plain(meta) or meta["dtype"] != _zarray((), leaf.dtype, ())["dtype"]:
      return None
    if (meta.get("compressor") or {"id": "zstd"})["id"] != "zstd":
      return None
    compressed = meta.get("compressor") is not None
    return {"shape": meta["shape"], "chunks": meta["chunks"], "compressed": compressed, "shard_index": False}

  def _zarr3(self, normal: str, leaf: Any) -> dict | None:
    found = self.read(normal, f"{self.reader.name(normal)}/zarr.json".encode())
    if found.state != "value":
      return None
    meta = json.loads(found.value)
    dtype = "bfloat16" if leaf.dtype == jax.numpy.bfloat16 else np.dtype(leaf.dtype).name
    encoding = meta.get("chunk_key_encoding", {})
    if meta.get("data_type") != dtype or encoding.get("name") != "default" or meta["chunk_grid"]["name"] != "regular":
      return None
    if encoding.get("configuration", {}).get("separator", "/") != "/":
      return None
    chunks, codecs, index_bytes = meta["chunk_grid"]["configuration"]["chunk_shape"], meta["codecs"], None
    if [c["name"] for c in codecs] == ["sharding_indexed"]:
      config = codecs[0]["configuration"]
      index_codecs = [c["name"] for c in config["index_codecs"]]
      if config["chunk_shape"] != chunks or config.get("index_location", "end") != "end":
        return None
      if index_codecs not in (["bytes"], ["bytes", "crc32c"]):
        return None
      codecs, index_bytes = config["codecs"], 16 + 4 * (index_codecs[-1] == "crc32c")
    names = [c["name"] for c in codecs]
    if names not in (["bytes"], ["bytes", "zstd"]) or codecs[0].get("configuration", {}).get("endian") != "little":
      return None
    sharded = index_bytes is not None
    layout = {"shape": meta["shape"], "chunks": chunks, "compressed": "zstd" in names, "shard_index": sharded}
    return {**layout, "index_bytes": index_bytes} if sharded else layout

  def pieces(
      self, normal: str, meta: dict, depth: int, rows: int, into: np.ndarray | None = None
  ) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
    """(region of the array, its values) covering a `streamable` array once, chunk by chunk, each chunk
    decoded front to back: in C order a piece chunk[i_0, .., i_{depth-1}, r:r + rows] is contiguous.
    `rows` must divide the chunk's extent along `depth` (see `piece_rows`), so that a piece lies in one
    chunk of an array chunked by `rows` along that axis. A piece of an edge chunk is cut to the array.
    `into`: an array of the array's shape; a piece that is a contiguous part of it is decoded straight
    into that part, and its values are that part (`values.base is into`: nothing left to copy)."""
    shape, chunks = meta["shape"], meta["chunks"]
    dtype = self.reader.stored_leaf(normal).dtype
    piece = (1,) * depth + (rows,) + tuple(chunks[depth + 1 :])
    piece_bytes = int(np.prod(piece)) * dtype.itemsize
    for index, value in sorted(meta["values"].items()):
      origin = [i * c for i, c in zip(index, chunks)]
      nbytes = int(np.prod(chunks)) * dtype.itemsize
      with self.reading(normal), contextlib.closing(ocdbt.Chunk(value, meta["compressed"], nbytes)) as chunk:
        for lead in np.ndindex(*chunks[:depth]):
          for start in range(0, chunks[depth], rows):
            corner = [o + i for o, i in zip(origin, (*lead, start))] + origin[depth + 1 :]
            stop = [min(c + p, n) for c, p, n in zip(corner, piece, shape)]
            region = tuple(map(slice, corner, stop))
            target = into[region] if into is not None else None
            if target is not None and target.shape == piece and target.flags.c_contiguous:
              yield region, chunk.read_into(target)
              continue
            values = chunk.read(piece_bytes).view(dtype).reshape(piece)
            if any(c >= n for c, n in zip(corner, shape)):
              continue  # the padding of an edge chunk
            yield region, values[tuple(slice(0, e - c) for c, e in zip(corner, stop))]
            del values  # so that the next piece is decoded without this one held (its user drops it too)

  def read_array(self, normal: str) -> np.ndarray:
    """The array at a normal path, as `reader.read` gives it, decoded piece by piece into one buffer when it is
    `streamable` (tensorstore would hold the encoded and decoded chunk besides it)."""
    meta = self.streamable(normal)
    if meta is None:
      return self.reader.read(normal)
    leaf = self.reader.stored_leaf(normal)
    out = np.empty(leaf.shape, leaf.dtype)
    for region, values in self.pieces(normal, meta, 0, piece_rows(meta, leaf.dtype, 0, BLOCK_BYTES // 4), into=out):
      if values.base is not out:
        out[region] = values
    return out.astype(self.reader.leaves[normal].dtype, copy=False)


def piece_rows(meta: dict, dtype: np.dtype, depth: int, budget: int) -> int:
  """Rows along axis `depth` of a piece of a chunk (`Source.pieces`): the most that fit in `budget` bytes (at
  least one) and divide the chunk's extent."""
  chunks = meta["chunks"]
  row = int(np.prod(chunks[depth + 1 :])) * np.dtype(dtype).itemsize
  fit = min(chunks[depth], max(1, budget // max(row, 1)))
  return max(d for d in range(1, fit + 1) if chunks[depth] % d == 0)


def same_bytes(a: Source, view_a: tuple, b: Source, view_b: tuple) -> bool:
  """Whether two stored arrays (`Source.view`s) have the same zarr metadata and chunk bytes, so equal
  values; compared piece by piece, nothing decoded. False says nothing: the same values may be encoded
  or chunked differently."""
  found_a, found_b = a.view(*view_a), b.view(*view_b)
  if found_a is None or found_b is None or found_a[0] != found_b[0] or set(found_a[1]) != set(found_b[1]):
    return False
  for key, value in found_a[1].items():
    other = found_b[1][key]
    if isinstance(value, tuple) and isinstance(other, tuple) and value[2] != other[2]:
      return False
    pieces_a, pieces_b = ocdbt.byte_pieces(value), ocdbt.byte_pieces(other)
    if isinstance(value, bytes) or isinstance(other, bytes):
      if b"".join(pieces_a) != b"".join(pieces_b):  # an inline value is small
        return False
    elif any(x != y for x, y in zip(pieces_a, pieces_b)):
      return False
  return True


def _chunk_key(name: str, index: tuple[int, ...]) -> str:
  return f"{name}/{'.'.join(map(str, index)) or '0'}"  # a 0-d array's one chunk is "0"


def _zarray(shape, dtype: np.dtype, chunks, compressor: dict = COMPRESSOR) -> dict:
  return {
      "chunks": list(chunks),
      "compressor": compressor,
      "dimension_separator": ".",
      "dtype": "bfloat16" if dtype == jax.numpy.bfloat16 else np.dtype(dtype).str,
      "fill_value": None,
      "filters": None,
      "order": "C",
      "shape": list(shape),
      "zarr_format": 2,
  }


def plain(meta: dict) -> bool:
  """Whether a stored zarr v2 array is in C order, with no filters, its chunk keys joined by dots."""
  return meta.get("order") == "C" and not meta.get("filters") and meta.get("dimension_separator", ".") == "."


def per_layer(meta: dict | None, axis: int) -> bool:
  """Whether a stored stack has one chunk per layer along `axis` and is otherwise `plain`."""
  return meta is not None and meta["chunks"][axis] == 1 and plain(meta)


class Destination:
  """A new items folder: an OCDBT database, written array by array, then described by `finish`."""

  def __init__(self, items: Path, copy_from: Path | None = None, block_bytes: int = BLOCK_BYTES):
    """`copy_from`: start from a file copy of that items folder's database (its arrays keep their names).
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
      (self.kv / _chunk_key(old, index)).experimental_copy_range_to(target / _chunk_key(new, new_index), exact).result()
    for name in [*renames, *delete]:
      target.delete_range(_range(name)).result()
    txn.commit_async().result()
    self.copied = True

  def copy_keys(self, source: Source, normal: str, name: str) -> None:
    """A source array under a new name (another database: no shared data files): its encoded bytes, copied;
    or, when a value is larger than `block_bytes`, decoded and written again a piece at a time (`copy_pieces`):
    a value written through the kvstore is held ~3 times."""
    old = source.reader.name(normal)
    stored = source.stored(normal)
    if stored is None:
      for key in source.kv.list(_range(old)).result():
        self._put(f"{name}{key.decode()[len(old):]}", source.read(normal, key).value)
      return
    largest = max(len(v) if isinstance(v, bytes) else v[2] for v in stored.values())
    if largest > self.block_bytes and self.copy_pieces(source, normal, name, source.reader.stored_leaf(normal)):
      return
    for suffix, value in stored.items():
      self._put(f"{name}{suffix.decode()}", source.stored_bytes(normal, value))

  def relocate(self, source: Source, normal: str, index: tuple[int, ...], name: str, new_index: tuple[int, ...]) -> None:
    """Copies one encoded chunk of a source array into the chunk `new_index` of the array `name`."""
    self._put(_chunk_key(name, new_index), source.chunk(normal, index))

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
    meta = _zarray(shape, dtype, chunks, compressor)
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

  def finish(self, skeleton: Any, step: int) -> None:
    """Waits for every write, commits the arrays' .zarray keys, writes `_METADATA` and fsyncs everything."""
    for future, _ in self._waiting:
      future.result()
    self._waiting = []
    txn = ts.Transaction()
    for name, meta in self._zarrays.items():
      self.kv.with_transaction(txn).write(f"{name}/.zarray".encode(), json.dumps(meta).encode()).result()
    txn.commit_async().result()
    (self.items / "_METADATA").write_text(json.dumps(tree_metadata(skeleton)))
    step_dir = self.items.parent
    now = time.time_ns()
    handler = ocp.PyTreeCheckpointHandler
    # As CheckpointManager(item_handlers={"items": PyTreeCheckpointHandler()}) leaves a step,
    # so our Checkpointer (and MaxText) list and restore it.
    (step_dir / "_CHECKPOINT_METADATA").write_text(
        json.dumps(
            {
                "item_handlers": {ITEM: f"{handler.__module__}.{handler.__qualname__}"},
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
  # Not shutil.copytree: it copies the source's permissions, and what we write follows the user's umask.
  for folder, folders, names in os.walk(source):
    here = destination / Path(folder).relative_to(source)
    folders[:] = [name for name in folders if Path(folder) != source or name not in _SKIPPED]
    for name in folders:
      (here / name).mkdir()
    for name in names:
      if Path(folder) != source or name not in _SKIPPED:
        shutil.copyfile(os.path.join(folder, name), here / name)  # copy_file_range / sendfile: no user-space copy


# One thread for the process: a thread per array would get its own malloc arena, each keeping the pieces
# it freed (a one-chunk unscan peaked at 2.3x the largest array so, 1.1-1.3x with this one).
_AHEAD = ThreadPoolExecutor(1, thread_name_prefix="decode-ahead")


def ahead(items: Iterator[Any]) -> Iterator[Any]:
  """`items`, each made on another thread while the one before it is used, so that decoding the next piece
  (zstd decodes without the GIL) overlaps writing this one (tensorstore encodes on its own threads); two
  items are held at once."""
  upcoming = _AHEAD.submit(next, items, None)
  try:
    while (item := upcoming.result()) is not None:
      upcoming = _AHEAD.submit(next, items, None)
      yield item
      del item
  finally:
    upcoming.cancel() or upcoming.exception()


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
