"""What the family tests (test_gemma, test_olmo2, test_olmo3, test_qwen3_moe, test_gpt_oss) share.

Each of those files builds a tiny random `transformers` model, saves it, and
checks the same things against it: logits, a greedy continuation through
`generate` and through `mb.Engine`, and an export that loads in transformers
and re-imports to the same tree. The checks live here once; the files keep
what is their family's own. Not a test file: pytest collects nothing here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import maxbridge as mb
from maxbridge import cli
from maxbridge.core import canonical
from maxbridge.interop import pretrained
from maxbridge.training import data, recipe
from conftest import LINEN, LINEN_FLAGS
from test_hf import LOGITS_TOL, max_diff, randomize
from test_vocab_tiling import _batch, _grads

NNX = (True, True, True)
BACKENDS = {"linen": LINEN, "nnx": NNX}
PROMPT = np.array([[3, 17, 250, 42, 9], [100, 1, 77, 200, 31]], np.int64)
NEW_TOKENS = 24
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 12))
# What every family's tiny random transformers model shares (the families' DIMS add their own).
TINY = dict(hidden_size=64, vocab_size=256, num_attention_heads=4, initializer_range=0.1)


@pytest.fixture(autouse=True)
def highest_precision():
  """float32 matmuls at full precision, so that 1e-4 against transformers means something."""
  with jax.default_matmul_precision("highest"):
    yield


def family_config(preset: str, flags, **overrides) -> mb.Config:
  return mb.load_config(preset, **dict(zip(LINEN_FLAGS, flags)), **overrides)


class Saved:
  """A tiny random transformers model, saved with save_pretrained, and what transformers computes with it.

  `model` is built by the caller (seeded); `prepare`, if given, edits it after randomize.
  """

  def __init__(self, model, folder, generate: bool = True, prepare=None):
    self.model = model.eval()
    randomize(self.model)
    if prepare is not None:
      prepare(self.model)
    self.folder = folder
    self.model.save_pretrained(folder)
    with torch.no_grad():
      self.logits = self.model(torch.tensor(TOKENS)).logits.numpy()
      if generate:
        self.continuation = self.model.generate(
            torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        ).numpy()
    assert np.std(self.logits) > 0.1, "logits too flat to tell a wrong mapping from a right one"


def assert_matches_transformers(model, reference: Saved, **engine_overrides) -> None:
  """Logits within LOGITS_TOL, and 24 greedy tokens equal to transformers' cached `generate`, by
  `model.generate` and by mb.Engine (both prompts in two decode slots)."""
  assert max_diff(model.logits(jnp.asarray(TOKENS, jnp.int32)), reference.logits) <= LOGITS_TOL
  continuation = model.generate(PROMPT, max_new_tokens=NEW_TOKENS)
  np.testing.assert_array_equal(np.asarray(continuation), reference.continuation)
  config = model.config.replace(per_device_batch_size=2, max_prefill_predict_length=8, **engine_overrides)
  engine = mb.Engine(config, model=model)
  state = engine.init_decode_state()
  for slot, prompt in enumerate(PROMPT):
    state = engine.insert(engine.prefill(prompt), state, slot)
  first = np.asarray(state.tokens)[:, None]
  state, tokens = engine.generate_steps(state, NEW_TOKENS - 1)
  np.testing.assert_array_equal(np.concatenate([first, tokens], axis=1), reference.continuation[:, PROMPT.shape[1] :])


def export_and_reimport(reference: Saved, tmp_path, model_class, tol: float = 1e-5):
  """import-hf, export-hf (which must load in transformers as `model_class`, giving the same logits within `tol`),
  and import-hf again unscanned; returns (the exported transformers model, first tree, again tree), both flat
  and unscanned, with the same paths."""
  assert cli.main(["import-hf", str(reference.folder), str(tmp_path / "ckpt")]) == 0
  assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "exported")]) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
  assert type(exported) is model_class
  with torch.no_grad():
    assert max_diff(exported(torch.tensor(TOKENS)).logits.numpy(), reference.logits) <= tol
  assert cli.main(["import-hf", str(tmp_path / "exported"), str(tmp_path / "again"), "--scan-layers", "false"]) == 0
  _, first = pretrained.load_checkpoint(tmp_path / "ckpt")
  _, again = pretrained.load_checkpoint(tmp_path / "again")
  first = canonical.flatten(canonical.unstack_layers(first, 1) if canonical.is_scanned(first) else first)
  again = canonical.flatten(again)
  assert sorted(first) == sorted(again)
  return exported, first, again


def assert_same_tree(first: dict, again: dict) -> None:
  for path in first:
    np.testing.assert_array_equal(first[path], again[path], err_msg=path)


def tiled_and_untiled_grads(preset: str, flags, **overrides):
  """((loss, flat grads) untiled, (loss, flat grads) with num_vocab_tiling=4), on the same packed batch."""
  batch = _batch(family_config(preset, flags, **overrides))
  want_loss, want = _grads(family_config(preset, flags, **overrides), batch)
  loss, grads = _grads(family_config(preset, flags, num_vocab_tiling=4, **overrides), batch)
  want, grads = canonical.flatten(want), canonical.flatten(grads)
  assert sorted(grads) == sorted(want)
  return (want_loss, want), (loss, grads)


def assert_tiled_nnx_matches_untiled_linen(preset: str, **overrides) -> None:
  """num_vocab_tiling=4 on pure NNX gives untiled pure Linen's loss and gradients: tiling and the backends in one
  row (two compiles of the model's gradients, not four), for a model whose compile dominates its tests."""
  untiled = family_config(preset, LINEN, z_loss_multiplier=1e-3, **overrides)
  batch = _batch(untiled, rows=2)
  want_loss, want = _grads(untiled, batch)
  loss, grads = _grads(family_config(preset, NNX, num_vocab_tiling=4, z_loss_multiplier=1e-3, **overrides), batch)
  want, grads = canonical.flatten(want), canonical.flatten(grads)
  assert sorted(grads) == sorted(want)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for path in want:
    # Tiles sum in another order: float32 noise relative to the leaf's largest gradient.
    atol = 1e-6 * max(1.0, float(np.max(np.abs(want[path]))))
    np.testing.assert_allclose(grads[path], want[path], rtol=1e-4, atol=atol, err_msg=path)


def train_steps(config: mb.Config, steps: int = 3, *, one_batch: bool = False):
  """(losses, params before, params after, trained params) of `steps` steps on the embedded data: a batch a
  step, or with `one_batch` the first batch every step."""
  trainer = recipe.create_trainer(config)
  state = trainer.init_state(0)
  dataset = data.make_dataset(config, "train", config.per_device_batch_size)
  before = jax.device_get(trainer.params(state))
  losses = []
  for step in range(steps):
    state, metrics = trainer.train_step(state, trainer.shard_batch(dataset.batch(0 if one_batch else step, 0, 1)))
    losses.append(float(metrics["loss"]))
  return losses, before, jax.device_get(trainer.params(state)), jax.device_get(trainer.trained_params(state))


def int8_logits(preset: str, **overrides):
  """(float Linen logits, AQT int8 Linen logits, AQT int8 NNX logits) of the seed-0 model on TOKENS."""

  def logits(flags, **quantization):
    config = family_config(preset, flags, **overrides, **quantization)
    return np.asarray(mb.create_model(config, seed=0).logits(TOKENS))

  return logits(LINEN), logits(LINEN, quantization="int8"), logits(NNX, quantization="int8")
