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
gradient accumulation stays exact). With one update per sampled batch (as
here), pi_old is the policy itself with no gradient: the ratio is 1 in value
and its gradient is the policy gradient, so with beta = 0 the loss reduces to
-A * log pi up to a constant.

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

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.models import decoding, dispatch
from maxbridge.training.loss import Batch, CrossEntropy, Forward, Loss, StartingPolicy
from maxbridge.training.posttrain import sft

# Built-in prompts: two-digit operands, so every prompt is 6 tokens and a
# group batch is one [rows, 6] array (the sampler takes prompts of one length).
GRPO_OPERANDS = range(10, 20)
Reward = Callable[[str, str], float]

ADVANTAGE_EPS = 1e-4
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


def group_advantages(rewards: np.ndarray) -> np.ndarray:
  """[prompts, num_generations] rewards -> advantages, zero-mean and unit-scale within each group.

  A group whose rewards are all equal gets zeros: nothing in it to prefer.
  """
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 2 or rewards.shape[1] < 2:
    raise ValueError(f"rewards must be [prompts, num_generations] with num_generations >= 2, got shape {rewards.shape}")
  centred = rewards - rewards.mean(axis=1, keepdims=True)
  return (centred / (rewards.std(axis=1, keepdims=True) + ADVANTAGE_EPS)).astype(np.float32)


def pack_completions(prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray, length: int) -> dict:
  """One (prompt + completion) per row, completion tokens as targets, and `advantages` [rows, length]
  (each row's advantage on every position); `completions` is prompt-major, `num_generations` per prompt."""
  groups = len(completions) // len(prompts)
  examples = [sft.example(prompts[i // groups], completion) for i, completion in enumerate(completions)]
  rows = sft.fill_rows([[i] for i in range(len(examples))], [(t[:length], c[:length]) for t, c in examples], length, True)
  rows["advantages"] = np.broadcast_to(np.asarray(advantages, np.float32).reshape(-1, 1), (len(examples), length)).copy()
  return rows


class GRPO(Loss):
  """The clipped-ratio loss with a KL penalty to the frozen reference; metrics per completion token."""

  batch_keys = (*CrossEntropy.batch_keys, "advantages")
  metric_keys = ("kl", "clip_fraction")
  frozen = StartingPolicy()  # the reference its KL penalty is to
  fixed_keys = ("use_grpo",)

  def __init__(self, beta: float = 0.04, epsilon: float = 0.2):
    self.beta = beta
    self.epsilon = epsilon

  @classmethod
  def enabled(cls, config: Config) -> bool:
    return config.use_grpo

  @classmethod
  def from_config(cls, config: Config) -> GRPO:
    return cls(config.grpo_beta, config.grpo_epsilon)

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    if reference is None:
      raise ValueError("GRPO needs a reference model for its KL penalty (Trainer.hold_frozen)")
    inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    logits, intermediates = forward(*inputs)
    log_probs = token_log_probs(logits, batch["targets"])
    reference_log_probs = jax.lax.stop_gradient(token_log_probs(reference(*inputs)[0], batch["targets"]))
    mask = (batch["targets_segmentation"] > 0).astype(jnp.float32)
    ratio = jnp.exp(log_probs - jax.lax.stop_gradient(log_probs))
    advantages = batch["advantages"]
    clipped = jnp.clip(ratio, 1 - self.epsilon, 1 + self.epsilon)
    policy = -jnp.minimum(ratio * advantages, clipped * advantages)
    delta = reference_log_probs - log_probs
    kl = jnp.exp(delta) - delta - 1
    loss, aux = CrossEntropy.total(jnp.sum((policy + self.beta * kl) * mask), jnp.float32(0.0), mask, intermediates)
    del aux["z_loss"]
    aux["kl"] = jnp.sum(kl * mask)
    aux["clip_fraction"] = jnp.sum((ratio != clipped) * mask)
    return loss, aux


def token_log_probs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """log p(target) at every position, float32 [B, T]."""
  return jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), targets[..., None], -1)[..., 0]


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
    self.timings: dict[str, float] = {}

  def batch(self, step: int, state) -> tuple[dict[str, np.ndarray], dict]:
    """(rows for the train step, {"mean_reward", "completion_length", "completions"}); `timings` holds the
    seconds spent sampling and scoring."""
    config, groups = self.config, self.config.num_generations
    began = time.perf_counter()
    rng = np.random.default_rng([config.seed, step])
    count = prompts_per_step(config)
    chosen = [self.prompts[i] for i in rng.choice(len(self.prompts), count, replace=count > len(self.prompts))]
    prompt_tokens = [list(p.encode()) for p in chosen]
    grouped = np.repeat(np.asarray(prompt_tokens, np.int32), groups, axis=0)
    key = jax.random.key(config.seed * 1_000_003 + step)
    sampled = np.asarray(self.sample(self.trainer.model_params(state), grouped, key))
    sampled_at = time.perf_counter()
    completions = [completion_tokens(row[grouped.shape[1] :]) for row in sampled]
    texts = [bytes(c).decode("utf-8", errors="replace") for c in completions]
    rewards = score(self.reward, chosen, texts, groups)
    rows = pack_completions(prompt_tokens, completions, group_advantages(rewards), config.max_target_length)
    self.timings = {"sampling_s": sampled_at - began, "scoring_s": time.perf_counter() - sampled_at}
    info = {
        "mean_reward": float(rewards.mean()),
        "completion_length": float(np.mean([len(c) for c in completions])),
        "completions": texts,
    }
    return rows, info
