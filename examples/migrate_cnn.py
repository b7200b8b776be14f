"""Migrate your own Linen model, checkpoint and all, to the NNX twin you write: `maxbridge migrate`.

The model: a small CNN (Conv, BatchNorm, dropout) whose feature map becomes 16 tokens for two
transformer blocks stacked with `nn.scan`; its NNX twin stacks them with `nnx.vmap`. Four commands
(docs/migrate.md walks through them):

    python examples/migrate_cnn.py train runs/migrate/linen           # a plain Linen loop + orbax
    maxbridge migrate check --linen examples/migrate_cnn.py:linen_model \\
        --nnx examples/migrate_cnn.py:nnx_model --input-shape 2,8,8,1 --linen-arg train=false
    maxbridge migrate convert runs/migrate/linen runs/migrate/nnx --linen examples/migrate_cnn.py:linen_model \\
        --nnx examples/migrate_cnn.py:nnx_model_and_optimizer --input-shape 2,8,8,1 --linen-arg train=false
    python examples/migrate_cnn.py resume runs/migrate/linen runs/migrate/nnx

`python examples/migrate_cnn.py` with no arguments runs all four in a temporary folder.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import orbax.checkpoint as ocp
from flax import linen as nn
from flax import nnx
from flax.training import train_state

WIDTH, HEADS, LAYERS, CLASSES = 16, 2, 2, 10
INPUT_SHAPE = (2, 8, 8, 1)
LEARNING_RATE = 1e-2

# ---------------------------------------------------------------- the Linen model, as it was


class Block(nn.Module):

  @nn.compact
  def __call__(self, x, _):
    x = x + nn.MultiHeadDotProductAttention(num_heads=HEADS)(nn.LayerNorm()(x))
    return x + nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(x)))), None


class LinenNet(nn.Module):
  dropout_rate: float = 0.1

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(WIDTH, (3, 3))(x)))
    x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = nn.Dropout(self.dropout_rate, deterministic=not train)(x.reshape(x.shape[0], -1, WIDTH))
    blocks = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True, "dropout": True}, length=LAYERS)
    x, _ = blocks(name="blocks")(x, None)
    return nn.Dense(CLASSES)(nn.LayerNorm()(x).mean(axis=1))


# ---------------------------------------------------------------- its NNX twin, as written by hand


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


class NNXNet(nnx.Module):

  def __init__(self, *, rngs: nnx.Rngs, dropout_rate: float = 0.1):
    self.conv = nnx.Conv(1, WIDTH, (3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(WIDTH, rngs=rngs)
    self.dropout = nnx.Dropout(dropout_rate, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return NNXBlock(rngs=rngs)

    self.blocks = make_blocks(rngs)
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

  def __call__(self, x):
    x = nnx.avg_pool(nnx.relu(self.bn(self.conv(x))), (2, 2), strides=(2, 2))
    x = self.dropout(x.reshape(x.shape[0], -1, WIDTH))

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)

    return self.head(self.norm(run(x, self.blocks)).mean(axis=1))


# ---------------------------------------------------------------- the factories `maxbridge migrate` calls


def linen_model() -> nn.Module:
  return LinenNet()


def nnx_model() -> nnx.Module:
  return NNXNet(rngs=nnx.Rngs(0))


def nnx_model_and_optimizer() -> tuple[nnx.Module, nnx.Optimizer]:
  model = nnx_model()
  return model, nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)


# ---------------------------------------------------------------- commands 1 and 4


class TrainState(train_state.TrainState):
  batch_stats: dict


def batch():
  x = jax.random.normal(jax.random.key(1), INPUT_SHAPE)
  return x, jax.random.randint(jax.random.key(2), (INPUT_SHAPE[0],), 0, CLASSES)


def cross_entropy(logits, labels):
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train(destination: str, steps: int = 5) -> None:
  """A plain Linen loop: flax's TrainState, BatchNorm statistics, dropout, an orbax checkpoint."""
  model, (x, labels) = linen_model(), batch()
  variables = model.init(jax.random.key(0), x, train=False)
  state = TrainState.create(
      apply_fn=model.apply,
      params=variables["params"],
      tx=optax.adam(LEARNING_RATE),
      batch_stats=variables["batch_stats"],
  )

  @jax.jit
  def step(state, key):
    def loss_fn(params):
      logits, updates = state.apply_fn(
          {"params": params, "batch_stats": state.batch_stats},
          x,
          train=True,
          rngs={"dropout": key},
          mutable=["batch_stats"],
      )
      return cross_entropy(logits, labels), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return loss, state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])

  for i in range(steps):
    loss, state = step(state, jax.random.key(100 + i))
    print(f"linen step {i + 1}: loss {float(loss):.4f}")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(Path(destination).absolute(), state)
  print(f"wrote {destination}")


def resume(linen_checkpoint: str, nnx_checkpoint: str, steps: int = 3) -> float:
  """Restores the converted checkpoint into the NNX twin, checks it against Linen's, and trains on."""
  x, labels = batch()
  with ocp.StandardCheckpointer() as checkpointer:
    linen_state = checkpointer.restore(Path(linen_checkpoint).absolute())
    model, optimizer = nnx_model_and_optimizer()
    target = {
        "model": nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.RngState))),
        "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
    }
    restored = checkpointer.restore(Path(nnx_checkpoint).absolute(), target)
  nnx.update(model, restored["model"])
  nnx.update(optimizer, restored["optimizer"])
  variables = {"params": linen_state["params"], "batch_stats": linen_state["batch_stats"]}
  linen_logits = linen_model().apply(variables, x, train=False)
  model.eval()
  difference = float(jnp.max(jnp.abs(model(x) - linen_logits)))
  print(f"restored at step {int(optimizer.step[...])}; eval logits differ from Linen's by {difference:.2e}")
  model.train()

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: cross_entropy(m(x), labels))(model)
    optimizer.update(model, grads)
    return loss

  for _ in range(steps):
    loss = step(model, optimizer)
    print(f"nnx step {int(optimizer.step[...])}: loss {float(loss):.4f}")
  return difference


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command")
  p = commands.add_parser("train", help="command 1: train in Linen and save an orbax checkpoint")
  p.add_argument("destination")
  p = commands.add_parser("resume", help="command 4: restore the converted checkpoint in NNX and train on")
  p.add_argument("linen_checkpoint")
  p.add_argument("nnx_checkpoint")
  args = parser.parse_args(argv)
  if args.command == "train":
    train(args.destination)
  elif args.command == "resume":
    resume(args.linen_checkpoint, args.nnx_checkpoint)
  else:  # all four, in a temporary folder
    from maxbridge import cli

    here = Path(__file__).absolute()
    shape = ",".join(map(str, INPUT_SHAPE))
    with tempfile.TemporaryDirectory() as tmp:
      linen_dir, nnx_dir = f"{tmp}/linen", f"{tmp}/nnx"
      train(linen_dir)
      common = ["--input-shape", shape, "--linen-arg", "train=false", "--linen", f"{here}:linen_model"]
      if cli.main(["migrate", "check", *common, "--nnx", f"{here}:nnx_model"]) != 0:
        return 1
      code = cli.main(["migrate", "convert", linen_dir, nnx_dir, *common, "--nnx", f"{here}:nnx_model_and_optimizer"])
      if code != 0:
        return code
      if resume(linen_dir, nnx_dir) > 1e-5:
        return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
