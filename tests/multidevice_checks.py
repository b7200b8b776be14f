"""Runs the sharding scenarios on 8 virtual CPU devices and prints one JSON report.

Started by tests/test_sharding.py in a subprocess, because the device count
must be fixed (XLA_FLAGS) before JAX is imported.
"""

import json
import os
import sys
import tempfile

from fast_compile import xla_flags  # a constant; imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8)

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical, checkpointing, sharding  # noqa: E402
from maxbridge.training import data
from maxbridge.serving import engine
from maxbridge.training import recipe

MESHES = {"8x1x1": (8, 1, 1), "1x8x1": (1, 8, 1), "1x4x2": (1, 4, 2), "2x2x2": (2, 2, 2)}
BACKENDS = {
    "linen": (False, False, False),
    "nnx": (True, True, True),
    "nnx-state/linen-model/nnx-decoder": (True, False, True),
    "linen-state/nnx-model/linen-decoder": (False, True, False),
}
STEPS = 3
EXPERTS_MARKER = "=== expert parallelism ==="
# Vocabulary tiling and QK-Clip together, with a threshold low enough that heads are clipped.
LORA = dict(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, lora_weight_qtype="nf4", lora_dropout=0.25)
FEATURES = dict(num_vocab_tiling=4, use_qk_clip=True, qk_clip_threshold=0.5, gradient_accumulation_steps=2)


def config(flags, shape=(1, 8, 1), per_device_batch_size=1, preset="llama-tiny", **overrides):
  pure_nnx, enable_nnx, pure_nnx_decoder = flags
  data_, fsdp, tensor, expert = (*shape, 1)[:4]
  return mb.load_config(
      preset,
      pure_nnx=pure_nnx,
      enable_nnx=enable_nnx,
      pure_nnx_decoder=pure_nnx_decoder,
      ici_data_parallelism=data_,
      ici_fsdp_parallelism=fsdp,
      ici_tensor_parallelism=tensor,
      ici_expert_parallelism=expert,
      per_device_batch_size=per_device_batch_size,
      steps=10,
      **overrides,
  )


def single_device_mesh():
  return Mesh(np.asarray(jax.devices()[:1]).reshape((1,) * len(sharding.MESH_AXES)), sharding.MESH_AXES)


def train(trainer, steps, state=None, start=0):
  batches = data.make_dataset(trainer.config, "train", 8)
  state = trainer.init_state(0) if state is None else state
  losses = []
  for step in range(start, start + steps):
    state, metrics = trainer.train_step(state, trainer.shard_batch(batches.batch(step)))
    losses.append(float(metrics["loss"]))
  return state, losses


def specs(trainer):
  """Every on-disk leaf (params and optimizer state) -> its PartitionSpec, as text."""
  tree = trainer.to_checkpoint(trainer.state_shardings)
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {jax.tree_util.keystr(path): str(leaf.spec) for path, leaf in leaves}


def _expert_kernels(params):
  """The routed experts' stacked kernels (wi_0, wi_1, wo of every MoE block)."""
  return [leaf for path, leaf in canonical.flatten(params).items() if "MoeBlock_0/w" in path or "moe_block/w" in path]


def main():
  report = {"devices": jax.device_count(), "losses": {}, "specs": {}}
  # Every sharded run, of any backend, is compared with this one: Linen on one device.
  _, report["losses"]["linen@1"] = train(recipe.create_trainer(config(BACKENDS["linen"]), single_device_mesh()), STEPS)
  for mesh_name, shape in MESHES.items():
    for name, flags in BACKENDS.items():
      trainer = recipe.create_trainer(config(flags, shape))
      report["specs"][f"{name}@{mesh_name}"] = specs(trainer)
      if name in ("linen", "nnx") or mesh_name == "2x2x2":
        _, report["losses"][f"{name}@{mesh_name}"] = train(trainer, STEPS)

  # The large-model training features, sharded with fsdp and tensor on, on both backends.
  report["features"] = {}
  for name in ("linen", "nnx"):
    one = recipe.create_trainer(config(BACKENDS[name], **FEATURES), single_device_mesh())
    _, report["features"][f"{name}@1"] = train(one, STEPS)
    _, report["features"][f"{name}@2x2x2"] = train(
        recipe.create_trainer(config(BACKENDS[name], (2, 2, 2), **FEATURES)), STEPS
    )

  # Save on one mesh with Linen, restore onto another with NNX, and go on.
  with tempfile.TemporaryDirectory() as tmp:
    saver = recipe.create_trainer(config(BACKENDS["linen"], (1, 8, 1)))
    state, head = train(saver, 2)
    ckpt = checkpointing.Checkpointer(tmp)
    ckpt.save(2, saver.to_checkpoint(state))
    ckpt.wait()
    loader = recipe.create_trainer(config(BACKENDS["nnx"], (2, 2, 2)))
    restored = loader.from_checkpoint(ckpt.restore(2, loader.checkpoint_target()))
    placed = {
        leaf.sharding.spec == want.spec
        for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(loader.state_shardings))
    }
    _, tail = train(loader, 1, restored, start=2)
    report["restore"] = {"losses": head + tail, "shardings_as_target": placed == {True}}

  # A logical name with no rule is replicated (with a warning), never a crash.
  rules = tuple(r for r in config(BACKENDS["linen"]).logical_axis_rules if r[0] != "mlp")
  trainer = recipe.create_trainer(config(BACKENDS["nnx"], logical_axis_rules=rules))
  _, losses = train(trainer, 1)
  report["missing_rule"] = {
      "loss": losses[0],
      "wi_0": specs(trainer)["['params']['params']['decoder']['layers']['mlp']['wi_0']['kernel']"],
  }
  report["engine"] = decode_on_meshes()

  # QLoRA with adapter dropout: the nf4 base's codes and block scales, and the adapters, sharded on 2x2x2.
  report["lora"] = {}
  for name in ("linen", "nnx"):
    one = recipe.create_trainer(config(BACKENDS[name], **LORA), single_device_mesh())
    _, report["lora"][f"{name}@1"] = train(one, STEPS)
    trainer = recipe.create_trainer(config(BACKENDS[name], (2, 2, 2), **LORA))
    state = trainer.init_state(0)
    before = jax.device_get(trainer.stored_base(state))
    state, report["lora"][f"{name}@2x2x2"] = train(trainer, STEPS, state)
    after = jax.device_get(trainer.stored_base(state))
    report["lora"][f"{name}/base_unchanged"] = all(
        np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after))
    )

  # Expert parallelism: the experts split 4 ways (fsdp 2 x expert 4), on both backends.
  # Last, after a marker: GSPMD reshards the grouped expert matmul's rows by
  # replicating them (XLA warns), which the test tolerates here only.
  print(EXPERTS_MARKER, file=sys.stderr, flush=True)
  report["experts"] = {}
  for preset in ("mixtral-tiny", "deepseek3-tiny", "qwen3-moe-tiny"):
    # One reference: Linen on one device (NNX's equal forward pass and gradients there are the parity matrix's).
    one = recipe.create_trainer(config(BACKENDS["linen"], preset=preset), single_device_mesh())
    _, report["experts"][f"{preset}/linen@1"] = train(one, STEPS)
    for name in ("linen", "nnx"):
      trainer = recipe.create_trainer(config(BACKENDS[name], (1, 2, 1, 4), preset=preset))
      state, report["experts"][f"{preset}/{name}@1x2x1x4"] = train(trainer, STEPS)
      report["experts"][f"{preset}/{name}/specs"] = {
          path: spec for path, spec in specs(trainer).items() if path.startswith("['params']") and "wi_0" in path
      }
      # What the arrays hold, not only what the specs say: each device keeps a quarter of the experts.
      report["experts"][f"{preset}/{name}/shards"] = sorted(
          {
              (tuple(leaf.shape), tuple(shard.data.shape))
              for leaf in _expert_kernels(trainer.params(state))
              for shard in leaf.addressable_shards
          }
      )
  json.dump(report, sys.stdout)


def decode_on_meshes():
  """The engine on a 2x2x2 mesh (8 slots over data x fsdp, kv heads over tensor) and on one device, same slots."""
  prompts = {1: np.array([5, 9, 3, 77, 12]), 6: np.arange(1, 12)}
  out = {}
  for name in ("linen", "nnx"):
    params = None
    for where in ("1", "2x2x2"):
      if where == "1":
        eng = engine.Engine(config(BACKENDS[name], per_device_batch_size=8), params, mesh=single_device_mesh())
      else:
        eng = engine.Engine(config(BACKENDS[name], (2, 2, 2)), params)
      params = eng.params
      state = eng.init_decode_state()
      for slot, prompt in prompts.items():
        state = eng.insert(eng.prefill(prompt), state, slot)
      state, first = eng.generate(state)
      state, rest = eng.generate_steps(state, 4)
      cache = canonical.flatten(state.cache)
      out[f"{name}@{where}"] = {
          "slots": eng.max_concurrent_decodes,
          "tokens": np.concatenate([np.asarray(first)[:, None], np.asarray(rest)], axis=1).tolist(),
          "logits": np.asarray(state.logits).tolist(),
          "specs": {
              path: str(leaf.sharding.spec) for path, leaf in cache.items() if path.startswith("decoder/layers_0/")
          },
          "tokens_spec": str(state.tokens.sharding.spec),
      }
  return out


if __name__ == "__main__":
  main()
