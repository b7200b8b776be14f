"""GRPO's rollouts: each step's completions sampled from the current policy, scored and packed (`Rollouts`),
and `train_grpo`, the steps in memory. The loss and the rewards are `grpo`'s."""

from __future__ import annotations

import time
import weakref
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.models import decoding, dispatch
from maxbridge.training import recipe
from maxbridge.training.posttrain import grpo

# One compiled sampler per trainer: a trainer is built for one config's step (`train.step_key`), which
# fixes everything sampling reads, so passing the same trainer to several runs compiles once.
_SAMPLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _sampler(trainer) -> Callable:
  if trainer not in _SAMPLERS:
    config = trainer.config
    # Abstract (no parameters of its own): `sample` runs it on the policy's parameters.
    decoder = dispatch.abstract_model(decoding.decode_config(config))
    abstract = decoder.abstract_params()
    new_tokens = config.max_target_length - config.max_prefill_predict_length

    @jax.jit
    def sample(params, prompt, key):
      # The policy's own parameters, in the decoder's (unrolled) layout: no copy outside this trace.
      params = canonical.conform(params, abstract, config.param_scan_axis)
      temperature = jnp.float32(config.decode_sampling_temperature)
      return decoding.generate_tokens(decoder, params, prompt, temperature, key, max_new_tokens=new_tokens, sample=True)

    _SAMPLERS[trainer] = sample
  return _SAMPLERS[trainer]


class Rollouts:
  """Each step's GRPO batch, sampled from the current policy: the same for a given (seed, step) on any backend.

  `batch(step, state)` picks `prompts_per_step` built-in prompts (by seed and
  step, so a resumed run samples as the uninterrupted one), samples
  `num_generations` completions of each with the engine's cached decoding from
  `trainer.model_params(state)` (LoRA: the adapted weights), in this process
  with no copy, scores them and packs one completion per row with its
  group-normalised advantage. Completions are at most max_target_length -
  max_prefill_predict_length tokens, cut after the first newline.
  """

  def __init__(self, config: Config, trainer):
    self.config = config
    self.trainer = trainer
    self.reward = grpo.load_reward(config.reward_function)
    self.prompts = grpo.builtin_prompts()
    longest = max(len(p.encode()) for p in self.prompts)
    if longest > config.max_prefill_predict_length:
      raise ValueError(
          f"max_prefill_predict_length={config.max_prefill_predict_length} is shorter than the built-in GRPO "
          f"prompts ({longest} tokens)"
      )
    self.sample = _sampler(trainer)
    self.timings: dict[str, float] = {}

  def batch(self, step: int, state) -> tuple[dict[str, np.ndarray], dict]:
    """(rows for the train step, {"mean_reward", "completion_length", "completions"}); `timings` holds the
    seconds spent sampling and scoring."""
    config, groups = self.config, self.config.num_generations
    began = time.perf_counter()
    rng = np.random.default_rng([config.seed, step])
    count = grpo.prompts_per_step(config)
    chosen = [self.prompts[i] for i in rng.choice(len(self.prompts), count, replace=count > len(self.prompts))]
    prompt_tokens = [list(p.encode()) for p in chosen]
    grouped = np.repeat(np.asarray(prompt_tokens, np.int32), groups, axis=0)
    key = jax.random.key(config.seed * 1_000_003 + step)
    sampled = np.asarray(self.sample(self.trainer.model_params(state), grouped, key))
    sampled_at = time.perf_counter()
    completions = [grpo.completion_tokens(row[grouped.shape[1] :]) for row in sampled]
    texts = [bytes(c).decode("utf-8", errors="replace") for c in completions]
    rewards = grpo.score(self.reward, chosen, texts, groups)
    rows = grpo.pack_completions(prompt_tokens, completions, grpo.group_advantages(rewards), config.max_target_length)
    self.timings = {"sampling_s": sampled_at - began, "scoring_s": time.perf_counter() - sampled_at}
    info = {
        "mean_reward": float(rewards.mean()),
        "completion_length": float(np.mean([len(c) for c in completions])),
        "completions": texts,
    }
    return rows, info


def train_grpo(
    config: Config, *, trainer=None, params: dict | None = None, steps: int | None = None
) -> tuple[dict, list[dict]]:
  """GRPO in memory (no run folder), from `params` (canonical; default the seed's initialisation):
  (final canonical params, one record per step). `maxbridge.train` runs the same steps with checkpoints.

  Records hold loss, kl, clip_fraction, mean_reward, completion_length and
  the sampled completions. Prompts and sampling keys follow `config.seed` and
  the step only, so Linen and NNX sample, score and train identically.
  """
  if not config.use_grpo:
    raise ValueError("train_grpo needs use_grpo=true in the config")
  if trainer is None:
    trainer = recipe.create_trainer(config)
  rollouts = Rollouts(config, trainer)
  state = trainer.init_state(config.seed)
  if params is not None:
    start = canonical.conform(params, trainer.abstract_params, config.param_scan_axis)
    state = trainer._replace_params(state, start)  # pylint: disable=protected-access
  trainer.set_reference(state)
  records = []
  for step in range(config.steps if steps is None else steps):
    batch, info = rollouts.batch(step, state)
    state, metrics = trainer.train_step(state, batch)
    metrics = jax.device_get(metrics)
    records.append({"step": step, **{key: float(metrics[key]) for key in ("loss", "kl", "clip_fraction")}, **info})
  return trainer.model_params(state), records
