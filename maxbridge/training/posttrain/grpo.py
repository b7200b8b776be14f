"""GRPO's pieces: verifiable rewards, group-normalised advantages, batches and the loss.

For each prompt, `num_generations` completions are sampled; each is scored by
a reward function, and its advantage is its reward normalised within its
group (the prompt's completions): (r - mean) / (std + eps). The loss, over
completion tokens, is the clipped policy ratio of PPO plus a KL penalty to the
frozen reference (Shao et al. 2024, MaxText's `grpo_epsilon`, `grpo_beta`):

    ratio = exp(log pi - log pi_old)
    loss  = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon) * A)
            + beta * (exp(log ref - log pi) - (log ref - log pi) - 1)

summed over completion tokens and divided by their count (token-level, so
gradient accumulation stays exact). With one update per sampled batch (the
default), pi_old is the policy itself with no gradient: the ratio is 1 in value
and its gradient is the policy gradient, so with beta = 0 the loss reduces to
-A * log pi up to a constant. With `num_iterations` > 1 the rollouts record the
sampling policy's log-probabilities (`old_log_probs`) and the same batch trains
that many steps, so from the second on the ratio differs from 1 and the clip acts.

The variants are options of this one learner (`grpo_objectives` holds their math,
each term naming its paper's equation): DAPO's clip-higher (`epsilon_high`),
dynamic sampling (`dynamic_sampling`), token-mean loss and overlong shaping
(`overlong_buffer_length`); Dr. GRPO's constant normalisation
(`loss_agg_mode=seq-mean-token-sum-norm`) and no std (`scale_rewards=none`);
GSPO's sequence ratio (`importance_sampling_level=sequence`, or `sequence_token`);
the KL estimator (`grpo_kl_estimator`) and the std's ddof (`grpo_advantage_std`).

A GRPO step (`use_grpo=true`: `maxbridge train llama-tiny use_grpo=true`)
samples `num_generations` completions of each of a global batch of built-in
prompts with the engine's cached decoding (`maxbridge.models.decoding.generate_tokens`)
from the current policy parameters, in this process with no copy
(`Rollouts`), scores them with `reward_function`, and takes one train step.
`maxbridge.train` runs it in a run folder (metrics.jsonl, checkpoints of the
policy only, resume); `maxbridge.training.rollouts.train_grpo` runs the same
steps in memory.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
import time
import weakref
from typing import Callable

from absl import logging

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import canonical, sharding
from maxbridge.core.config import Config
from maxbridge.models import decoding, dispatch
from maxbridge.ops.losses import token_log_probs
from maxbridge.training.loss import Batch, CrossEntropy, Forward, Loss, StartingPolicy
from maxbridge.training.posttrain import grpo_objectives, sft

# Built-in prompts: two-digit operands, so every prompt is 6 tokens and a
# group batch is one [rows, 6] array (the sampler takes prompts of one length).
GRPO_OPERANDS = range(10, 20)
Reward = Callable[[str, str], float]

ADVANTAGE_EPS = grpo_objectives.ADVANTAGE_EPS
_ANSWER = re.compile(r"-?\d+\n")


def exact_match_reward(prompt: str, completion: str) -> float:
  """1.0 when the completion's first line is the sum the `a+b=` prompt asks for, else 0.0."""
  a, b = prompt.rstrip("=").split("+")
  return float(completion.split("\n", 1)[0] == str(int(a) + int(b)))


def format_reward(prompt: str, completion: str) -> float:
  """1.0 when the completion is one integer and a newline (the built-in set's answer format)."""
  return float(_ANSWER.fullmatch(completion) is not None)


def builtin_reward(prompt: str, completion: str) -> float:
  return exact_match_reward(prompt, completion) + 0.1 * format_reward(prompt, completion)


group_advantages = grpo_objectives.group_advantages


def pack_completions(prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray, length: int) -> dict:
  """One (prompt + completion) per row, completion tokens as targets, and `advantages` [rows, length]
  (each row's advantage on every position); `completions` is prompt-major, `num_generations` per prompt."""
  groups = len(completions) // len(prompts)
  examples = [sft.example(prompts[i // groups], completion) for i, completion in enumerate(completions)]
  rows = sft.fill_rows([[i] for i in range(len(examples))], [(t[:length], c[:length]) for t, c in examples], length, True)
  rows["advantages"] = np.broadcast_to(np.asarray(advantages, np.float32).reshape(-1, 1), (len(examples), length)).copy()
  return rows


class GRPO(Loss):
  """The clipped-ratio loss with a KL penalty to the frozen reference (`grpo_objectives.policy_objective`); metrics
  per unit of `loss_agg_mode` (a completion token, or a completion for the per-sequence modes)."""

  batch_keys = (*CrossEntropy.batch_keys, "advantages")
  float_keys = ("advantages", "old_log_probs")
  metric_keys = ("kl", "clip_fraction", "ratio")
  frozen = StartingPolicy()  # the reference its KL penalty is to
  # What the loss and its metrics mean, and how batches are reused (a resume mid-batch would read another).
  fixed_keys = ("use_grpo", "num_iterations", "grpo_kl_estimator", "importance_sampling_level", "loss_agg_mode")

  def __init__(
      self,
      beta: float = 0.04,
      epsilon: float = 0.2,
      *,
      epsilon_high: float | None = None,
      kl_estimator: str = "k3",
      importance_sampling_level: str = "token",
      loss_agg_mode: str = "token-mean",
      max_length: int = 1,
      old_log_probs: bool = False,
  ):
    self.beta = beta
    self.epsilon = epsilon
    self.options = dict(
        epsilon=epsilon,
        epsilon_high=epsilon_high,
        beta=beta,
        kl_estimator=kl_estimator,
        importance_sampling_level=importance_sampling_level,
        loss_agg_mode=loss_agg_mode,
        max_length=max_length,
    )
    # Several updates per batch: the sampling policy's log-probabilities come with it (`Rollouts`).
    self.old_log_probs = old_log_probs
    if old_log_probs:
      self.batch_keys = (*GRPO.batch_keys, "old_log_probs")

  @classmethod
  def enabled(cls, config: Config) -> bool:
    return config.use_grpo

  @classmethod
  def from_config(cls, config: Config) -> GRPO:
    return cls(
        config.grpo_beta,
        config.grpo_epsilon,
        epsilon_high=None if config.epsilon_high == -1 else config.epsilon_high,
        kl_estimator=config.grpo_kl_estimator,
        importance_sampling_level=config.importance_sampling_level,
        loss_agg_mode=config.loss_agg_mode,
        max_length=config.max_target_length - config.max_prefill_predict_length,
        old_log_probs=config.num_iterations > 1,
    )

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    if reference is None:
      raise ValueError("GRPO needs a reference model for its KL penalty (Trainer.hold_frozen)")
    inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    logits, intermediates = forward(*inputs)
    log_probs = token_log_probs(logits, batch["targets"])
    reference_log_probs = jax.lax.stop_gradient(token_log_probs(reference(*inputs)[0], batch["targets"]))
    mask = (batch["targets_segmentation"] > 0).astype(jnp.float32)
    # One update per batch: the sampling policy is this one, so the ratio is 1 with the policy gradient.
    old = batch["old_log_probs"] if self.old_log_probs else jax.lax.stop_gradient(log_probs)
    total, terms = grpo_objectives.policy_objective(
        log_probs, old, reference_log_probs, batch["advantages"], mask, **self.options
    )
    # The count to divide by is the aggregation's (tokens, or completions): the MoE loss weighs in per that unit.
    loss, aux = CrossEntropy.total(total, jnp.float32(0.0), terms["count"], intermediates)
    del aux["z_loss"]
    aux.update({key: terms[key] for key in self.metric_keys})
    return loss, aux


def builtin_prompts() -> list[str]:
  return [f"{a}+{b}=" for a in GRPO_OPERANDS for b in GRPO_OPERANDS]


REWARDS: dict[str, Reward] = {"arithmetic": builtin_reward, "exact_match": exact_match_reward, "format": format_reward}


def load_reward(reward: str | Reward) -> Reward:
  """A reward callable: given, built in (`REWARDS`: "arithmetic", ...), or named by dotted path (`package.module.function`).

  Its signature is checked here, so that one that cannot be called as
  reward(prompt, completion) fails before anything compiles.
  """
  if callable(reward):
    found = reward
  elif reward in REWARDS:
    return REWARDS[reward]
  else:
    module, _, name = str(reward).rpartition(".")
    try:
      found = getattr(importlib.import_module(module), name)
    except Exception as e:  # importing runs the user's module: whatever it raises is theirs to fix
      raise ValueError(
          f"reward_function {reward!r} cannot be imported (want one of {sorted(REWARDS)} or package.module.function): "
          f"{type(e).__name__}: {e}"
      ) from e
    if not callable(found):
      raise ValueError(
          f"reward_function {reward!r} is a {type(found).__name__}, not a callable (prompt, completion) -> float"
      )
  try:
    signature = inspect.signature(found)
  except (TypeError, ValueError):  # a callable written in C may have none: its first call tells
    return found
  try:
    signature.bind("prompt", "completion")
  except TypeError as e:
    raise ValueError(
        f"reward_function {reward if isinstance(reward, str) else reward_name(found)!r} is called as "
        f"reward(prompt: str, completion: str), but its signature is {signature}: {e}"
    ) from e
  return found


def reward_name(reward: Reward) -> str:
  """The import path of `reward`, as reward_function names it."""
  qualname = getattr(reward, "__qualname__", None) or type(reward).__qualname__
  return f"{getattr(reward, '__module__', None) or type(reward).__module__}.{qualname}"


def score(reward: Reward, prompts: list[str], completions: list[str], num_generations: int) -> np.ndarray:
  """[prompts, num_generations] rewards; each must be a finite real number.

  The reward function is the user's code: what it raises, and a value that is
  not a finite number, stop the run naming it and the completion it scored.
  """
  values = []
  for i, completion in enumerate(completions):
    prompt = prompts[i // num_generations]
    where = f"prompt {i // num_generations} ({prompt!r}), completion {i % num_generations} ({completion!r})"
    try:
      value = reward(prompt, completion)
    except Exception as e:
      raise ValueError(f"reward_function {reward_name(reward)!r} raised on {where}: {type(e).__name__}: {e}") from e
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating, np.integer)):
      raise ValueError(
          f"reward_function {reward_name(reward)!r} must return one number per completion (called as "
          f"reward(prompt: str, completion: str)), got {value!r} on {where}"
      )
    if not math.isfinite(value):
      raise ValueError(f"reward_function {reward_name(reward)!r} returned {value} on {where}: a reward must be finite")
    values.append(value)
  return np.asarray(values, np.float64).reshape(len(prompts), num_generations)


def completion_tokens(continuation: np.ndarray, stop: int = ord("\n")) -> list[int]:
  """A sampled continuation up to and including its first `stop` token (all of it if none)."""
  hits = np.flatnonzero(continuation == stop)
  return continuation[: hits[0] + 1 if hits.size else continuation.size].tolist()


def prompts_per_step(config: Config) -> int:
  """Prompts sampled per step: the global batch (per device, times devices, times micro-batches)."""
  return config.per_device_batch_size * jax.device_count() * config.gradient_accumulation_steps


# --- rollouts: each step's batch, sampled from the policy ------------------------------------


# One compiled sampler per trainer: a trainer is built for one config's step (`train.step_key`), which
# fixes everything sampling reads, so passing the same trainer to several runs compiles once.
_SAMPLERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Trainers whose configs differ only in what the loss and the rewards read (GRPO's options, never the decoder's)
# share one sampler, while any of them lives: a DAPO and a GSPO run of one model compile it once.
_SHARED_SAMPLERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NOT_SAMPLED = frozenset(
    {
        *("grpo_beta", "grpo_epsilon", "epsilon_high", "grpo_kl_estimator", "importance_sampling_level"),
        *("loss_agg_mode", "num_iterations", "scale_rewards", "grpo_advantage_std", "dynamic_sampling"),
        *("max_num_gen_batches", "overlong_buffer_length", "overlong_penalty_factor", "reward_function"),
    }
)


def _sampler(trainer) -> Callable:
  if trainer in _SAMPLERS:
    return _SAMPLERS[trainer]
  config = trainer.config
  settings = repr(sorted((k, repr(v)) for k, v in config.to_dict().items() if k not in _NOT_SAMPLED))
  sample = _SHARED_SAMPLERS.get(settings)
  if sample is None:
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

    _SHARED_SAMPLERS[settings] = sample
  _SAMPLERS[trainer] = sample
  return sample


# The policy's log-probabilities of a batch's targets, compiled once per trainer as the sampler is.
_LOG_PROBS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _log_prober(trainer) -> Callable:
  if trainer not in _LOG_PROBS:

    @jax.jit
    def log_probs(state, inputs, positions, segments, targets):
      return token_log_probs(trainer.state_logits(state, inputs, positions, segments), targets)

    _LOG_PROBS[trainer] = log_probs
  return _LOG_PROBS[trainer]


class Rollouts:
  """Each step's GRPO batch, sampled from the current policy: the same for a given (seed, step) on any backend.

  `batch(step, state)` picks `prompts_per_step` built-in prompts (by seed and
  step, so a resumed run samples as the uninterrupted one), samples
  `num_generations` completions of each with the engine's cached decoding from
  `trainer.model_params(state)` (LoRA: the adapted weights), in this process
  with no copy, scores them (plus DAPO's overlong penalty) and packs one
  completion per row with its group-normalised advantage. Completions are at
  most max_target_length - max_prefill_predict_length tokens, cut after the
  first newline.

  With `num_iterations` > 1, a batch is sampled every num_iterations steps, with
  the sampling policy's log-probabilities (`old_log_probs`), and the steps between
  train on it again. A run resumed between two samplings has no such batch: it
  samples that batch's prompts again from the restored policy, and logs so.
  With `dynamic_sampling` (DAPO), groups whose rewards are all equal are dropped
  and more sampled, up to `max_num_gen_batches` batches; equal groups fill what is
  still short (their advantages are 0), counted in `uninformative_groups`.
  """

  def __init__(self, config: Config, trainer):
    self.config = config
    self.trainer = trainer
    self.reward = load_reward(config.reward_function)
    self.prompts = builtin_prompts()
    # A prompt is prefilled whole and its completion sampled after it, within max_target_length.
    longest = max(self.prompts, key=lambda p: len(p.encode()))
    if len(longest.encode()) > config.max_prefill_predict_length:
      raise ValueError(
          f"the GRPO prompt {longest!r} is {len(longest.encode())} tokens, longer than max_prefill_predict_length="
          f"{config.max_prefill_predict_length} (the longest prompt a prefill takes); set it >= "
          f"{len(longest.encode())}, below max_target_length={config.max_target_length} to leave room to generate"
      )
    self.sample = _sampler(trainer)
    self.log_probs = _log_prober(trainer) if config.num_iterations > 1 else None
    self.held: tuple[int, dict, dict] | None = None  # (the step it was sampled for, rows, info)
    self.timings: dict[str, float] = {}

  def batch(self, step: int, state) -> tuple[dict[str, np.ndarray], dict]:
    """(rows for the train step, {"mean_reward", "completion_length", "completions"}, with dynamic_sampling
    "sampled_batches" and "uninformative_groups"); `timings` holds the seconds spent sampling and scoring."""
    first = step - step % self.config.num_iterations
    if self.held is not None and self.held[0] == first:
      self.timings = {"sampling_s": 0.0, "scoring_s": 0.0}
      return self.held[1], self.held[2]
    if first != step:
      logging.warning(
          "GRPO step %d is update %d of the batch sampled at step %d, which this run did not sample (it resumed "
          "between): that batch is sampled again from the policy as it is now",
          step,
          step - first + 1,
          first,
      )
    rows, info = self._sample(first, state)
    if self.log_probs is not None:
      with sharding.active(self.trainer.mesh, self.trainer.rules):
        old = self.log_probs(state, *(rows[k] for k in ("inputs", "inputs_position", "inputs_segmentation", "targets")))
      rows["old_log_probs"] = np.asarray(old, np.float32)
    self.held = (first, rows, info)
    return rows, info

  def _attempt(self, step: int, attempt: int, state):
    """One sampled batch: (prompts, their tokens, completions, texts, raw rewards, shaped rewards)."""
    config, groups = self.config, self.config.num_generations
    rng = np.random.default_rng([config.seed, step] + ([attempt] if attempt else []))
    count = prompts_per_step(config)
    chosen = [self.prompts[i] for i in rng.choice(len(self.prompts), count, replace=count > len(self.prompts))]
    prompt_tokens = [list(p.encode()) for p in chosen]
    grouped = np.repeat(np.asarray(prompt_tokens, np.int32), groups, axis=0)
    key = jax.random.key(config.seed * 1_000_003 + step)
    if attempt:
      key = jax.random.fold_in(key, attempt)
    began = time.perf_counter()
    sampled = np.asarray(self.sample(self.trainer.model_params(state), grouped, key))
    self._sampling_s += time.perf_counter() - began
    completions = [completion_tokens(row[grouped.shape[1] :]) for row in sampled]
    texts = [bytes(c).decode("utf-8", errors="replace") for c in completions]
    rewards = score(self.reward, chosen, texts, groups)
    lengths = np.asarray([len(c) for c in completions]).reshape(rewards.shape)
    new_tokens = config.max_target_length - config.max_prefill_predict_length
    shaped = rewards + grpo_objectives.overlong_penalty(
        lengths, new_tokens, config.overlong_buffer_length, config.overlong_penalty_factor
    )
    return chosen, prompt_tokens, completions, texts, rewards, shaped

  def _sample(self, step: int, state) -> tuple[dict[str, np.ndarray], dict]:
    config, groups = self.config, self.config.num_generations
    began = time.perf_counter()
    kept, spare, tries, self._sampling_s = [], [], 0, 0.0
    count = prompts_per_step(config)
    for attempt in range(config.max_num_gen_batches if config.dynamic_sampling else 1):
      tries += 1
      chosen, prompt_tokens, completions, texts, rewards, shaped = self._attempt(step, attempt, state)
      informative = grpo_objectives.informative_groups(shaped) if config.dynamic_sampling else np.ones(count, bool)
      for g in range(count):
        group = (chosen[g], prompt_tokens[g], completions[g * groups : (g + 1) * groups],
                 texts[g * groups : (g + 1) * groups], rewards[g], shaped[g])  # fmt: skip
        (kept if informative[g] else spare).append(group)
      if len(kept) >= count:
        break
    uninformative = max(count - len(kept), 0)
    batch = kept[:count] + spare[:uninformative]
    rewards = np.stack([g[4] for g in batch])
    shaped = np.stack([g[5] for g in batch])
    completions = [c for g in batch for c in g[2]]
    advantages = group_advantages(shaped, config.scale_rewards, config.grpo_advantage_std)
    rows = pack_completions([g[1] for g in batch], completions, advantages, config.max_target_length)
    self.timings = {"sampling_s": self._sampling_s, "scoring_s": time.perf_counter() - began - self._sampling_s}
    info = {
        "mean_reward": float(rewards.mean()),
        "completion_length": float(np.mean([len(c) for c in completions])),
        "completions": [t for g in batch for t in g[3]],
    }
    if config.dynamic_sampling:
      info.update(sampled_batches=tries, uninformative_groups=uninformative)
    return rows, info
