"""Shared fixtures. Models are tiny (llama-tiny) so the whole matrix stays fast."""

import itertools

import jax
import pytest

import maxbridge as mb

# (pure_nnx, enable_nnx, pure_nnx_decoder): every combination is valid.
FLAG_COMBINATIONS = list(itertools.product([False, True], repeat=3))


def flag_id(flags) -> str:
  return "-".join(f"{name}={int(v)}" for name, v in zip(("pure_nnx", "enable_nnx", "decoder"), flags))


def tiny_config(flags=(False, False, False), **overrides) -> mb.Config:
  pure_nnx, enable_nnx, pure_nnx_decoder = flags
  return mb.load_config(
      "llama-tiny",
      pure_nnx=pure_nnx,
      enable_nnx=enable_nnx,
      pure_nnx_decoder=pure_nnx_decoder,
      **overrides,
  )


@pytest.fixture(scope="session")
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
