"""`attention=flash` on accelerators: Pallas splash attention (TPU) and cuDNN's (GPU) compute dot_product's result.

Splash runs here in the Pallas interpreter (`splash_attention.INTERPRET`), the TPU's own program on the CPU:
outputs and gradients (its own VJP) equal dot_product's in float32 to 1e-5 for every mask kind, at 200 tokens
(two 128-token blocks, the second padded). Then a model on the TPU path, Linen and NNX; a compile of the real
Mosaic kernel for a v5p topology from this host; and the cuDNN path's arguments, read by JAX's XLA implementation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import topologies
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

import maxbridge as mb
from maxbridge.core import sharding
from maxbridge.core.config import ConfigError
from maxbridge.core.config import MESH_AXES
from maxbridge.ops import attention, cudnn_attention, splash_attention
from conftest import LINEN, assert_flash_gives_dot_products_logits, flag_id, tiny_config

TOL = dict(rtol=1e-5, atol=1e-5)
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 200, 4, 2, 8  # GQA: two query heads per kv head

rng = np.random.default_rng(0)
QUERY = rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)).astype(np.float32)
KEY = rng.normal(size=(BATCH, LENGTH, KV_HEADS, HEAD_DIM)).astype(np.float32)
VALUE = rng.normal(size=(BATCH, LENGTH, KV_HEADS, HEAD_DIM)).astype(np.float32)
SINKS = rng.normal(size=(HEADS,)).astype(np.float32)
# Row 0 one document; row 1 three packed ones (positions restart with each, so chunks do too).
SEGMENTS = np.array([[1] * LENGTH, [1] * 70 + [2] * 100 + [3] * 30], np.int32)
POSITIONS = np.array([list(range(LENGTH)), [*range(70), *range(100), *range(30)]], np.int32)
SELF = dict(q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS, q_positions=POSITIONS, kv_positions=POSITIONS)


@pytest.fixture(autouse=True)
def interpreted(monkeypatch):
  monkeypatch.setattr(splash_attention, "INTERPRET", True)
  monkeypatch.setattr(splash_attention, "DEFAULT", splash_attention.Blocks(*[128] * 8))


def run(kernel, query, key, value, sinks, **options):
  """(output, gradients of a weighted sum of the output w.r.t. query, key, value and sinks)."""
  out_shape = (*query.shape[:3], value.shape[-1])
  cotangent = np.cos(np.arange(np.prod(out_shape))).reshape(out_shape).astype(np.float32)

  def loss(query, key, value, sinks):
    out = kernel(query, key, value, sinks=sinks, **options)
    return jnp.sum(out * cotangent), out

  argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(query, key, value, sinks)
  return out, grads


def assert_equals_dot_product(kernel, query, key, value, sinks=None, **options):
  want_out, want_grads = run(attention.dot_product_attention, query, key, value, sinks, **options)
  out, grads = run(kernel, query, key, value, sinks, **options)
  name = getattr(kernel, "__name__", kernel)
  np.testing.assert_allclose(out, want_out, **TOL, err_msg=f"{name}'s output differs from dot_product's")
  for what, got, want in zip(("query", "key", "value", "sinks"), grads, want_grads):
    np.testing.assert_allclose(got, want, **TOL, err_msg=f"{name}'s gradient w.r.t. {what} differs from dot_product's")


def test_splash_equals_dot_product_causal_packed_grouped_query():
  assert_equals_dot_product(splash_attention.splash_attention, QUERY, KEY, VALUE, **SELF)


def test_splash_equals_dot_product_with_a_sliding_window_and_sinks():
  # gpt-oss: a window on alternate layers and a sink logit per head in every softmax.
  assert_equals_dot_product(splash_attention.splash_attention, QUERY, KEY, VALUE, SINKS, sliding_window_size=5, **SELF)


def test_splash_equals_dot_product_with_chunks_a_soft_cap_and_a_query_scale():
  # Llama 4's chunks count from each document's start (row 1's restart at 70 and 170), Gemma 2's cap bends scores.
  options = dict(chunk_size=32, logits_soft_cap=1.5, query_scale=0.5)
  assert_equals_dot_product(splash_attention.splash_attention, QUERY, KEY, VALUE, **options, **SELF)


def test_splash_equals_dot_product_with_values_wider_than_keys_as_mla_has():
  value = rng.normal(size=(BATCH, LENGTH, KV_HEADS, 2 * HEAD_DIM)).astype(np.float32)
  assert_equals_dot_product(splash_attention.splash_attention, QUERY, KEY, value, **SELF)


def test_splash_refuses_what_it_cannot_express_naming_the_key():
  with pytest.raises(ValueError, match="attention=flash on a TPU .* QK-Clip's per-head max logits .use_qk_clip=true"):
    splash_attention.splash_attention(QUERY, KEY, VALUE, return_max_logits=True, **SELF)
  with sharding.active(AbstractMesh((2,), ("context",)), ()), pytest.raises(ValueError, match="context parallelism"):
    splash_attention.splash_attention(QUERY, KEY, VALUE, **SELF)


def test_the_kernel_is_chosen_by_the_attention_key_and_the_platform():
  assert attention.choose_kernel("flash", "cpu") is attention.KERNELS["flash"]
  assert attention.choose_kernel("dot_product", "tpu").func is attention.dot_product_attention
  assert attention.choose_kernel("autoselected", "cpu").func is attention.dot_product_attention
  # On a TPU, autoselected reads dot_product where splash cannot go (QK-Clip's max logits); flash refuses.
  options = dict(return_max_logits=True, **SELF)
  out, max_logits = attention.choose_kernel("autoselected", "tpu")(QUERY, KEY, VALUE, **options)
  want_out, want_max_logits = attention.dot_product_attention(QUERY, KEY, VALUE, **options)
  np.testing.assert_array_equal(out, want_out)
  np.testing.assert_array_equal(max_logits, want_max_logits)
  with pytest.raises(ValueError, match="attention=flash on a TPU"):
    attention.choose_kernel("flash", "tpu")(QUERY, KEY, VALUE, **options)


def test_float32_logits_changes_nothing_in_float32_and_keeps_bfloat16_scores_otherwise():
  options = dict(logits_soft_cap=1.5, sinks=SINKS, **SELF)
  got = attention.dot_product_attention(QUERY, KEY, VALUE, float32_logits=False, **options)
  np.testing.assert_array_equal(got, attention.dot_product_attention(QUERY, KEY, VALUE, float32_logits=True, **options))
  half = [x.astype(jnp.bfloat16) for x in (QUERY, KEY, VALUE)]
  low = attention.dot_product_attention(*half, float32_logits=False, **options).astype(np.float32)
  high = attention.dot_product_attention(*half, float32_logits=True, **options).astype(np.float32)
  # Both near the float32 result; a bfloat16 softmax is not the float32 one.
  for name, result in (("bfloat16", low), ("float32", high)):
    np.testing.assert_allclose(result, got, atol=0.1, err_msg=f"{name} logits from bfloat16 inputs")
  assert np.abs(low - high).max() > 0, "float32_logits=false left the scores in float32"


@pytest.fixture
def splash_calls(monkeypatch):
  """Runs the TPU path here (the platform a step is compiled for says tpu), each splash call counted, so a model
  that never reached it would not pass for one that matched."""
  monkeypatch.setattr(sharding, "platform", lambda: "tpu")
  calls = []

  def counted(*args, **kwargs):
    calls.append(args[0].shape)
    return splash_attention.splash_attention(*args, **kwargs)

  monkeypatch.setitem(attention.ACCELERATED, "tpu", (splash_attention, counted))
  return calls


def test_a_tiny_llama_on_the_tpu_path_gives_dot_products_logits_on_linen_and_nnx(splash_calls):
  assert_flash_gives_dot_products_logits(splash_calls, "splash attention")


@pytest.fixture
def block_sizes(monkeypatch):
  """Each `splash.BlockSizes` a splash kernel is built with."""
  made, make = [], splash_attention.splash.make_splash_mha
  monkeypatch.setattr(
      splash_attention.splash, "make_splash_mha", lambda *a, **k: made.append(k["block_sizes"]) or make(*a, **k)
  )
  return made


def test_other_block_sizes_the_fused_backward_and_sequence_minor_layouts_equal_dot_product(block_sizes):
  # 200 tokens padded to 512 (the blocks' least common multiple); dq from the dk/dv kernel.
  blocks = splash_attention.Blocks(256, 512, 128, 128, 256, 128, 128, 128, True, "SEQ_MINOR", "SEQ_MINOR", "SEQ_MINOR")
  kernel = functools.partial(splash_attention.splash_attention, blocks=blocks)
  assert_equals_dot_product(kernel, QUERY, KEY, VALUE, SINKS, sliding_window_size=70, **SELF)
  made = block_sizes[-1]
  assert (made.block_q, made.block_kv, made.block_kv_compute, made.block_kv_dkv) == (256, 256, 128, 256)  # clipped
  assert made.use_fused_bwd_kernel and made.block_q_dq is None and made.q_layout.name == "SEQ_MINOR"


def test_a_models_sa_keys_reach_the_splash_kernel_on_linen_and_nnx(splash_calls, block_sizes):
  keys = dict(sa_use_fused_bwd_kernel=True, sa_k_layout="SEQ_MINOR", sa_block_kv_compute=256, sa_block_kv=1024)
  for flags in (LINEN, (True, True, True)):
    config = tiny_config(flags, attention="flash", **keys)
    tokens = jnp.arange(32).reshape(2, 16)
    got = mb.create_model(config, seed=0).logits(tokens)
    want = mb.create_model(config.replace(attention="dot_product"), seed=0).logits(tokens)
    np.testing.assert_allclose(got, want, **TOL, err_msg=flag_id(flags))
  assert splash_calls and block_sizes
  # 16 tokens: every size clipped to one 128-lane block; the layout and the fused backward as set.
  assert {(b.block_kv, b.block_kv_compute, b.use_fused_bwd_kernel, b.k_layout.name) for b in block_sizes} == {
      (128, 128, True, "SEQ_MINOR")
  }


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(sa_block_q=100), r"'sa_block_q' = 100 is invalid; it must be a positive multiple of 128"),
        (dict(sa_block_kv=512, sa_block_kv_compute=384), r"sa_block_kv_compute=384 must divide sa_block_kv=512"),
        (dict(sa_v_layout="ROW_MAJOR"), r"'sa_v_layout' = 'ROW_MAJOR' is invalid; valid values: 'HEAD_DIM_MINOR'"),
    ],
)
def test_splash_keys_that_the_kernel_cannot_take_are_refused_naming_the_key(keys, message):
  with pytest.raises(ConfigError, match=message):
    tiny_config(**keys)


def test_splash_compiles_for_a_v5p_topology_from_this_host_in_less_memory_than_the_scores(monkeypatch):
  # The real kernel (no interpreter: the step is compiled for a TPU), shard_mapped over fsdp (batch) and tensor
  # (heads) of 4 abstract v5p chips, with its backward pass.
  monkeypatch.setattr(splash_attention, "INTERPRET", None)
  monkeypatch.setattr(splash_attention, "DEFAULT", splash_attention.Blocks())  # base.yml's 512s
  # libtpu is a test dependency (maxbridge[tpu]): without it this fails, as a user's compile would.
  devices = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1").devices
  sizes = dict(fsdp=2, tensor=2)
  mesh = Mesh(np.asarray(devices).reshape([sizes.get(axis, 1) for axis in MESH_AXES]), MESH_AXES)
  rules = (("activation_batch", ("data", "fsdp")), ("activation_heads", ("tensor",)))
  batch, length, heads, kv_heads, head_dim = 2, 1024, 4, 2, 128

  def spec(shape, dtype, *axes):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec(*axes)))

  def loss(query, key, value, segment_ids, positions):
    with sharding.active(mesh, rules):
      out, _ = attention.self_attention(query, key, value, segment_ids, positions, kernel="flash")
    return jnp.sum(out.astype(jnp.float32))

  qkv = [spec((batch, length, n, head_dim), jnp.bfloat16, "fsdp", None, "tensor") for n in (heads, kv_heads, kv_heads)]
  ids = [spec((batch, length), jnp.int32, "fsdp")] * 2
  compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*qkv, *ids).compile()
  assert compiled.as_text().count("tpu_custom_call") == 3, "splash's forward, dq and dkv Mosaic kernels"
  # dot_product would hold each device's [1, 2, 1024, 1024] float32 scores: 8 MiB, and their softmax besides.
  scores = (batch // 2) * (heads // 2) * length * length * 4
  temporaries = compiled.memory_analysis().temp_size_in_bytes
  assert temporaries * 3 < scores, f"splash's temporaries per chip {temporaries} vs one score matrix {scores}"


def test_cudnn_path_arguments_mean_dot_products_mask(monkeypatch):
  # JAX's XLA implementation reads the same arguments cuDNN's would: causal, window, chunks and documents, GQA.
  monkeypatch.setattr(cudnn_attention, "IMPLEMENTATION", "xla")
  for options in (dict(sliding_window_size=5), dict(chunk_size=32, query_scale=0.5)):
    got = cudnn_attention.cudnn_attention(QUERY, KEY, VALUE, **options, **SELF)
    want = attention.dot_product_attention(QUERY, KEY, VALUE, **options, **SELF)
    np.testing.assert_allclose(got, want, **TOL, err_msg=f"cuDNN's arguments for {options} differ from dot_product")
  for refused, options in (
      ("soft-cap the attention logits .attn_logits_soft_cap=1.5", dict(logits_soft_cap=1.5)),
      ("attention sinks", dict(sinks=SINKS)),
      ("MLA's v_head_dim", dict(value=np.zeros((BATCH, LENGTH, KV_HEADS, 4), np.float32))),
  ):
    arguments = dict(query=QUERY, key=KEY, value=VALUE, **SELF) | options
    with pytest.raises(ValueError, match=f"attention=flash on a GPU .cuDNN. cannot .*{refused}"):
      cudnn_attention.cudnn_attention(**arguments)
