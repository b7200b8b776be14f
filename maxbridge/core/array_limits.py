"""How long a sequence the step's arrays can describe: past these bounds XLA aborts the process (a C++ abort, exit
134), or an int32 wraps, so `max_target_length` beyond them is refused up front, naming the bound.

Pure Python, like `config_rules`, which runs `check_length` on every Config (one row per device); a trainer runs
it again with its mesh's rows (`recipe.create_trainer`), as XLA sees the step's global shapes.
"""

from __future__ import annotations

import math
from typing import Any

# Positions, segment ids and token ids are int32 arrays [batch, max_target_length] (`data.pack`).
MAX_INT32 = 2**31 - 1
# XLA counts an array's bytes in an int64: a shape of 2**63 bytes or more aborts its compiler (seen as "overflow in
# static extent product" for f32[2**31, 2**30]) or fails its compile ("size may overflow int64_t").
MAX_ARRAY_BYTES = 2**63 - 1
# The kernels that hold every query's scores against every key: [batch, query heads, T, T], float32
# (`ops.attention._attend`); "flash" computes them block by block.
FULL_SCORE_KERNELS = ("dot_product", "autoselected")
_SCORE_BYTES = 4


def longest_attention(config: Any, rows: int) -> int:
  """The longest sequence whose float32 attention scores fit XLA's int64 byte count, for `rows` rows a step.

  The scanned layers keep each one's scores for the backward pass: an array [layers, rows, query heads, T, T]."""
  layers = config.num_decoder_layers if config.scan_layers else 1
  return math.isqrt(MAX_ARRAY_BYTES // (_SCORE_BYTES * layers * rows * config.num_query_heads))


def check_length(config: Any, rows: int, error: type[Exception], where: str = "") -> None:
  """Raises `error` naming max_target_length and its bound if the step's arrays cannot hold that many tokens."""
  length = config.max_target_length
  if length > MAX_INT32:
    raise error(
        f"max_target_length={length} is past what the step can index: positions, segment ids and tokens are int32 "
        f"arrays, so it must be at most {MAX_INT32} (2**31 - 1)"
    )
  if config.attention not in FULL_SCORE_KERNELS:
    return
  longest = longest_attention(config, rows)
  if length > longest:
    layers = f"{config.num_decoder_layers} scanned layers x " if config.scan_layers else ""
    raise error(
        f"max_target_length={length}: attention={config.attention!r} holds float32 scores of every query against "
        f"every key, [{layers}{rows} rows{where} x {config.num_query_heads} query heads x T x T], which past "
        f"T={longest} is over 2**63 bytes, more than XLA can size (its compiler aborts); set max_target_length "
        f"<= {longest}, or attention='flash' (scores computed block by block)"
    )
