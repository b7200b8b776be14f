"""The family registry: every preset's family has an entry; nothing outside the registry branches on a family's name."""

import ast
import re
import types
from pathlib import Path

import pytest
import yaml

import maxbridge as mb
from maxbridge.core import families
from maxbridge.core.config import BASE_CONFIG, PRESET_DIR

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("maxbridge", "linen_models", "nnx_models", "converters")
REGISTRY = ROOT / "maxbridge" / "core" / "families"


def _decoder_block(path: Path) -> str | None:
  return (yaml.safe_load(path.read_text()) or {}).get("decoder_block")


def test_every_preset_decoder_block_has_an_entry():
  default = _decoder_block(BASE_CONFIG)
  presets = sorted(PRESET_DIR.glob("*.yml"))
  assert presets
  for preset in presets:
    block = _decoder_block(preset) or default
    assert block in families.lookup(block).decoder_blocks, preset.name


def test_looking_up_an_unknown_block_names_the_valid_ones():
  listed = ", ".join(repr(block) for block in families.DECODER_BLOCKS)
  # Registry order; the families issue 28 adds follow the first six.
  assert listed.startswith("'llama2', 'mistral', 'qwen3', 'gpt3', 'mixtral', 'deepseek', ")
  assert "'gemma', 'gemma2'" in listed
  with pytest.raises(families.UnknownFamily, match=f"decoder_block='gemma5' has no family entry; valid values: {listed}"):
    families.lookup("gemma5")
  with pytest.raises(mb.ConfigError, match=f"'decoder_block' = 'gemma5' is invalid; valid values: {listed}"):
    mb.load_config("llama-tiny", decoder_block="gemma5")


def _family_name_comparisons(tree: ast.AST) -> list[int]:
  """Lines that compare with a family's name (`== "gpt3"`, `in ("llama2", ...)`), whatever the other side."""

  def names_a_family(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
      return node.value in families.DECODER_BLOCKS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return any(names_a_family(element) for element in node.elts)
    return False

  lines = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Compare) and any(map(names_a_family, [node.left, *node.comparators])):
      lines.append(node.lineno)
  return lines


def test_no_module_outside_the_registry_branches_on_a_family_name():
  offenders = []
  for package in PACKAGES:
    for file in sorted((ROOT / package).rglob("*.py")):
      if REGISTRY in file.parents:
        continue
      for line in _family_name_comparisons(ast.parse(file.read_text(), str(file))):
        offenders.append(f"{file.relative_to(ROOT)}:{line}")
  assert not offenders, f"these compare with a family's name; ask the family entry instead: {offenders}"


def test_the_check_finds_a_family_name_comparison():
  code = 'if config.decoder_block == "gpt3": pass\nshared = block in ("mixtral", "x")\nkind = "deepseek"\n'
  assert _family_name_comparisons(ast.parse(code)) == [1, 2]


def test_each_backend_has_a_layer_class_for_every_layer_kind():
  from linen_models import decoders as linen_decoders
  from nnx_models import decoders as nnx_decoders

  kinds = {stack.kind for family in families.REGISTRY for stack in family.stacks}
  assert set(linen_decoders.LAYER_CLASSES) == kinds
  assert set(nnx_decoders.LAYER_CLASSES) == kinds


def test_attention_is_written_once_per_backend():
  """One layer per backend reads the decode cache and calls the kernel; MLA, whose cache is its latent, is the other."""
  skeleton = re.compile(r"\battention\.self_attention\(|\bread_cache\(|\bupdate_cache\(")
  for package in ("linen_models", "nnx_models"):
    writers = sorted(file.name for file in (ROOT / package).glob("*.py") if skeleton.search(file.read_text()))
    assert writers == ["attention.py", "attention_mla.py"], f"{package}: attention's chain is spelt again in {writers}"


def test_every_family_and_kind_of_layer_has_an_attention_spec():
  for name in ("llama-tiny", "qwen3-tiny", "gemma2-tiny", "gemma3-tiny", "gemma4-tiny", "gpt-oss-tiny", "llama4-tiny"):
    config = mb.load_config(name)
    for local, kv_shared in ((False, False), (True, False), (True, True), (False, True)):
      spec = config.family.attention(config, local=local, kv_shared=kv_shared)
      assert spec.head_dim > 0 and spec.kv_heads > 0, (name, local, kv_shared)
  gemma4 = mb.load_config("gemma4-tiny")
  assert gemma4.family.attention(gemma4, local=True, kv_shared=True).kv == "shared"
  llama4 = mb.load_config("llama4-tiny")
  assert llama4.family.attention(llama4, local=True).chunk_size == llama4.chunk_attn_window_size
  assert llama4.family.attention(llama4, local=False).rope == "no_rope"


def test_a_family_check_returns_messages_and_the_config_raises_them():
  config = mb.load_config("gpt3-tiny")
  assert config.family is families.lookup("gpt3")
  assert config.family.check(config) == []
  faults = dict(base_num_kv_heads=2, sliding_window_size=4)
  messages = config.family.check(types.SimpleNamespace(**{**config.to_dict(), **faults}))
  assert messages == [
      "decoder_block='gpt3' has no grouped-query attention: base_num_kv_heads=2 must equal base_num_query_heads=4",
      "decoder_block='gpt3' has its own attention, which reads neither sliding_window_size=4 nor use_qk_norm=False: "
      "leave them at 0 and false",
  ]
  with pytest.raises(mb.ConfigError) as raised:
    mb.load_config("gpt3-tiny", **faults)
  assert str(raised.value) == "\n".join(messages)


OWN_KEYS = [
    (family.decoder_blocks[0], key, default) for family in families.REGISTRY for key, default in family.own_keys.items()
]


@pytest.mark.parametrize("block, key, default", OWN_KEYS, ids=[f"{block}.{key}" for block, key, _ in OWN_KEYS])
def test_a_familys_own_key_set_for_another_family_is_refused_by_name(block, key, default):
  # Read by `block`'s layers only: another family would silently ignore it.
  other = "llama-tiny" if block != "llama2" else "gemma-tiny"
  if isinstance(default, bool):
    off = not default
  else:  # a valid value other than the default
    off = abs(default) + 1 if isinstance(default, int) else (default / 2 if default else 0.5)
  with pytest.raises(mb.ConfigError, match=rf"{key}=.* is read by decoder_block=(\S+ and )*'{block}'( and \S+)* only"):
    mb.load_config(other, **{key: off})
