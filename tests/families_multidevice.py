"""The newer families trained on 8 virtual CPU devices and on one; prints one JSON report.

Started by tests/test_families_multidevice.py in a subprocess, because the
device count must be fixed (XLA_FLAGS) before JAX is imported. Each family
trains on one device with Linen, then over fsdp x tensor (x expert for the
MoE families) on 8 with one backend, which must give the one-device losses.

One backend on 8 devices per family, not both: the backends' plans are equal
array by array (the sharding goldens render every preset on both, on these
meshes), Linen and NNX agree on one device (the parity matrix), and
test_sharding.py trains every backend mix sharded. What is left for a family on
8 devices is its own parts meeting the rules; NNX, the default, takes four.
"""

import json
import os
import sys

from fast_compile import xla_flags  # a constant; imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8)

import jax  # noqa: E402  (after XLA_FLAGS)

from maxbridge.core import canonical  # noqa: E402
from multidevice_checks import BACKENDS, STEPS, config, single_device_mesh, train  # noqa: E402
from maxbridge.training import recipe  # noqa: E402

# preset -> (data, fsdp, tensor, expert) on 8 devices: what each family brings that the sharding rules meet, once.
# Left to others: Qwen3-MoE's experts (multidevice_checks.py, with Mixtral's and DeepSeek's), and the families whose
# layers add no parameter kind or cross-head reduction beyond these (OLMo 3: OLMo 2's layers windowed; Gemma 1/2:
# Gemma 3's layers without its QK-norm, in fewer kinds of block).
MESHES = {
    "gpt-oss-tiny": (1, 2, 2, 2),  # sinks (per head, over tensor), biases, fused gate/up experts with biases
    "olmo2-tiny": (1, 4, 2, 1),  # its QK-norm spans every head of a token: a reduction across tensor's shards
    "gemma3-tiny": (1, 4, 2, 1),  # local/global blocks of six and a remainder stack, QK-norm, tied head
    "llama4-tiny": (1, 2, 2, 2),  # a shared expert beside routed ones, alternating dense and MoE layers
    # Its 8 experts over expert=2; tensor=2 splits the DeltaNet's 2 key / 4 value heads and the attention's heads.
    "qwen3-next-tiny": (1, 2, 2, 2),
    # A dense MLP and 4 routed experts (over expert=2) in every layer, per-layer inputs, a wider global layer.
    "gemma4-moe-tiny": (1, 2, 2, 2),
}
SHARDED_BACKEND = {"olmo2-tiny": "linen", "llama4-tiny": "linen"}  # the others: "nnx"
# gemma4-moe-tiny's global layers have one KV head: two, so that tensor=2 can split them. One block (5 local layers
# and a global one) and no KV-shared block, whose layers hold a subset of the same kernels: 12 layers cost twice
# the compile (~80 s more CPU).
OVERRIDES = {
    "gemma4-moe-tiny": dict(global_num_kv_heads=2, base_num_decoder_layers=6, num_kv_shared_layers=0),
}
# The routed experts' first kernel: gpt-oss and Llama 4 fuse gate and up (wi); Qwen3-MoE keeps wi_0 and wi_1.
EXPERT_KERNELS = ("MoeBlock_0/wi", "moe_block/wi_0", "Llama4MoEBlock_0/MoeBlock_0/wi_0")


def main(presets):
  report = {"devices": jax.device_count()}
  for preset in presets:
    shape = MESHES[preset]
    overrides = dict(preset=preset, **OVERRIDES.get(preset, {}))
    one = recipe.create_trainer(config(BACKENDS["linen"], **overrides), single_device_mesh())
    _, report[f"{preset}/linen@1"] = train(one, STEPS)
    name = SHARDED_BACKEND.get(preset, "nnx")
    trainer = recipe.create_trainer(config(BACKENDS[name], shape, **overrides))
    state, report[f"{preset}/{name}@8"] = train(trainer, STEPS)
    # What each device holds of the experts' kernel: (full shape, shard shape) pairs.
    report[f"{preset}/{name}/expert_shards"] = sorted(
        {
            (tuple(leaf.shape), tuple(shard.data.shape))
            for path, leaf in canonical.flatten(trainer.params(state)).items()
            if path.endswith(EXPERT_KERNELS)
            for shard in leaf.addressable_shards
        }
    )
  json.dump(report, sys.stdout)


if __name__ == "__main__":
  main(sys.argv[1:] or list(MESHES))  # a few presets by name, to rerun one
