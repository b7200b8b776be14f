"""The bytes of an OCDBT database as stored, reached without tensorstore decoding them (for `source.py`, `storage.py`).

`index` lists where each value lies (inline, or a range of a data file);
`Chunk` decodes one stored zarr chunk front to back a piece at a time, with
zstd's streaming decoder, because tensorstore decodes a chunk only whole,
holding its encoded and decoded bytes at once.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts
import zstandard

# Written synchronously file by file, tensorstore fsyncs every OCDBT commit
# (~16 ms each here); `storage.Destination.finish` fsyncs every file once instead.
CONTEXT = ts.Context({"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": False})


def kvstore(items: Path, path: str = "") -> ts.KvStore:
  spec = {"driver": "ocdbt", "base": f"file://{Path(items).absolute()}/", "path": path}
  return ts.KvStore.open(spec, context=CONTEXT).result()


def index(items: Path) -> dict[bytes, bytes | tuple[Path, int, int]]:
  """{key: its inline value, or (data file, offset, length)} of the OCDBT database in `items`.

  Read from OCDBT's index with `tensorstore.ocdbt.dump` (documented, public):
  orbax and tensorstore offer no other way to reach stored bytes without
  copying each value into memory twice (a 160 MiB value read through the
  kvstore peaks at ~3x its size here).
  """
  base = ts.KvStore.open(f"file://{Path(items).absolute()}/", context=CONTEXT).result()
  versions = ts.ocdbt.dump(base).result()["versions"]
  found: dict[bytes, Any] = {}
  waiting = [versions[-1]["root"]["location"]] if versions and "location" in versions[-1]["root"] else []
  while waiting:
    for entry in ts.ocdbt.dump(base, waiting.pop()).result()["entries"]:
      if "inline_value" in entry:
        found[entry["key"]] = entry["inline_value"]
      elif "indirect_value" in entry:
        _, base_path, relative, offset, length = entry["indirect_value"].split(":")
        found[entry["key"]] = (Path(items) / base_path / relative, int(offset), int(length))
      else:  # an interior node: its children
        waiting += [v for v in entry.values() if isinstance(v, str) and v.startswith("btreenode:")]
  return found


def missing_data(items: Path) -> str | None:
  """What the database in `items` points at but its files do not hold (a truncated or missing file), or None.

  A database copied as files is never decoded, so this is checked first, from the index alone.
  """
  sizes: dict[Path, int | None] = {}
  for value in index(items).values():
    if isinstance(value, tuple):
      file, offset, length = value
      if file not in sizes:
        sizes[file] = file.stat().st_size if file.is_file() else None
      if sizes[file] is None or sizes[file] < offset + length:
        held = "is missing" if sizes[file] is None else f"holds {sizes[file]} bytes"
        return f"{file} {held}, but the index points at bytes {offset}..{offset + length}"
  return None


def byte_pieces(value: bytes | tuple[Path, int, int], size: int = 16 << 20) -> Iterator[bytes]:
  if isinstance(value, bytes):
    yield value
    return
  file, offset, length = value
  with open(file, "rb") as f:
    f.seek(offset)
    while length > 0:
      piece = f.read(min(size, length))
      if not piece:
        raise OSError(f"{file} ends before byte {offset + length}")
      length -= len(piece)
      yield piece


class Chunk:
  """The decoded bytes of one stored zarr v2 chunk (zstd-compressed or not), read front to back a piece at a time.

  Memory holds the piece asked for and zstd's window (512 KiB in the chunks
  tensorstore writes), not the chunk: the stored bytes are read from the data
  file in 1 MiB reads.
  """

  def __init__(self, value: bytes | tuple[Path, int, int], compressed: bool, nbytes: int):
    if isinstance(value, bytes):
      self._file, length = io.BytesIO(value), len(value)
    else:
      file, offset, length = value
      self._file = open(file, "rb")  # closed by close()
      self._file.seek(offset)
    if compressed:
      # A window as large as the frame asks for: what decoding it whole would take anyway.
      decoder = zstandard.ZstdDecompressor(max_window_size=1 << 31)
      self._stream = decoder.stream_reader(self._file, read_size=1 << 20, read_across_frames=False, closefd=False)
    elif length != nbytes:
      raise OSError(f"an uncompressed chunk of {nbytes} bytes is stored in {length}")
    else:
      self._stream = self._file

  def read(self, nbytes: int) -> np.ndarray:
    """The next `nbytes` decoded bytes, as a new uint8 array."""
    return self.read_into(np.empty(nbytes, np.uint8))

  def read_into(self, out: np.ndarray) -> np.ndarray:
    """Fills the C-contiguous array `out` with the next decoded bytes; returns it."""
    view, done = memoryview(out.view(np.uint8).reshape(-1)), 0
    while done < out.nbytes:
      got = self._stream.readinto(view[done:])
      if not got:
        raise OSError("a chunk decodes to fewer bytes than its shape holds (truncated?)")
      done += got
    return out

  def close(self) -> None:
    self._file.close()


def stored_bytes(value: tuple[Path, int, int]) -> bytes:
  file, offset, length = value
  with open(file, "rb") as f:
    f.seek(offset)
    found = f.read(length)
  if len(found) != length:
    raise OSError(f"{file} ends before byte {offset + length}")
  return found


def inner_chunk(value: bytes | tuple[Path, int, int], index_bytes: int) -> bytes | tuple[Path, int, int] | None:
  """The stored bytes of the one inner chunk of a zarr3 shard (codec sharding_indexed): the index at its end
  (`index_bytes`) gives their offset and length (two little-endian uint64, both all ones when not stored:
  None), then maybe a crc32c."""
  if isinstance(value, bytes):
    tail = value[-index_bytes:]
  else:
    file, offset, length = value
    tail = stored_bytes((file, offset + length - index_bytes, index_bytes))
  start, length = struct.unpack("<QQ", tail[:16])
  if start == length == 2**64 - 1:
    return None
  return value[start : start + length] if isinstance(value, bytes) else (value[0], value[1] + start, length)
