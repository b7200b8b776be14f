"""Hugging Face interchange: tiny random transformers models, imported into both backends.

Every family is built from its transformers config, every parameter (norm
weights and biases included, which Hugging Face initialises to constants) is
randomised so that a dropped or misplaced tensor shows, and the model is saved
with save_pretrained (safetensors). Then: our logits match transformers' to
1e-4 in float32, greedy continuations are identical, export-hf gives a folder
transformers loads with the same logits, and importing that folder is exact.
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge import cli
from maxbridge.models import dispatch
from maxbridge.interop import hf
from maxbridge.interop import pretrained
from conftest import LINEN_ARGS

LOGITS_TOL = 1e-4
PROMPT = np.array([[3, 17, 250, 42, 9], [100, 1, 77, 200, 31]], np.int64)
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 12))
LLAMA_DIMS = dict(
    hidden_size=64,
    num_hidden_layers=2,
    vocab_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    initializer_range=0.1,
)


def _llama():
  return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_DIMS))


def _llama3_1():  # Llama 3.1's RoPE scaling, its bands placed within the test sequences
  rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
  config = transformers.LlamaConfig(**LLAMA_DIMS, rope_parameters={**rope, "original_max_position_embeddings": 16})
  return transformers.LlamaForCausalLM(config)


def _mistral():  # a window shorter than the test sequences
  return transformers.MistralForCausalLM(transformers.MistralConfig(**LLAMA_DIMS, sliding_window=5))


def _qwen3():  # tied embeddings, and a rope theta other than 10000
  config = transformers.Qwen3Config(
      **LLAMA_DIMS, head_dim=16, tie_word_embeddings=True, rope_parameters={"rope_theta": 1e6, "rope_type": "default"}
  )
  return transformers.Qwen3ForCausalLM(config)


def _gpt2():
  config = transformers.GPT2Config(
      n_embd=64,
      n_layer=2,
      n_head=4,
      vocab_size=256,
      n_positions=32,
      initializer_range=0.1,
      bos_token_id=0,
      eos_token_id=0,
  )
  return transformers.GPT2LMHeadModel(config)


def _mixtral():
  config = transformers.MixtralConfig(
      **{**LLAMA_DIMS, "intermediate_size": 64}, num_local_experts=4, num_experts_per_tok=2
  )
  return transformers.MixtralForCausalLM(config)


def _deepseek_v3():  # one dense layer then two MoE layers; group-limited routing
  config = transformers.DeepseekV3Config(
      hidden_size=64,
      num_hidden_layers=3,
      vocab_size=256,
      num_attention_heads=4,
      num_key_value_heads=4,
      intermediate_size=128,
      moe_intermediate_size=32,
      n_routed_experts=8,
      num_experts_per_tok=2,
      n_group=4,
      topk_group=2,
      first_k_dense_replace=1,
      n_shared_experts=1,
      q_lora_rank=32,
      kv_lora_rank=16,
      qk_nope_head_dim=8,
      qk_rope_head_dim=8,
      v_head_dim=12,
      routed_scaling_factor=2.5,
      initializer_range=0.1,
      rms_norm_eps=1e-5,  # the latent norms keep 1e-6 regardless
  )
  return transformers.DeepseekV3ForCausalLM(config)


BUILDERS = {
    "llama": _llama,
    "llama3_1": _llama3_1,
    "mistral": _mistral,
    "qwen3": _qwen3,
    "gpt2": _gpt2,
    "mixtral": _mixtral,
    "deepseek_v3": _deepseek_v3,
}


# Gemma 4's per-layer output scalar and its router's input and per-expert scales.
_MULTIPLIERS = ("layer_scalar", "router.scale", "router.per_expert_scale")


def randomize(model) -> None:
  """Random values for every parameter and persistent buffer, constants included."""
  generator = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
      if name.endswith("inv_freq") or not tensor.is_floating_point():
        continue
      noise = torch.randn(tensor.shape, generator=generator)
      if tensor.ndim == 1 and ("norm" in name or ".ln_" in name) and name.endswith("weight"):
        tensor.copy_(1.0 + 0.2 * noise)  # norm scales
      elif name.endswith(_MULTIPLIERS):
        tensor.copy_(1.0 + 0.2 * noise)  # multipliers that start at 1: near 0 they would vanish the signal
      elif tensor.ndim == 1:
        tensor.copy_(0.2 * noise)  # biases, router correction biases
      else:
        tensor.copy_(0.1 * noise)


class Reference:
  """A saved tiny Hugging Face model and what transformers computes with it."""

  def __init__(self, family: str, folder):
    torch.manual_seed(0)
    self.model = BUILDERS[family]().eval()
    randomize(self.model)
    self.folder = folder
    self.model.save_pretrained(folder)
    with torch.no_grad():
      self.logits = self.model(torch.tensor(TOKENS)).logits.numpy()
      self.continuation = self.model.generate(
          torch.tensor(PROMPT), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0
      ).numpy()
    assert np.std(self.logits) > 0.1, "logits too flat to tell a wrong mapping from a right one"


@pytest.fixture(scope="module", params=list(BUILDERS))
def reference(request, tmp_path_factory):
  return Reference(request.param, tmp_path_factory.mktemp(request.param) / "hf")


def max_diff(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


@pytest.mark.parametrize(
    "backend, scan_layers", [("linen", True), ("nnx", False)], ids=["linen-scanned", "nnx-unscanned"]
)
def test_imported_logits_and_greedy_continuations_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  assert model.config.pure_nnx == (backend == "nnx")
  logits = model.logits(jnp.asarray(TOKENS, jnp.int32))
  assert max_diff(logits, reference.logits) <= LOGITS_TOL
  continuation = model.generate(PROMPT, max_new_tokens=6)
  np.testing.assert_array_equal(np.asarray(continuation), reference.continuation)
  # The same continuation through mb.Engine: both prompts in two decode slots.
  engine = mb.Engine(model.config.replace(per_device_batch_size=2, max_prefill_predict_length=8), model=model)
  state = engine.init_decode_state()
  for slot, prompt in enumerate(PROMPT):
    state = engine.insert(engine.prefill(prompt), state, slot)
  first = np.asarray(state.tokens)[:, None]
  state, tokens = engine.generate_steps(state, 5)
  np.testing.assert_array_equal(np.concatenate([first, tokens], axis=1), reference.continuation[:, PROMPT.shape[1] :])


def test_export_loads_in_transformers_and_reimports_exactly(reference, tmp_path):
  assert cli.main(["import-hf", str(reference.folder), str(tmp_path / "ckpt")]) == 0
  assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "exported")]) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
  assert type(exported) is type(reference.model)
  with torch.no_grad():
    logits = exported(torch.tensor(TOKENS)).logits.numpy()
  assert max_diff(logits, reference.logits) <= 1e-5
  # The round trip through Hugging Face's layout changes no parameter at all.
  assert cli.main(["import-hf", str(tmp_path / "exported"), str(tmp_path / "again"), "--scan-layers", "false"]) == 0
  _, first = pretrained.load_checkpoint(tmp_path / "ckpt")
  _, again = pretrained.load_checkpoint(tmp_path / "again")
  first = canonical.flatten(canonical.unstack_layers(first, 1) if canonical.is_scanned(first) else first)
  again = canonical.flatten(again)
  assert sorted(first) == sorted(again)
  for path in first:
    np.testing.assert_array_equal(first[path], again[path], err_msg=path)


# --- bad input -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
  return Reference("llama", tmp_path_factory.mktemp("llama") / "hf").folder


def _tensors(folder):
  return {name: lazy() for name, lazy in hf.open_hf_tensors(folder).items()}


def _import(folder, tensors):
  cfg = hf.config_from_hf(hf.read_hf_config(folder))
  return hf.from_hf_tensors(tensors, cfg, hf.abstract_params(cfg))


def test_an_unknown_tensor_is_named(llama_folder):
  tensors = _tensors(llama_folder)
  tensors["model.layers.0.self_attn.rotary_emb.extra"] = jnp.zeros(3)
  with pytest.raises(hf.HFError, match=r"unknown: model\.layers\.0\.self_attn\.rotary_emb\.extra"):
    _import(llama_folder, tensors)


def test_a_missing_tensor_is_named_with_its_shape(llama_folder):
  tensors = _tensors(llama_folder)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(hf.HFError, match=r"missing: model\.layers\.1\.mlp\.up_proj\.weight \(128, 64\)"):
    _import(llama_folder, tensors)


def test_a_misshaped_tensor_is_named_with_both_shapes(llama_folder):
  tensors = _tensors(llama_folder)
  tensors["model.norm.weight"] = jnp.ones(63)
  with pytest.raises(hf.HFError, match=r"model\.norm\.weight has shape \(63,\), expected \(64,\)"):
    _import(llama_folder, tensors)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"model_type": "bert"}, "model_type='bert' is not supported; supported: llama"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 8.0}},
            "rope_parameters.rope_type='yarn' is not supported",
        ),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ],
)
def test_unsupported_configs_name_the_key(llama_folder, change, match):
  config = {**hf.read_hf_config(llama_folder), **change}
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf(config)


def test_both_rope_theta_spellings_are_read(llama_folder):
  config = hf.read_hf_config(llama_folder)
  config.pop("rope_parameters", None)
  config["rope_theta"] = 500000.0  # transformers 4 wrote it at the top level
  assert hf.config_from_hf(config).rope_max_timescale == 500000
  config["rope_parameters"] = {"rope_theta": 250000.0, "rope_type": "default"}  # transformers 5
  assert hf.config_from_hf(config).rope_max_timescale == 250000


def test_import_refuses_a_non_empty_destination_and_leaves_it_alone(llama_folder, tmp_path):
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "keep.txt").write_text("mine")
  assert cli.main(["import-hf", str(llama_folder), str(tmp_path / "taken")]) == 2
  assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]
  assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no temporary folder left


def test_a_folder_without_weights_is_reported(tmp_path, llama_folder):
  (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
  with pytest.raises(hf.HFError, match="holds neither model.safetensors nor model.safetensors.index.json"):
    mb.from_pretrained(tmp_path)


def test_sharded_safetensors_are_read_through_the_index(llama_folder, tmp_path):
  from safetensors.torch import load_file, save_file

  tensors = load_file(llama_folder / "model.safetensors")
  names = sorted(tensors)
  half = len(names) // 2
  shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
  for file, members in shards.items():
    save_file({n: tensors[n] for n in members}, tmp_path / file, metadata={"format": "pt"})
  index = {"weight_map": {n: file for file, members in shards.items() for n in members}}
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  (tmp_path / "config.json").write_text((llama_folder / "config.json").read_text())
  whole = mb.from_pretrained(llama_folder, backend="linen")
  sharded = mb.from_pretrained(tmp_path, backend="linen")
  np.testing.assert_array_equal(sharded.logits(TOKENS), whole.logits(TOKENS))


def test_from_pretrained_keeps_the_flags_its_config_records_unless_a_backend_is_named(llama_folder, tmp_path):
  def flags(model):
    return tuple(getattr(model.config, flag) for flag in dispatch.FLAGS)

  assert flags(mb.from_pretrained(llama_folder)) == (True, True, True)  # config.json names none: base.yml's NNX
  assert cli.main(["import-hf", str(llama_folder), str(tmp_path / "linen"), *LINEN_ARGS]) == 0
  assert flags(mb.from_pretrained(tmp_path / "linen")) == (False, False, False)  # as its config.yml records
  assert flags(mb.from_pretrained(tmp_path / "linen", backend="nnx")) == (True, True, True)
  assert flags(mb.from_pretrained(llama_folder, backend="linen")) == (False, False, False)


def test_generate_uses_the_folders_tokenizer(llama_folder, tmp_path, capsys):
  tokenizers = pytest.importorskip("tokenizers")
  import shutil

  folder = tmp_path / "with-tokenizer"
  shutil.copytree(llama_folder, folder)
  vocab = {f"w{i}": i for i in range(256)}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
  tokenizer.save(str(folder / "tokenizer.json"))
  assert (
      cli.main(["generate", str(folder), "--prompt", "w3 w17 w250", "--max-new-tokens", "4", "--backend", "linen"]) == 0
  )
  words = capsys.readouterr().out.split()
  assert words[:3] == ["w3", "w17", "w250"] and len(words) == 7
  model = mb.from_pretrained(folder, backend="linen")
  want = model.generate(np.array([3, 17, 250]), max_new_tokens=4)
  assert words == [f"w{int(t)}" for t in want]
  # import-hf keeps the tokenizer beside the checkpoint, so generate finds it there too.
  assert cli.main(["import-hf", str(folder), str(tmp_path / "ckpt")]) == 0
  capsys.readouterr()
  args = ["generate", str(tmp_path / "ckpt"), "--prompt", "w3 w17 w250", "--max-new-tokens", "4", "--backend", "nnx"]
  assert cli.main(args) == 0
  assert capsys.readouterr().out.split() == words


def test_generate_falls_back_to_bytes_and_checks_its_arguments(llama_folder, capsys):
  assert cli.main(["generate", str(llama_folder), "--prompt", "hi", "--max-new-tokens", "3", "--backend", "linen"]) == 0
  assert capsys.readouterr().out.startswith("hi")
  assert cli.main(["generate", str(llama_folder), "--max-new-tokens", "3", "--backend", "linen"]) == 2
  assert "--prompt is empty" in capsys.readouterr().err


def test_original_gpt2_names_and_mask_buffers_are_understood(tmp_path_factory, tmp_path):
  """OpenAI's GPT-2 files name tensors without "transformer." and keep attn.bias mask buffers."""
  from safetensors.torch import load_file, save_file

  reference = Reference("gpt2", tmp_path_factory.mktemp("gpt2-legacy") / "hf")
  tensors = load_file(reference.folder / "model.safetensors")
  legacy = {name.removeprefix("transformer."): t for name, t in tensors.items()}
  legacy["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
  save_file(legacy, tmp_path / "model.safetensors", metadata={"format": "pt"})
  (tmp_path / "config.json").write_text((reference.folder / "config.json").read_text())
  model = mb.from_pretrained(tmp_path, backend="linen")
  assert max_diff(model.logits(TOKENS), reference.logits) <= LOGITS_TOL


def test_deepseek_without_a_query_lora_matches_transformers(tmp_path):
  torch.manual_seed(0)
  config = _deepseek_v3().config
  config.q_lora_rank = None
  model = transformers.DeepseekV3ForCausalLM(config).eval()
  randomize(model)
  model.save_pretrained(tmp_path)
  with torch.no_grad():
    want = model(torch.tensor(TOKENS)).logits.numpy()
  ours = mb.from_pretrained(tmp_path, backend="linen")
  assert ours.config.q_lora_rank == 0
  assert max_diff(ours.logits(TOKENS), want) <= LOGITS_TOL


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_llama3_1_preset_exports_its_rope_scaling(backend, tmp_path):
  """From our preset alone (no imported config to keep): transformers reads the scaling we wrote."""
  model = mb.create_model(mb.load_config("llama3.1-tiny", **dispatch.backend_flags(backend)))
  hf.save_hf(model.params(), model.config, tmp_path / "hf")
  rope = hf.read_hf_config(tmp_path / "hf")["rope_parameters"]
  assert rope["rope_type"] == "llama3" and rope["original_max_position_embeddings"] == 16
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  with torch.no_grad():
    want = exported(torch.tensor(TOKENS)).logits.numpy()
  assert max_diff(model.logits(jnp.asarray(TOKENS, jnp.int32)), want) <= LOGITS_TOL
  unscaled = mb.create_model(model.config.replace(rope_use_scale=False), params=model.params())
  assert max_diff(unscaled.logits(jnp.asarray(TOKENS, jnp.int32)), want) > 100 * LOGITS_TOL


def test_export_hf_that_cannot_write_its_weights_exits_2_naming_the_file_and_leaves_nothing(llama_folder, tmp_path):
  """A full disk, here a file-size limit: safetensors' own error is reported as the write failure it is."""
  assert cli.main(["import-hf", str(llama_folder), str(tmp_path / "ckpt")]) == 0
  limit = "import resource, signal, runpy, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
  limit += "resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000)); "
  limit += "sys.argv[0] = 'maxbridge'; runpy.run_module('maxbridge.cli', run_name='__main__')"
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION")}  # the limit would cut them
  out = tmp_path / "out" / "hf"
  proc = subprocess.run(
      [sys.executable, "-c", limit, "export-hf", str(tmp_path / "ckpt"), str(out)],
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert f"could not write {out / 'model.safetensors'}" in proc.stderr and "nothing was written" in proc.stderr
  assert "internal error" not in proc.stderr, proc.stderr[-3000:]
  assert list((tmp_path / "out").iterdir()) == []  # neither the folder nor its staging copy
