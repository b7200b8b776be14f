"""Self-speculative decoding with the MTP modules (serving/speculative.py): greedy's tokens, token for token."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge.core.config import ConfigError
from maxbridge.models import decoding, dispatch
from maxbridge.serving import engine, speculative

LINEN, NNX = (False, False, False), (True, True, True)
PROMPTS = np.array([[1, 5, 9, 3, 7, 2, 11], [4, 4, 8, 1, 2, 6, 30]], np.int32)


@pytest.fixture(autouse=True)
def highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def config(preset, flags, mtp_num_layers, **overrides):
  options = dict(zip(("pure_nnx", "enable_nnx", "pure_nnx_decoder"), flags))
  return mb.load_config(preset, mtp_num_layers=mtp_num_layers, **options, **overrides)


@pytest.mark.parametrize(
    "preset, flags, layers",
    [("llama-tiny", LINEN, 1), ("deepseek3-tiny", LINEN, 2), ("deepseek3-tiny", NNX, 1)],
    ids=["llama-linen-1", "deepseek-linen-2", "deepseek-nnx-1"],
)
def test_speculative_generate_equals_plain_greedy(preset, flags, layers):
  """What `maxbridge generate ... speculative_mtp_tokens=K` runs gives greedy decoding's tokens (llama scanned:
  both decode its unrolled twin)."""
  cfg = config(preset, flags, layers, scan_layers=preset == "llama-tiny", speculative_mtp_tokens=layers)
  model = dispatch.create_model(cfg)
  want = np.asarray(model.generate(PROMPTS[0], 14))[PROMPTS.shape[1] :]
  np.testing.assert_array_equal(engine.generate_continuation(cfg, model, PROMPTS[0], 14), want)


@pytest.fixture(scope="module")
def llama():
  """llama-tiny with two MTP modules, per backend: its decoding model (the same seed's weights on both)."""
  return {
      name: dispatch.create_model(decoding.decode_config(config("llama-tiny", flags, 2)))
      for name, flags in {"linen": LINEN, "nnx": NNX}.items()
  }


def test_two_modules_on_nnx_give_greedys_tokens_for_a_batch(llama):
  model = llama["nnx"]
  tokens, stats = speculative.generate(model.config, model, PROMPTS, 12, 2)
  np.testing.assert_array_equal(tokens, np.asarray(model.generate(PROMPTS, 12))[:, PROMPTS.shape[1] :])
  assert stats.drafted == 2 * 2 * stats.steps  # two rows, two drafts a step, until both are done


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_drafts_are_the_training_forwards_mtp_predictions(llama, backend):
  """Module k's cached draft at the last row equals the uncached training forward's MTP logits there, with the
  tokens the chain fed it: the MTP caches hold what the modules attend over."""
  model = llama[backend]
  speculator = speculative.Speculator(model.config, model, 2)
  params = model.params()
  state = speculator.prefill(params, PROMPTS, length=24)
  drafts, logits, _ = jax.jit(speculator.propose)(params, state)
  sequence = jnp.concatenate([PROMPTS, state.token[:, None], drafts[:, :1]], axis=1)
  _, intermediates = model.apply_with_intermediates(params, sequence)
  last = PROMPTS.shape[1] - 1
  for k in (1, 2):
    want = intermediates["decoder/mtp_logits"][k - 1][:, last]
    np.testing.assert_allclose(logits[:, k - 1], want, atol=2e-5, rtol=1e-5, err_msg=f"module {k}")
  np.testing.assert_array_equal(drafts, jnp.argmax(logits, axis=-1))


class OracleDrafts(speculative.Speculator):
  """Drafts from the true greedy continuation, those of every fourth position wrong: steps keep 0, 1 or 2."""

  def __init__(self, *args, reference, **kwargs):
    super().__init__(*args, **kwargs)
    self.reference = jnp.asarray(reference)

  def propose(self, params, state):
    _, logits, caches = super().propose(params, state)
    ahead = state.next_pos[:, None] + jnp.arange(self.num_draft)  # draft j is token next_pos + 1 + j
    right = jnp.take_along_axis(self.reference, ahead + 1, axis=1)
    wrong = (right + 1) % self.config.vocab_size
    return jnp.where(ahead % 4 == 0, wrong, right), logits, caches


def test_accepted_drafts_and_rewound_caches_keep_greedys_tokens(llama):
  """With drafts that are often right, rows accept different numbers of tokens a step, the caches are set back
  past each rejection, and both rows still decode greedy's tokens."""
  model = llama["linen"]
  new = 20
  reference = np.asarray(model.generate(PROMPTS, new + 4))
  speculator = OracleDrafts(model.config, model, 2, reference=reference)
  tokens, stats = speculator.generate(PROMPTS, new)
  np.testing.assert_array_equal(tokens, reference[:, PROMPTS.shape[1] : PROMPTS.shape[1] + new])
  assert 0 < stats.accepted < stats.drafted, stats
  assert stats.steps < new - 1, stats  # fewer verify forwards than tokens
  assert stats.tokens_per_step > 1.3, stats


def test_refusals_name_the_key():
  with pytest.raises(ConfigError, match="speculative_mtp_tokens=2 drafts one token per MTP module.*mtp_num_layers=1"):
    mb.load_config("llama-tiny", mtp_num_layers=1, speculative_mtp_tokens=2)
  cfg = mb.load_config("llama-tiny", mtp_num_layers=1)
  with pytest.raises(ValueError, match="at most 1"):
    speculative.check(cfg, 2)
  with pytest.raises(ValueError, match="decodes greedily"):
    speculative.check(cfg.replace(decode_sampling_strategy="weighted"), 1)
  with pytest.raises(ValueError, match="sliding_window_size=8"):
    speculative.check(cfg.replace(sliding_window_size=8), 1)
