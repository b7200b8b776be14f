"""Sharding goldens (MaxText's sharding_compare_test): every preset's train-state plan, committed, on both backends.

Each file in tests/goldens/shardings/ is what

    maxbridge shardings --devices 8 PRESET OVERRIDES

prints for one preset (the tiny ones and the real-size ones, all abstract: an
AbstractMesh, no devices, no arrays) on one mesh of MESHES: every
parameter's and optimizer state's shape, dtype, logical axes, PartitionSpec
and bytes per device; or, where the config refuses the mesh (a pipeline over
too few layers, an array that does not divide), the error. The test renders each plan on Linen and on NNX, which
must agree, and compares it with the file; a changed rule (logical_axis_rules,
a layer's logical axes, the optimizer's state) fails naming every array whose
row changed, so a change to the plan shows up in review as a diff of these
files.

To regenerate them on purpose (a new preset, a new mesh, an intended rules
change), then review `git diff tests/goldens/shardings`:

    MAXBRIDGE_REGEN_GOLDENS=1 .venv/bin/python -m pytest -q tests/test_sharding_goldens.py

A new mesh is one entry of MESHES (its overrides, and which presets it applies
to).
"""

import os
import re
from pathlib import Path

import pytest

import maxbridge as mb
from conftest import LINEN_FLAGS
from maxbridge.training import aot

GOLDENS = Path(__file__).parent / "goldens" / "shardings"
PRESETS = sorted(p.stem for p in (Path(mb.__file__).parent / "configs" / "models").glob("*.yml"))
DEVICES = 8
REGEN = os.environ.get("MAXBRIDGE_REGEN_GOLDENS") == "1"
NNX_FLAGS = {flag: True for flag in LINEN_FLAGS}


def _moe(config: mb.Config) -> bool:
  return config.num_experts > 1


_FEW = ("llama-tiny", "deepseek3-tiny", "llama3.1-70b")

# Other sizes of a family a real-size preset covers on every mesh (same rules, other shapes): fsdp8, fsdp2-expert4.
_OTHER_SIZES = frozenset(
    (
        *("llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3-405b", "llama3.1-405b", "llama3.3-70b"),
        *("gemma-7b", "gemma2-27b", "gemma3-12b", "gemma3-27b", "gpt3-175b", "gpt3-22b", "gpt3-6b", "gpt3-52k"),
        *("mixtral-8x22b", "qwen3-30b-a3b-base", "qwen3-480b-a35b", "olmo3-32b", "olmo3-7b-pt", "llama4-17b-16e"),
        *("qwen3-0.6b", "qwen3-1.7b", "qwen3-1.7b-base", "qwen3-4b", "qwen3-4b-base", "qwen3-4b-thinking-2507"),
        *("qwen3-8b-base", "qwen3-14b", "qwen3-14b-base", "qwen3-32b", "kimi-k2-1t", "qwen2.5-1.5b", "qwen2.5-14b"),
        "glm4.5-air",
        *("deepseek2-16b", "deepseek2-236b"),
        *("deepseek3.2-671b", "llama3-400m", "mixtral-200b", "gemma4-12b"),
        *("qwen3.5-9b", "qwen3.5-27b", "qwen3.5-35b-a3b"),
    )
)


def _every_mesh(config: mb.Config) -> bool:
  return config.model_name not in _OTHER_SIZES


# name -> (the mesh's overrides, which presets it applies to, judged on the preset's config). A plan the config
# refuses (a pipeline over too few layers, a split that does not divide) is kept as the error it raises.
MESHES = {
    "fsdp8": ({"ici_fsdp_parallelism": 8}, lambda config: True),
    "fsdp4-tensor2": ({"ici_fsdp_parallelism": 4, "ici_tensor_parallelism": 2}, _every_mesh),
    "fsdp2-expert4": ({"ici_fsdp_parallelism": 2, "ici_expert_parallelism": 4}, _moe),
    "stage2-fsdp4": ({"ici_pipeline_parallelism": 2, "ici_fsdp_parallelism": 4}, _every_mesh),
    # ZeRO-1 and context parallelism change few rules: a dense, an MLA and a real-size preset show them.
    "data2-fsdp4-zero1": (
        {"ici_data_parallelism": 2, "ici_fsdp_parallelism": 4, "shard_optimizer_over_data": True},
        lambda config: config.model_name in _FEW,
    ),
    "context2-fsdp4": (
        {"ici_context_parallelism": 2, "ici_fsdp_parallelism": 4},
        lambda config: config.model_name in _FEW,
    ),
}


def _cases() -> list[tuple[str, str]]:
  cases = []
  for preset in PRESETS:
    config = mb.load_config(preset)
    cases += [(preset, mesh) for mesh, (_, applies) in MESHES.items() if applies(config)]
  return cases


CASES = _cases()


def golden_path(preset: str, mesh: str) -> Path:
  return GOLDENS / f"{preset}.{mesh}.txt"


def render(preset: str, mesh: str, flags: dict, **changes) -> str:
  """The plan of `preset` on `mesh` with backend `flags`: the table `maxbridge shardings` prints, plus a newline.

  `changes` replace config fields after loading (a test's way to change a rule in memory).
  """
  try:
    config = mb.load_config(preset, **MESHES[mesh][0], **flags)
    if changes:
      config = config.replace(**changes)
    return aot.sharding_table(config, DEVICES) + "\n"
  except mb.ConfigError as error:  # a refused plan (too few layers to split, an array that does not divide) too
    return f"refused: {error}\n"


def _columns(line: str) -> tuple[str, ...]:
  # Columns are two or more spaces apart; comparing columns, a wider neighbour never shows as a change.
  return tuple(re.split(r"\s{2,}", line.strip()))


def _keyed(text: str) -> dict[str, tuple[str, ...]]:
  """{row key: columns}: an array's row by its path; "mesh: ...", "refused: ..." and the totals by their label."""
  keyed = {}
  for line in text.splitlines():
    label, colon, rest = line.partition(": ")
    if colon and "  " not in label:
      keyed[label] = (label, rest)
    else:
      columns = _columns(line)
      keyed[columns[0]] = columns
  return keyed


def differences(expected: str, actual: str) -> list[str]:
  """One line per array (or mesh/total line) whose row differs between two plans, naming its path."""
  want, got = _keyed(expected), _keyed(actual)
  lines = []
  for key in [*want, *(k for k in got if k not in want)]:
    if key not in got:
      lines.append(f"  {key}: gone (was {'  '.join(want[key][1:])})")
    elif key not in want:
      lines.append(f"  {key}: new ({'  '.join(got[key][1:])})")
    elif want[key] != got[key]:
      changed = [f"{w} -> {g}" for w, g in zip(want[key], got[key]) if w != g]
      lines.append(f"  {key}: {'; '.join(changed)}")
  return lines


def check_against_golden(path: Path, plan: str) -> None:
  """Passes if `plan` is the golden file's text; else fails naming each array whose row changed."""
  if not path.exists():
    raise AssertionError(f"no golden {path.name}: regenerate with MAXBRIDGE_REGEN_GOLDENS=1 pytest {Path(__file__).name}")
  golden = path.read_text()
  if plan == golden:
    return
  changed = differences(golden, plan) or ["  (only the layout of the table changed)"]
  raise AssertionError(
      f"the sharding plan differs from {path.relative_to(Path(__file__).parent)} in {len(changed)} rows:\n"
      + "\n".join(changed)
      + f"\nIf intended: MAXBRIDGE_REGEN_GOLDENS=1 pytest {Path(__file__).name}, and review the diff."
  )


@pytest.mark.parametrize("preset,mesh", CASES, ids=[f"{p}.{m}" for p, m in CASES])
def test_plan_matches_its_golden_on_both_backends(preset, mesh):
  linen = render(preset, mesh, LINEN_FLAGS)
  nnx = render(preset, mesh, NNX_FLAGS)
  assert nnx == linen, "the NNX plan differs from the Linen plan:\n" + "\n".join(differences(linen, nnx))
  path = golden_path(preset, mesh)
  if REGEN:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != linen:
      path.write_text(linen)
  check_against_golden(path, linen)


def test_every_golden_file_is_a_case():
  expected = {golden_path(preset, mesh).name for preset, mesh in CASES}
  stale = sorted(p.name for p in GOLDENS.glob("*.txt") if p.name not in expected)
  if REGEN:
    for name in stale:
      (GOLDENS / name).unlink()
    stale = []
  assert not stale, f"golden files of no preset x mesh in MESHES (a preset or mesh removed?): {stale}"


def test_a_changed_rule_fails_naming_the_parameter_and_its_optimizer_state():
  preset, mesh = "llama-tiny", "fsdp4-tensor2"
  config = mb.load_config(preset, **MESHES[mesh][0])
  # One rule changed in memory: "mlp" replicated instead of split over "tensor".
  rules = tuple((name, () if name == "mlp" else axes) for name, axes in config.logical_axis_rules)
  plan = render(preset, mesh, NNX_FLAGS, logical_axis_rules=rules)
  with pytest.raises(AssertionError) as failure:
    check_against_golden(golden_path(preset, mesh), plan)
  message = str(failure.value)
  # The kernel (embed, layers, mlp) loses its "tensor" split: twice the bytes on each device.
  for path in ("decoder/layers/mlp/wi_0/kernel", "opt_state/0/mu/params/decoder/layers/mlp/wi_0/kernel"):
    assert re.search(
        rf"\n  {path}: P\(\('fsdp', 'context'\), (\S+), 'tensor'\) -> P\(\('fsdp', 'context'\), \1, None\); 8,192 -> 16,384\n",
        message,
    ), message
  assert re.search(r"\n  parameters: [\d,]+ bytes \(\S+ MiB\) per device -> ", message), message
  # Arrays without an "mlp" axis are not named.
  assert "self_attention/query/kernel" not in message, message
