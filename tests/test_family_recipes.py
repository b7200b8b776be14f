"""SFT, DPO and GRPO losses, and Qwix int8, on the newer families: Linen and NNX agree to 1e-6.

The recipes' own tests (test_sft, test_dpo, test_grpo, test_quantization) run
whole trainings on llama-tiny. Here each newer family gets what could break
in it: the recipes' losses and gradients through its layers (local/global
blocks, sinks, soft-caps, MoE), at the seed-0 weights, from the trainer's own
loss path; and Qwix int8's logits. To keep the suite fast, one compile per
(family, backend) covers the three recipes: their losses are summed into one
`Loss`, each also compared on its own through its aux value, and the model runs
once over the rows of all three (`OnePass`): one differentiated pass and one
reference pass, where each recipe call had its own (three and two). The layers
see the same rows, packed and segmented as each recipe packs them. Where Qwix's
two backends lower to the same forward program (Gemma 4's do), they run one executable.
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge.core import canonical
from maxbridge.training import data, recipe
from maxbridge.training.loss import CrossEntropy, Loss, StepPolicy
from maxbridge.training.posttrain import dpo, grpo
from hf_family import BACKENDS, TOKENS, family_config

PRESETS = [
    "qwen3-moe-tiny",
    "olmo2-tiny",
    "olmo3-tiny",
    "gemma-tiny",
    "gemma2-tiny",
    "gemma3-tiny",
    "gpt-oss-tiny",
    "llama4-tiny",
    "qwen3-next-tiny",
    "gemma4-tiny",
]
MOE = ("qwen3-moe-tiny", "gpt-oss-tiny", "llama4-tiny", "qwen3-next-tiny")
TOL = 1e-6
LENGTH = 16
RECIPES = {"sft": CrossEntropy(), "dpo": dpo.DPO(beta=0.5, label_smoothing=0.1), "grpo": grpo.GRPO(beta=0.1)}
_EXECUTABLES: dict[str, object] = {}


def forward_logits(model: mb.Model) -> np.ndarray:
  """The model's logits on TOKENS, compiled once per lowered program (canonical params: one tree for every
  backend): an identical program reuses its executable."""
  params = model.params()
  lowered = jax.jit(lambda params: model.apply(params, TOKENS)).lower(params)
  key = hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest()
  if key not in _EXECUTABLES:
    _EXECUTABLES[key] = lowered.compile()
  return np.asarray(_EXECUTABLES[key](params))


class OnePass:
  """The forward passes the recipes ask for, run as one: the policy's over the rows of every call, and the
  reference's over the same rows (so that at step 0 each recipe's reference rows are its policy rows, to the bit).

  `record` runs the recipes once against stand-ins that note each call's rows and answer zeros of the right
  shapes (that pass computes nothing the loss returns: XLA drops it); `replay` then answers each call with its
  rows of the two real passes. Each recipe asks the reference for rows it gave the policy, in the same order.
  """

  def __init__(self, policy, reference):
    self.policy, self.reference = policy, reference
    self.calls: list[tuple[str, tuple]] = []  # (recipe, (tokens, positions, segment_ids)) of each policy call
    self.structure = None

  def record(self, recipe: str):
    def stand_in(*rows):
      if self.structure is None:  # one abstract trace: the intermediates do not depend on the rows
        self.structure = jax.eval_shape(self.policy, *rows)
      logits, intermediates = self.structure
      zeros = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), intermediates)
      return jnp.zeros((*rows[0].shape, logits.shape[-1]), logits.dtype), zeros

    def policy(*rows):
      self.calls.append((recipe, rows))
      return stand_in(*rows)

    return policy, stand_in

  def replay(self):
    rows = [jnp.concatenate([args[i] for _, args in self.calls]) for i in range(3)]
    policy_logits, intermediates = self.policy(*rows)
    reference_logits, reference_intermediates = self.reference(*rows)
    starts, start = [], 0
    for _, args in self.calls:
      starts.append(start)
      start += args[0].shape[0]

    def answers(recipe: str):
      mine = [(begin, args[0].shape[0]) for begin, (name, args) in zip(starts, self.calls) if name == recipe]
      asked = {"policy": 0, "reference": 0}

      def answer(kind, logits, inter):
        def call(*rows):
          begin, size = mine[asked[kind]]
          assert rows[0].shape[0] == size, (recipe, kind, rows[0].shape)
          asked[kind] += 1
          return logits[begin : begin + size], inter

        return call

      return answer("policy", policy_logits, intermediates), answer(
          "reference", reference_logits, reference_intermediates
      )

    return answers


class Recipes(Loss):
  """The sum of SFT's, DPO's and GRPO's per-token (DPO: per-pair) losses, each batch under its recipe's prefix;
  aux holds each recipe's loss. The model runs once over all three recipes' rows (`OnePass`)."""

  batch_keys = tuple(f"{name}/{key}" for name, loss in RECIPES.items() for key in loss.batch_keys)
  frozen = StepPolicy()

  def __call__(self, forward, batch, reference=None):
    parts = {name: {key: batch[f"{name}/{key}"] for key in loss.batch_keys} for name, loss in RECIPES.items()}
    one_pass = OnePass(forward, reference)
    for name, loss in RECIPES.items():
      loss(*_with_forwards(parts[name], one_pass.record(name)))
    answers = one_pass.replay()
    total, aux = jnp.float32(0.0), {}
    for name, loss in RECIPES.items():
      value, terms = loss(*_with_forwards(parts[name], answers(name)))
      aux[name] = value / terms["tokens"]
      total += aux[name]
      if name == "dpo":
        aux["dpo margins"] = terms["margins"] / terms["tokens"]
    return total, {**aux, "tokens": jnp.float32(1.0)}


def _with_forwards(part: dict, forwards) -> tuple:
  policy, reference = forwards
  return policy, part, reference


def recipe_batches(config: mb.Config) -> dict:
  """The built-in SFT rows and preference pairs, and GRPO completions of TOKENS' rows with unequal rewards."""
  sft = data.make_dataset(config.replace(dataset_type="sft", sft_train_on_completion_only=True), "train", 2).batch(0)
  pairs = data.make_dataset(config.replace(use_dpo=True), "train", 2).batch(0)
  prompts = [row[:4].tolist() for row in TOKENS]
  completions = [row[4 + i : 8 + 2 * i].tolist() for row in TOKENS for i in range(2)]
  rollouts = grpo.pack_completions(prompts, completions, grpo.group_advantages([[1.0, 0.0], [0.2, 0.9]]), LENGTH)
  batches = {"sft": sft, "dpo": pairs, "grpo": rollouts}
  return {f"{name}/{key}": jnp.asarray(batches[name][key]) for name, loss in RECIPES.items() for key in loss.batch_keys}


def recipe_losses_and_grads(config: mb.Config, batch: dict):
  """({recipe: loss}, flat gradients of their sum) at the seed-0 state, through Trainer._loss (the reference
  is the policy the step starts from, as on a run's first step)."""
  trainer = recipe.create_trainer(config, loss=Recipes())
  state = trainer.init_state(0)

  @jax.jit
  def value_and_grad(state, batch):
    bound = trainer._bind(state)
    (_, aux), grads = jax.value_and_grad(lambda p: trainer._loss(bound, p, batch), has_aux=True)(bound.params)
    return {name: aux[name] for name in (*RECIPES, "dpo margins")}, grads

  losses, grads = value_and_grad(state, batch)
  return jax.device_get(losses), canonical.flatten(jax.device_get(grads))


def _sublayer_scale(preset: str, path: str, grads: dict) -> float:
  """Beside TOL x max(1, the leaf's largest |gradient|) (test_families.py's bound), Qwen3-Next's sub-layers
  scale by their largest |gradient|.

  The backends run the same ops: in float64 their gradients here are equal to the bit; in float32 XLA sums
  some in its own order for each. Qwen3-Next's first DeltaNet layer has gradients near 10 (in_proj_qkvz,
  through the L2-normalised queries and keys), and its norm scale's gradient (2.5 at most) is a sum of
  products of those that cancels: the backends differ there by 2.6e-6, 1e-6 x the layer's 9.1 but just
  over 1e-6 x the leaf's 2.5. Every other family's leaves keep their own bound.
  """
  if preset != "qwen3-next-tiny" or not path.startswith("decoder/layers/"):
    return 0.0
  sublayer = "/".join(path.split("/")[:3]) + "/"
  return max(float(np.max(np.abs(grad))) for other, grad in grads.items() if other.startswith(sublayer))


# gemma4-tiny's KV-shared block holds a subset of the first block's kernels and reads the first block's keys and
# values: the recipes' losses and Qwix (which intercepts each matmul by its module) meet nothing new there, and the
# matrix (test_families.py) compares its forward pass and gradients on both backends. One block halves the row.
OVERRIDES = {"gemma4-tiny": dict(base_num_decoder_layers=6, num_kv_shared_layers=0)}


@pytest.fixture(autouse=True)
def highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


@pytest.mark.parametrize("preset", PRESETS)
def test_sft_dpo_and_grpo_losses_and_gradients_agree_on_linen_and_nnx(preset):
  config = {
      name: family_config(preset, flags, max_target_length=LENGTH, **OVERRIDES.get(preset, {}))
      for name, flags in BACKENDS.items()
  }
  batch = recipe_batches(config["linen"])
  (linen, linen_grads), (nnx, nnx_grads) = (recipe_losses_and_grads(config[name], batch) for name in BACKENDS)
  # At the start the policy is its reference: DPO's margins are 0, its loss log 2 (plus, in the MoE families,
  # the load-balancing loss every recipe adds), and GRPO's ratio is 1.
  assert abs(linen["dpo margins"]) < 1e-6, linen
  if preset in MOE:
    assert linen["dpo"] > np.log(2) + 1e-4, linen
  else:
    np.testing.assert_allclose(linen["dpo"], np.log(2), rtol=1e-6)
  assert np.isfinite(linen["sft"]) and linen["sft"] > 1.0 and linen["grpo"] != 0.0, linen
  for name in linen:
    np.testing.assert_allclose(nnx[name], linen[name], rtol=TOL, atol=TOL, err_msg=name)
  assert sorted(nnx_grads) == sorted(linen_grads)
  for path, grad in linen_grads.items():
    atol = TOL * max(1.0, float(np.max(np.abs(grad))), _sublayer_scale(preset, path, linen_grads))
    np.testing.assert_allclose(nnx_grads[path], grad, rtol=0, atol=atol, err_msg=path)
  assert max(float(np.abs(grad).max()) for grad in linen_grads.values()) > 1e-3


@pytest.mark.parametrize("preset", PRESETS)
def test_qwix_int8_logits_agree_on_linen_and_nnx_and_move_off_float(preset):
  def logits(flags, **overrides):
    return forward_logits(mb.create_model(family_config(preset, flags, **OVERRIDES.get(preset, {}), **overrides), seed=0))

  linen, nnx = (logits(flags, quantization="int8", use_qwix_quantization=True) for flags in BACKENDS.values())
  assert np.all(np.isfinite(linen))
  np.testing.assert_allclose(nnx, linen, atol=TOL, rtol=0)
  assert np.abs(linen - logits(BACKENDS["linen"])).max() > 1e-3  # int8 rounding moves the logits past float noise
