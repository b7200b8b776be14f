"""What reading (`converters/source.py`) and writing (`converters/storage.py`) share: an array's keys in an
OCDBT database, the zarr v2 metadata orbax writes for it, and the size of the blocks both work in."""

from __future__ import annotations

import jax
import numpy as np
import tensorstore as ts

COMPRESSOR = {"id": "zstd", "level": 1}  # orbax's default for zarr arrays
BLOCK_BYTES = 32 << 20  # see `storage.Destination`


def key_range(name: str) -> ts.KvStore.KeyRange:
  # Every key of the array `name`: "name/" up to "name0" ("0" follows "/").
  return ts.KvStore.KeyRange(f"{name}/".encode(), f"{name}0".encode())


def chunk_key(name: str, index: tuple[int, ...]) -> str:
  return f"{name}/{'.'.join(map(str, index)) or '0'}"  # a 0-d array's one chunk is "0"


def zarray_for(shape, dtype: np.dtype, chunks, compressor: dict = COMPRESSOR) -> dict:
  """The `.zarray` of a new zarr v2 array, in the form orbax writes it."""
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
