"""DeepSeek-V3's YaRN on MLA (DeepSeek-V3's and Kimi-K2's `rope_scaling`), against transformers' DeepseekV3.

A tiny random DeepseekV3 whose YaRN matters at the test's positions: factor 4
over 16 original positions (the rows run to 24), and a non-zero mscale_all_dim,
which multiplies the softmax scale. Imported on both backends, its logits are
transformers'; without the scaling they are not; export writes the rope
fields back, transformers reads them, and importing the export gives the same
keys.
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from test_hf import LOGITS_TOL, _deepseek_v3, max_diff, randomize  # noqa: E402

TOKENS = np.random.default_rng(1).integers(0, 256, (2, 24))
_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0, "beta_slow": 1.0}
# DeepSeek-V3's shape of it: mscale = mscale_all_dim, so the cos/sin keep factor 1 and only the softmax scale grows;
# and mscale_all_dim alone, where transformers also multiplies the cos/sin by 0.1 ln(factor) + 1.
SCALINGS = {
    "deepseek-v3": {**_YARN, "mscale": 0.8, "mscale_all_dim": 0.8},
    "all-dim-only": {**_YARN, "mscale_all_dim": 1.0},
}
ROPE_KEYS = (
    "rope_type",
    "rope_max_timescale",
    "rope_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "rope_truncate",
    "rope_attention_scaling",
    "mscale",
)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
  """scaling -> (a saved tiny random DeepseekV3 with it, transformers' logits), built on first use."""
  built = {}

  def build(name):
    if name not in built:
      torch.manual_seed(0)
      config = _deepseek_v3().config.to_dict()
      config.pop("rope_parameters", None)
      rope_scaling = {**SCALINGS[name], "rope_theta": 1e4}
      model = transformers.DeepseekV3ForCausalLM(
          transformers.DeepseekV3Config(**{**config, "rope_scaling": rope_scaling})
      ).eval()
      randomize(model)
      folder = tmp_path_factory.mktemp(name) / "hf"
      model.save_pretrained(folder)
      with torch.no_grad():
        logits = model(torch.tensor(TOKENS)).logits.numpy()
      assert np.std(logits) > 0.1
      built[name] = folder, logits
    return built[name]

  return build


# Both backends on DeepSeek-V3's shape; the other on one (the same layers, only the cos/sin factor differs). Each
# change undoes one part of the scaling, which must then show in the logits.
@pytest.mark.parametrize(
    "name, backend, changes",
    [
        ("deepseek-v3", "linen", []),
        ("deepseek-v3", "nnx", [dict(rope_type="default"), dict(mscale=0.0)]),
        ("all-dim-only", "linen", [dict(rope_attention_scaling=False)]),
    ],
    ids=["deepseek-v3-linen", "deepseek-v3-nnx", "all-dim-only-linen"],
)
def test_yarn_logits_match_transformers_and_differ_without_it(references, name, backend, changes):
  folder, want = references(name)
  model = mb.from_pretrained(folder, backend=backend)
  config = model.config
  assert (config.rope_type, config.rope_factor, config.original_max_position_embeddings) == ("yarn", 4.0, 16)
  assert (config.mscale, config.rope_attention_scaling) == ((0.8, False) if name == "deepseek-v3" else (1.0, True))
  tokens = jnp.asarray(TOKENS, jnp.int32)
  assert max_diff(model.logits(tokens), want) <= LOGITS_TOL
  for change in changes:
    unscaled = mb.create_model(config.replace(**change), params=model.params())
    assert max_diff(unscaled.logits(tokens), want) > 100 * LOGITS_TOL, change


@pytest.mark.parametrize("name", list(SCALINGS))
def test_export_writes_the_rope_fields_back(references, name, tmp_path):
  folder, want = references(name)
  model = mb.from_pretrained(folder, backend="linen")
  hf.save_hf(model.params(), model.config, tmp_path / "exported")  # from our keys alone, no imported config.json
  rope = hf.read_hf_config(tmp_path / "exported")["rope_parameters"]
  assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0 and rope["original_max_position_embeddings"] == 16
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
  with torch.no_grad():
    assert max_diff(exported(torch.tensor(TOKENS)).logits.numpy(), want) <= LOGITS_TOL
  again = hf.config_from_hf(hf.read_hf_config(tmp_path / "exported"))
  assert {key: getattr(again, key) for key in ROPE_KEYS} == {key: getattr(model.config, key) for key in ROPE_KEYS}


def test_a_cos_sin_factor_mla_cannot_take_is_refused_by_name():
  raw = {"model_type": "deepseek_v3", "rope_scaling": {**_YARN, "mscale": 1.0, "mscale_all_dim": 0.5}}
  with pytest.raises(hf.HFError, match="rope_scaling scales YaRN's cos/sin"):
    hf.config_from_hf(raw)
  with pytest.raises(hf.HFError, match="no 'factor'"):
    hf.config_from_hf({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "yarn"}})
