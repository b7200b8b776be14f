"""Small models written twice, as a Linen author and then an NNX author would, for tests/test_migrate.py.

Each NNX twin names its layers in its own way (fc1, conv, blocks ...) where Linen auto-names them
(Dense_0, Conv_0, ScanBlock ...): the point of `maxbridge.migrate` is to match them anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx

# ---------------------------------------------------------------- an MLP


class LinenMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16)(x))
    x = nn.relu(nn.Dense(16)(x))
    x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(4)(x)


class NNXMLP(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs, activation=nnx.relu, linear=nnx.Linear):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.fc2 = linear(16, 16, rngs=rngs)
    self.fc3 = nnx.Linear(16, 16, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)
    self.activation = activation

  def __call__(self, x):
    x = self.activation(self.fc1(x))
    x = nnx.relu(self.fc2(x))
    x = nnx.relu(self.fc3(x))
    return self.out(x)


class TransposedLinear(nnx.Linear):
  """A twin's bug: the kernel read as (out, in)."""

  def __call__(self, x):
    return x @ self.kernel[...].T + self.bias[...]


# ---------------------------------------------------------------- a CNN with BatchNorm and dropout


class LinenCNN(nn.Module):
  dropout_rate: float = 0.5

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.Dense(16)(x)
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x)
    x = nn.relu(x)
    return nn.Dense(10)(x)


class NNXCNN(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs, dropout_rate: float = 0.5, conv_bias: bool = True):
    self.conv = nnx.Conv(1, 8, (3, 3), use_bias=conv_bias, rngs=rngs)
    self.bn = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.fc1 = nnx.Linear(4 * 4 * 8, 16, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)
    self.fc2 = nnx.Linear(16, 10, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.bn(self.conv(x)))
    x = nnx.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nnx.relu(self.dropout(self.fc1(x)))
    return self.fc2(x)


# ---------------------------------------------------------------- an nn.scan-stacked transformer block

WIDTH, HEADS, LAYERS = 16, 2, 2


class LinenBlock(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    h = nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x))
    x = x + h
    h = nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x))))
    return x + h, None


class LinenTransformer(nn.Module):
  head_bias: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(WIDTH)(x)
    blocks = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
    x, _ = blocks(name="blocks")(x, None)
    return nn.Dense(4, use_bias=self.head_bias)(nn.LayerNorm()(x))


class NNXBlock(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs):
    self.attention_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(HEADS, WIDTH, decode=False, rngs=rngs)
    self.mlp_norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.up = nnx.Linear(WIDTH, 2 * WIDTH, rngs=rngs)
    self.down = nnx.Linear(2 * WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    x = x + self.attention(self.attention_norm(x))
    return x + self.down(nnx.gelu(self.up(self.mlp_norm(x))))


class NNXListTransformer(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Linear(8, WIDTH, rngs=rngs)
    self.blocks = nnx.List([NNXBlock(rngs=rngs) for _ in range(LAYERS)])
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, 4, rngs=rngs)

  def __call__(self, x):
    x = self.embed(x)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


class NNXVmapTransformer(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs):
    self.embed = nnx.Linear(8, WIDTH, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return NNXBlock(rngs=rngs)

    self.blocks = make_blocks(rngs)
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)

    return self.head(self.norm(run(self.embed(x), self.blocks)))


# ---------------------------------------------------------------- an LSTM (nn.RNN)


class LinenLSTM(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(4)(nn.RNN(nn.LSTMCell(16))(x)[:, -1])


class NNXLSTM(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs, head_bias: bool = True):
    self.rnn = nnx.RNN(nnx.LSTMCell(8, 16, rngs=rngs))
    self.head = nnx.Linear(16, 4, use_bias=head_bias, rngs=rngs)

  def __call__(self, x):
    return self.head(self.rnn(x)[:, -1])


# ---------------------------------------------------------------- a custom variable collection


class LinenShifted(nn.Module):
  """Adds a fixed per-feature shift kept in its own collection ('constants')."""

  @nn.compact
  def __call__(self, x):
    shift = self.variable("constants", "shift", lambda: jnp.linspace(-1.0, 1.0, 4))
    return nn.Dense(4)(nn.tanh(nn.Dense(16)(x))) + shift.value


class Constant(nnx.Variable):
  pass


class NNXShifted(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs, extra: bool = False):
    self.hidden = nnx.Linear(8, 16, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)
    self.shift = Constant(jnp.linspace(-1.0, 1.0, 4))
    if extra:
      self.gate = nnx.Param(jnp.ones((4,)))

  def __call__(self, x):
    y = self.out(nnx.tanh(self.hidden(x))) + self.shift[...]
    return y * self.gate[...] if hasattr(self, "gate") else y


# ---------------------------------------------------------------- an MLP with a LayerNorm, and three faulty twins


class LinenNormMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16)(x))
    x = nn.relu(nn.Dense(16)(x))
    x = nn.relu(nn.Dense(16)(x))
    return nn.Dense(4)(nn.LayerNorm()(x))


class NNXNormMLP(nnx.Module):
  """The twin; `swap` runs fc3 before fc2 (same shapes, so every weight still matches), the others as named."""

  def __init__(self, *, rngs: nnx.Rngs, swap: bool = False, activation=nnx.relu, epsilon: float = 1e-6):
    self.fc1 = nnx.Linear(8, 16, rngs=rngs)
    self.fc2 = nnx.Linear(16, 16, rngs=rngs)
    self.fc3 = nnx.Linear(16, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, epsilon=epsilon, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)
    self.swap = swap
    self.activation = activation

  def __call__(self, x):
    x = self.activation(self.fc1(x))
    for layer in (self.fc3, self.fc2) if self.swap else (self.fc2, self.fc3):
      x = nnx.relu(layer(x))
    return self.out(self.norm(x))


def linen_norm_mlp() -> nn.Module:
  return LinenNormMLP()


def nnx_norm_mlp() -> nnx.Module:
  return NNXNormMLP(rngs=nnx.Rngs(0))


def nnx_norm_mlp_swapped() -> nnx.Module:
  return NNXNormMLP(rngs=nnx.Rngs(0), swap=True)


def nnx_norm_mlp_gelu() -> nnx.Module:
  return NNXNormMLP(rngs=nnx.Rngs(0), activation=nnx.gelu)


def nnx_norm_mlp_epsilon() -> nnx.Module:
  return NNXNormMLP(rngs=nnx.Rngs(0), epsilon=1e-3)


# ---------------------------------------------------------------- the cases


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  linen: Callable[[], nn.Module]
  nnx: Callable[..., nnx.Module]
  input_shape: tuple
  eval_kwargs: dict = dataclasses.field(default_factory=dict)  # the Linen call's mode arguments
  train_kwargs: dict = dataclasses.field(default_factory=dict)
  twin_with_bug: Callable[..., nnx.Module] | None = None
  bug_at: tuple[str, str, str] | None = None  # (Linen path, NNX path, "input" | "output")
  extra: dict[str, Any] = dataclasses.field(default_factory=dict)


CASES = [
    Case(
        "mlp",
        LinenMLP,
        NNXMLP,
        (2, 8),
        twin_with_bug=lambda rngs: NNXMLP(rngs=rngs, activation=nnx.gelu),
        bug_at=("Dense_1", "fc2", "input"),
    ),
    Case(
        "cnn",
        lambda: LinenCNN(dropout_rate=0.0),
        lambda rngs: NNXCNN(rngs=rngs, dropout_rate=0.0),
        (2, 8, 8, 1),
        eval_kwargs={"train": False},
        train_kwargs={"train": True},
    ),
    Case("transformer-list", LinenTransformer, NNXListTransformer, (2, 5, 8)),
    Case("transformer-vmap", LinenTransformer, NNXVmapTransformer, (2, 5, 8)),
    Case(
        "lstm",
        LinenLSTM,
        NNXLSTM,
        (2, 5, 8),
        twin_with_bug=lambda rngs: NNXLSTM(rngs=rngs, head_bias=False),
        bug_at=("params/Dense_0/bias", "", "unmatched"),
    ),
    Case("custom-collection", LinenShifted, NNXShifted, (2, 8)),
]


# ---------------------------------------------------------------- factories for `maxbridge migrate` (tests, CLI)


def linen_cnn() -> nn.Module:
  return LinenCNN(dropout_rate=0.0)


def nnx_cnn_with_optimizer() -> tuple[nnx.Module, nnx.Optimizer]:
  model = NNXCNN(rngs=nnx.Rngs(0), dropout_rate=0.0)
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
