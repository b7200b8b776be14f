"""Every field of every family's transformers config class: honoured exactly, refused by name, or ignored.

`maxbridge/interop/hf/FIELDS.md` classifies each field. Here: the table covers
every field of each transformers class (a new transformers field fails until it
is classified); each `refused` row has a case whose import raises `HFError`
naming the field; each `honoured` row has a case where a non-default value,
written into a tiny model's config.json, gives the logits transformers computes
from that same folder; and our copies of the class defaults are transformers'.
"""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from test_hf import LOGITS_TOL, max_diff, randomize  # noqa: E402

FIELDS_MD = Path(hf.__file__).parent / "FIELDS.md"
TOKENS = np.random.default_rng(0).integers(0, 64, (2, 10))
from hf_field_cases import DELETE, FAMILIES, REFUSED  # noqa: E402
from hf_field_honoured import HONOURED  # noqa: E402


def read_table() -> dict[str, dict[str, str]]:
  """{family: {field: status}} from FIELDS.md."""
  table: dict[str, dict[str, str]] = {}
  family = None
  for line in FIELDS_MD.read_text().splitlines():
    if heading := re.match(r"## (\w+)", line):
      family = heading.group(1)
      table[family] = {}
    elif family and (row := re.match(r"\| (\w+) \| (honoured|refused|ignored) \|", line)):
      assert row.group(1) not in table[family], f"{family}.{row.group(1)} is listed twice"
      table[family][row.group(1)] = row.group(2)
  return table


def config_class(family: str):
  return getattr(transformers, FAMILIES[family][0])


# --- the table -------------------------------------------------------------------------------


def test_the_table_classifies_every_field_of_every_config_class():
  table = read_table()
  generic = {field.name for field in dataclasses.fields(transformers.PreTrainedConfig)}
  assert generic <= set(table["all"]), sorted(generic - set(table["all"]))
  for family in FAMILIES:
    cls = config_class(family)
    fields = {field.name for field in dataclasses.fields(cls)} - generic
    fields |= set(cls.attribute_map) | set(cls.attribute_map.values())
    missing = fields - set(table[family])
    assert not missing, f"FIELDS.md's {family} section does not classify {sorted(missing)}"


def test_every_honoured_and_refused_row_has_a_case():
  table = read_table()
  honoured = {(case.family, field) for case in HONOURED for field in case.fields}
  refused = {(family, field) for family, field, _, _ in REFUSED}
  for family, rows in table.items():
    for field, status in rows.items():
      if status == "honoured" and field != "_name_or_path":
        assert (family, field) in honoured, f"no case checks {family}.{field} against transformers"
      if status == "refused":
        assert (family, field) in refused, f"no case checks that {family}.{field} is refused"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_class_defaults_are_transformers(family):
  ours = hf.family_for_model_type(family).config_class
  assert ours.name == FAMILIES[family][0]
  defaults = {field.name: field.default for field in dataclasses.fields(config_class(family))}
  for name, value in ours.defaults.items():
    assert (
        name in defaults and defaults[name] == value
    ), f"{family}.{name}: ours {value!r}, transformers {defaults[name]!r}"
  assert ours.default_theta == config_class(family).default_theta
  assert ours.aliases == config_class(family).attribute_map


# --- refused ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_configs(tmp_path_factory):
  """{family: the config.json transformers' save_pretrained writes for FAMILIES' tiny config}."""
  configs = {}
  for family, (config_name, _, dims) in FAMILIES.items():
    folder = tmp_path_factory.mktemp(family)
    getattr(transformers, config_name)(**dims).save_pretrained(folder)
    configs[family] = json.loads((folder / "config.json").read_text())
  return configs


@pytest.mark.parametrize("family, field, edit, match", REFUSED, ids=[f"{r[0]}-{r[1]}" for r in REFUSED])
def test_a_refused_field_is_named(saved_configs, family, field, edit, match):
  config = {**saved_configs["llama" if family == "all" else family], **edit}
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf(config)
  assert field in match.replace("\\", "")


def test_the_default_of_a_refused_field_is_accepted(saved_configs):
  for family, field, edit, _ in REFUSED:
    if family != "all" and field in saved_configs[family]:
      hf.config_from_hf({**saved_configs[family], field: saved_configs[family][field]})


# --- honoured: logits against transformers ------------------------------------------------------


def save_tiny(folder: Path, family: str, build: dict, edit: dict) -> Path:
  """A tiny random model of `family` saved by transformers, then `edit` written into its config.json."""
  config_name, model_name, dims = FAMILIES[family]
  torch.manual_seed(0)
  model = getattr(transformers, model_name)(getattr(transformers, config_name)(**{**dims, **build}))
  randomize(model)
  model.save_pretrained(folder)
  config = json.loads((folder / "config.json").read_text())
  config.update(edit)
  config = {key: value for key, value in config.items() if value is not DELETE}
  (folder / "config.json").write_text(json.dumps(config))
  return folder


def transformers_logits(folder: Path) -> np.ndarray:
  # Eager attention: GPT-2's reorder_and_upcast_attn takes effect only there.
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    return model.eval()(torch.tensor(TOKENS)).logits.numpy()


@pytest.mark.parametrize("case", HONOURED, ids=[case.id for case in HONOURED])
def test_an_honoured_field_gives_transformers_logits(case, tmp_path):
  family = "llama" if case.family == "all" else case.family
  folder = save_tiny(tmp_path, family, case.build, case.edit)
  want = transformers_logits(folder)
  assert np.std(want) > 0.1, "logits too flat to tell a wrong reading from a right one"
  model = mb.from_pretrained(folder, backend="linen")
  for key, value in case.expect.items():
    assert getattr(model.config, key) == value, key
  assert max_diff(model.logits(TOKENS), want) <= LOGITS_TOL


# --- the two examples of issue 27 ------------------------------------------------------------


def test_tied_embeddings_beside_a_different_stored_head_read_as_transformers_does(tmp_path):
  """tie_word_embeddings=true, but lm_head.weight is stored and differs: transformers 5.x unties them."""
  folder = save_tiny(tmp_path / "hf", "llama", {}, {"tie_word_embeddings": True})
  want = transformers_logits(folder)
  with pytest.warns(UserWarning, match=r"tie_word_embeddings=true, but lm_head\.weight differs"):
    model = mb.from_pretrained(folder, backend="linen")
  assert not model.config.logits_via_embedding
  assert max_diff(model.logits(TOKENS), want) <= LOGITS_TOL
  # The lower-level path, which has no chance to untie, refuses instead of reading the embedding.
  cfg = hf.config_from_hf(hf.read_hf_config(folder))
  with pytest.raises(hf.HFError, match=r"tie_word_embeddings=true, but .* holds a lm_head\.weight that differs"):
    hf.from_hf_tensors(hf.open_hf_tensors(folder), cfg, hf.abstract_params(cfg))


def test_a_stored_head_equal_to_the_embedding_stays_tied(tmp_path):
  from safetensors.torch import load_file, save_file

  folder = save_tiny(tmp_path / "hf", "llama", {"tie_word_embeddings": True}, {})
  tensors = load_file(folder / "model.safetensors")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  model = mb.from_pretrained(folder, backend="linen")
  assert model.config.logits_via_embedding
  assert max_diff(model.logits(TOKENS), transformers_logits(folder)) <= LOGITS_TOL


def test_a_legacy_linear_rope_scaling_beside_rope_parameters_is_refused_by_name(saved_configs):
  """transformers reads rope_scaling in place of rope_parameters: linear scaling, which maxbridge does not implement."""
  config = {
      **saved_configs["llama"],
      "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
      "rope_scaling": {"type": "linear", "factor": 4},
  }
  with pytest.raises(hf.HFError, match=r"rope_scaling\.type='linear' is not supported \(transformers reads rope_scaling"):
    hf.config_from_hf(config)
  # An empty rope_scaling replaces nothing.
  config["rope_scaling"] = {}
  assert hf.config_from_hf(config).rope_max_timescale == 500000


def test_export_drops_aliases_that_would_override_what_it_writes(tmp_path):
  folder = save_tiny(tmp_path / "hf", "mixtral", {}, {"num_experts": 4})
  model = mb.from_pretrained(folder, backend="linen")
  written = hf.config_to_hf(model.config, hf.read_hf_config(folder))
  assert "num_experts" not in written and written["num_local_experts"] == 4
