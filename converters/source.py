"""The reading side of a conversion: a checkpoint's stored arrays read from its OCDBT database (`Source`), as
encoded bytes or decoded a piece at a time. Apart from the writing (`converters/storage.py`) to keep each small.

Pieces are decoded by hand (`ocdbt.Chunk`, with zstd's streaming decoder) because
tensorstore decodes a chunk only whole, holding its encoded and decoded bytes
at once: a stack stored as one chunk peaked at 4-4.5x its size there, and a
layer sliced from it costs a decode of the whole stack.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tensorstore as ts
import zstandard  # its errors: a damaged chunk

from converters import ocdbt
from converters.keys import BLOCK_BYTES, chunk_key, key_range, zarray_for
from converters.plan import without_axis
from maxbridge.core.checkpointing import CheckpointReader


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
    keys = [k.decode()[len(name) + 1 :] for k in self.kv.list(key_range(name)).result()]
    ndim = len(self.reader.leaves[normal].shape)
    return [tuple(int(i) for i in k.split("."))[:ndim] for k in keys if k != ".zarray"]

  def chunk(self, normal: str, index: tuple[int, ...]) -> bytes:
    return self.read(normal, chunk_key(self.reader.name(normal), index).encode()).value

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
    listed = {k[len(name) :] for k in self.kv.list(key_range(name)).result()}
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
    return meta, {chunk_key("", without_axis(i, axis))[1:]: chunks[k] for k, i in indices.items() if i[axis] == layer}

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
    if meta is None or not plain(meta) or meta["dtype"] != zarray_for((), leaf.dtype, ())["dtype"]:
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
    `streamable` (tensorstore would hold the encoded and decoded chunk besides it); checked against its digest."""
    meta = self.streamable(normal)
    if meta is None:
      return self.reader.read(normal)
    leaf = self.reader.stored_leaf(normal)
    out = np.empty(leaf.shape, leaf.dtype)
    for region, values in self.pieces(normal, meta, 0, piece_rows(meta, leaf.dtype, 0, BLOCK_BYTES // 4), into=out):
      if values.base is not out:
        out[region] = values
    self.reader.check(normal, out)
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


def plain(meta: dict) -> bool:
  """Whether a stored zarr v2 array is in C order, with no filters, its chunk keys joined by dots."""
  return meta.get("order") == "C" and not meta.get("filters") and meta.get("dimension_separator", ".") == "."


def per_layer(meta: dict | None, axis: int) -> bool:
  """Whether a stored stack has one chunk per layer along `axis` and is otherwise `plain`."""
  return meta is not None and meta["chunks"][axis] == 1 and plain(meta)


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
