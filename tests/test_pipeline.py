"""Pipeline parallelism: the schedule (ops.pipeline) against the layers run in turn, the config's rules,
the pipelined decoder on both backends, and (in one 8-device subprocess) training against one device."""

import functools
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import failure

import maxbridge as mb
from jax.sharding import PartitionSpec

from maxbridge.core import canonical, pipeline_plan, sharding
from maxbridge.core.config import ConfigError
from maxbridge.ops import pipeline

HERE = Path(__file__).parent
BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True)}
LAYERS, BATCH, WIDTH = 8, 8, 4


def _layer(params, h, positions):
  h = jnp.tanh(h @ params["w"] + params["b"] + 0.01 * positions[..., None])
  return h, {"max_logits": jnp.max(h, axis=(0, 1)), "moe_lb_losses": jnp.mean(h)}


@pytest.fixture(scope="module")
def stack():
  keys = jax.random.split(jax.random.key(0), 3)
  params = {
      "w": 0.5 * jax.random.normal(keys[0], (LAYERS, WIDTH, WIDTH)),
      "b": jax.random.normal(keys[1], (LAYERS, WIDTH)),
  }
  x = jax.random.normal(keys[2], (BATCH, 3, WIDTH))
  positions = jnp.arange(BATCH * 3, dtype=jnp.float32).reshape(BATCH, 3)
  return params, x, positions


def _in_turn(params, x, positions):
  return jax.lax.scan(lambda h, p: _layer(p, h, positions), x, params)


# The exact comparison below holds for the code XLA emits by default, as users run it (LLVM at -O3). At the suite's
# -O0 (conftest) the micro-batched stages and the plain layers round 1 ulp apart, so both sides compile at -O3.
DEFAULT_CODEGEN = {"xla_backend_optimization_level": 3}


# (stages, micro-batches, repeats): GPipe, one micro-batch per stage and more; circular.
@pytest.mark.parametrize("stages,microbatches,repeats", [(2, 2, 1), (4, 4, 1), (2, 4, 1), (2, 2, 2), (4, 8, 2)])
def test_schedule_matches_the_layers_run_in_turn(stack, stages, microbatches, repeats):
  params, x, positions = stack
  run = jax.jit(
      lambda p, x, e: pipeline.run(_layer, p, x, e, stages=stages, microbatches=microbatches, repeats=repeats),
      compiler_options=DEFAULT_CODEGEN,
  )
  got, values = run(params, x, positions)
  # Against the layers run in turn on each micro-batch (the same matmul shapes) to float32 rounding: exact on
  # some hosts, but XLA's CPU code for the two programs may differ by host (5e-7 apart on a 2026-11-29 host) ...
  rows = BATCH // microbatches
  in_turn = jax.jit(_in_turn, compiler_options=DEFAULT_CODEGEN)
  parts = [in_turn(params, x[i : i + rows], positions[i : i + rows]) for i in range(0, BATCH, rows)]
  np.testing.assert_allclose(got, jnp.concatenate([out for out, _ in parts]), rtol=0, atol=1e-6)
  want_max = jnp.max(jnp.stack([v["max_logits"] for _, v in parts]), 0)
  np.testing.assert_allclose(values["max_logits"], want_max, rtol=0, atol=1e-6)
  # ... and equal to rounding on the whole batch, per-layer values combined over micro-batches.
  want, want_values = _in_turn(params, x, positions)
  np.testing.assert_allclose(got, want, atol=1e-6)
  for key in want_values:
    assert values[key].shape == want_values[key].shape
    np.testing.assert_allclose(values[key], want_values[key], atol=1e-6, err_msg=key)


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_schedule_gradients_match(stack, remat_policy):
  params, x, positions = stack
  run = functools.partial(pipeline.run, stages=2, microbatches=4, repeats=2, remat_policy=remat_policy)
  loss = lambda out: jnp.sum(out[0] ** 2) + jnp.sum(out[1]["max_logits"])  # noqa: E731
  want = jax.grad(lambda p: loss(_in_turn(p, x, positions)))(params)
  got = jax.grad(lambda p: loss(run(_layer, p, x, positions)))(params)
  for key in want:
    np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)


def test_schedule_refuses_what_does_not_divide(stack):
  params, x, positions = stack
  with pytest.raises(ValueError, match="8 layers do not divide into stages=3"):
    pipeline.run(_layer, params, x, positions, stages=3, microbatches=2)
  with pytest.raises(ValueError, match="batch 8 does not divide into microbatches=3"):
    pipeline.run(_layer, params, x, positions, stages=2, microbatches=3)
  with pytest.raises(ValueError, match="needs microbatches=2 >= stages=4"):
    pipeline.run(_layer, params, x, positions, stages=4, microbatches=2, repeats=2)
  unknown = lambda p, h, e: (_layer(p, h, e)[0], {"something": jnp.sum(h)})  # noqa: E731
  with pytest.raises(ValueError, match="'something' has no rule to combine micro-batches"):
    pipeline.run(unknown, params, x, positions, stages=2, microbatches=2)


def test_bubble_fraction():
  assert pipeline.iterations(4, 8) == 11
  assert pipeline.bubble_fraction(4, 8) == pytest.approx(3 / 11)
  assert pipeline.bubble_fraction(2, 4, repeats=2) == pytest.approx(1 / 9)
  assert pipeline.bubble_fraction(1, 4) == 0


# --- the config ---------------------------------------------------------------------------------


def test_plan_follows_maxtexts_keys():
  assert pipeline_plan.pipeline_plan(mb.load_config("llama-tiny")) is None
  # MaxText's defaults: one layer a stage, repeats derived, one micro-batch per stage.
  plan = pipeline_plan.pipeline_plan(mb.load_config("llama-tiny", base_num_decoder_layers=8, ici_pipeline_parallelism=2))
  assert plan == pipeline_plan.PipelinePlan("layers", 8, 2, 1, 4, 2)
  plan = pipeline_plan.pipeline_plan(
      mb.load_config(
          "deepseek3-tiny", base_num_decoder_layers=5, ici_pipeline_parallelism=2, num_layers_per_pipeline_stage=2
      )
  )
  assert plan == pipeline_plan.PipelinePlan("moe_layers", 4, 2, 2, 1, 2)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(base_num_decoder_layers=3), r"pipeline_parallel_layers=3 .*'layers'.* must be a multiple of the stages 2"),
        (dict(num_pipeline_repeats=2), r"num_pipeline_repeats=2 must be -1 or .* = 1"),
        (dict(num_pipeline_microbatches=3), r"num_pipeline_microbatches=3 must be a multiple of the stages 2"),
        (dict(pipeline_parallel_layers=5), r"pipeline_parallel_layers=5 must be -1 \(all\) or in 1..2"),
        (dict(scan_layers=False), r"needs scan_layers=true"),
        (dict(use_qwix_quantization=True, quantization="int8"), r"use_qwix_quantization=true"),
        (dict(num_layers_per_pipeline_stage=0), r"'num_layers_per_pipeline_stage' = 0 is invalid"),
    ],
)
def test_config_refuses_pipelines_it_cannot_run(overrides, message):
  with pytest.raises(ConfigError, match=message):
    mb.load_config("llama-tiny", ici_pipeline_parallelism=2, **overrides)


def test_only_the_pipelined_stack_is_split_over_the_stages():
  config = mb.load_config("deepseek3-tiny", base_num_decoder_layers=3, ici_pipeline_parallelism=2)
  assert canonical.layer_axis(config, "moe_layers") == "layers"
  assert canonical.layer_axis(config, "dense_layers") == "layers_outside_pipeline"
  spec = sharding.logical_to_spec(("layers", "layers_outside_pipeline"), config.logical_axis_rules)
  assert spec == PartitionSpec("stage", None)
  partial = mb.load_config(
      "llama-tiny", base_num_decoder_layers=3, ici_pipeline_parallelism=2, pipeline_parallel_layers=2
  )
  assert canonical.layer_axis(partial, "layers") == "layers_outside_pipeline"


# --- the decoder, on one device: pipelined and plain models share parameters --------------------


def _logits_pair(backend, preset="llama-tiny", rows=4, **overrides):
  """(plain model, pipelined model holding the plain one's parameters, tokens [rows, 16])."""
  flags = dict(zip(("pure_nnx", "enable_nnx", "pure_nnx_decoder"), BACKENDS[backend]))
  plain = mb.create_model(mb.load_config(preset, use_qk_clip=True, **flags, **overrides), seed=0)
  piped = mb.create_model(
      mb.load_config(preset, use_qk_clip=True, ici_pipeline_parallelism=2, **flags, **overrides), seed=1
  )
  piped.load_params(plain.params())
  tokens = jax.random.randint(jax.random.key(3), (rows, 16), 0, 256)
  return plain, piped, tokens


def test_pipelined_decoder_matches_the_plain_one():
  # Three layers: two pipelined (2 stages), the third run after the pipeline. The
  # whole-stack pipelines (circular, GPipe, DeepSeek's) train on 8 devices below.
  plain, piped, tokens = _logits_pair("nnx", base_num_decoder_layers=3, pipeline_parallel_layers=2)
  want, want_values = jax.jit(plain.apply_with_intermediates)(plain.params(), tokens)
  got, values = jax.jit(piped.apply_with_intermediates)(piped.params(), tokens)
  np.testing.assert_allclose(got, want, atol=1e-5)
  # QK-Clip's per-layer maxima, in depth order over every stack.
  np.testing.assert_allclose(values["decoder/max_logits"], want_values["decoder/max_logits"], atol=1e-5)


def test_quantized_pipeline_matches_the_plain_model():
  # AQT int8 in every dense layer, run inside the pipeline's stages.
  plain, piped, tokens = _logits_pair("linen", quantization="int8", base_num_decoder_layers=2)
  np.testing.assert_allclose(
      jax.jit(piped.apply)(piped.params(), tokens), jax.jit(plain.apply)(plain.params(), tokens), atol=1e-5
  )


def test_decoding_runs_the_stack_unpipelined():
  plain, piped, tokens = _logits_pair("nnx", base_num_decoder_layers=2)
  np.testing.assert_array_equal(piped.generate(tokens[:1, :4], 4), plain.generate(tokens[:1, :4], 4))


# --- 8 devices: training against one device (tests/pipeline_multidevice.py) ---------------------


@pytest.fixture(scope="module")
def report():
  proc = subprocess.run(
      [sys.executable, str(HERE / "pipeline_multidevice.py")], capture_output=True, text=True, timeout=900
  )
  assert proc.returncode == 0, failure(proc.stderr)
  return json.loads(proc.stdout)


@pytest.mark.parametrize(
    "run",
    [
        "llama/linen@2x4",
        "llama/nnx@2x4",
        "llama/nnx-state/linen-model/nnx-decoder@2x4",
        "llama/linen@4x2",
        "llama/nnx@4x2",
        "deepseek/linen@2x4",
        "deepseek/nnx@2x4",
        "features/linen@2x4",
        "features/nnx@2x4",
    ],
)
def test_pipelined_training_matches_one_device(report, run):
  assert report["devices"] == 8
  reference = report["losses"][run.split("/")[0] + "@1"]
  assert len(report["losses"][run]) == len(reference) == 4
  np.testing.assert_allclose(report["losses"][run], reference, rtol=1e-4)


@pytest.mark.parametrize("direction", ["pipeline->fsdp", "fsdp->pipeline"])
def test_checkpoint_moves_on_and_off_a_pipeline_mesh(report, direction):
  restored = report["restore"][direction]
  assert restored["params_equal"]
  np.testing.assert_allclose(restored["losses"], report["losses"]["llama@1"], rtol=1e-4)
