"""MaxText's model presets under their MaxText names: each loads as `model_name=NAME` and has its published size.

Each preset in maxbridge/configs/models/ named as a file of MaxText's
configs/models/ carries that file's values in our keys. Its abstract model
(shapes only, NNX: the base.yml default; the sharding goldens compare both
backends' trees) must hold the model's published parameter count, to 2%.
MaxText's Gemma tables pad the vocabulary (256128, not 256000) and its
Mixtral 8x22B has v0.3's 32768 tokens; the text models of the multimodal ones
(Gemma 3, Llama 4) are counted without their vision towers.
"""

import math
import re

import jax
import pytest

import maxbridge as mb
from maxbridge import cli
from maxbridge.models import dispatch

# preset -> its published parameter count (where from).
PUBLISHED = {
    "llama2-13b": 13_015_864_320,  # Hugging Face meta-llama/Llama-2-13b-hf's safetensors
    "llama2-70b": 68_976_648_192,  # meta-llama/Llama-2-70b-hf's safetensors
    "llama3-8b": 8_030_261_248,  # meta-llama/Meta-Llama-3-8B's safetensors
    "llama3-70b": 70_553_706_496,  # meta-llama/Meta-Llama-3-70B's safetensors
    "llama3-405b": 405_853_388_800,  # Llama 3.1 405B's safetensors (MaxText's llama3-405b: its shapes, plain RoPE)
    "llama3.1-405b": 405_853_388_800,  # meta-llama/Llama-3.1-405B's safetensors
    "llama3.3-70b": 70_553_706_496,  # meta-llama/Llama-3.3-70B-Instruct's safetensors
    "mistral-7b": 7_241_732_096,  # mistralai/Mistral-7B-v0.1's safetensors
    "mixtral-8x7b": 46_702_792_704,  # mistralai/Mixtral-8x7B-v0.1's safetensors
    "mixtral-8x22b": 141_000_000_000,  # Mistral's card: 141B
    "gemma-7b": 8_537_680_896,  # google/gemma-7b's safetensors (256000 tokens)
    "gemma2-27b": 27_227_128_320,  # google/gemma-2-27b's safetensors (256000 tokens)
    "gemma3-12b": 11_766_000_000,  # google/gemma-3-12b-pt: 12.19B, less its 0.42B SigLIP tower and projector
    "gemma3-27b": 27_010_000_000,  # google/gemma-3-27b-pt: 27.43B, less its 0.42B SigLIP tower and projector
    "gpt3-175b": 175_000_000_000,  # the GPT-3 paper (Brown et al. 2020), table 2.1
    "gpt3-22b": 22_000_000_000,  # no published model: the name's 22B
    # No published model, and the name rounds up: the GPT-3 paper's count, 12 L d^2 + (vocab + positions) d.
    "gpt3-6b": 12 * 48 * 3072**2 + (32768 + 16384) * 3072,
    "gpt3-52k": 52_000,  # no published model: the name's 52k
    "llama4-17b-16e": 109_000_000_000,  # Meta's card for Llama 4 Scout: 109B total (its vision tower ~0.9B of it)
    "llama4-17b-128e": 400_000_000_000,  # Meta's card for Llama 4 Maverick: 400B total
    "olmo3-32b": 32_233_522_176,  # allenai/Olmo-3-1125-32B's safetensors
    "olmo3-7b-pt": 7_298_011_136,  # allenai/Olmo-3-1025-7B's safetensors
    "qwen2.5-1.5b": 1_540_000_000,  # Qwen's card: 1.54B (its head tied to the embedding)
    "qwen2.5-7b": 7_610_000_000,  # Qwen's card: 7.61B
    "qwen2.5-14b": 14_700_000_000,  # Qwen's card: 14.7B
    "qwen3-0.6b": 600_000_000,  # Qwen's card: 0.6B
    "qwen3-1.7b": 1_700_000_000,  # Qwen's card: 1.7B
    "qwen3-1.7b-base": 1_700_000_000,  # Qwen's card: 1.7B
    "qwen3-4b": 4_000_000_000,  # Qwen's card: 4.0B
    "qwen3-4b-base": 4_000_000_000,  # Qwen's card: 4.0B
    "qwen3-4b-thinking-2507": 4_000_000_000,  # Qwen's card: 4.0B
    "qwen3-8b": 8_200_000_000,  # Qwen's card: 8.2B
    "qwen3-8b-base": 8_200_000_000,  # Qwen's card: 8.2B
    "qwen3-14b": 14_800_000_000,  # Qwen's card: 14.8B
    "qwen3-14b-base": 14_800_000_000,  # Qwen's card: 14.8B
    "qwen3-32b": 32_800_000_000,  # Qwen's card: 32.8B
    "qwen3-30b-a3b-base": 30_500_000_000,  # Qwen's card: 30.5B
    "qwen3-480b-a35b": 480_000_000_000,  # Qwen3-Coder-480B-A35B's card: 480B
    # deepseek-ai/DeepSeek-V3's safetensors less its multi-token prediction module (685B with it: 671B of main
    # model, 14B of MTP, its README); MaxText's file, as the preset, has no MTP module.
    "deepseek3-671b": 671_026_419_200,
    "deepseek2-16b": 15_700_000_000,  # deepseek-ai/DeepSeek-V2-Lite's card: 15.7B total
    "deepseek2-236b": 236_000_000_000,  # deepseek-ai/DeepSeek-V2's card: 236B total
    # zai-org's cards: GLM-4.5-Air 106B and GLM-4.5 355B total (their safetensors also hold an MTP layer, which
    # the presets, as Glm4MoeForCausalLM, leave out).
    "glm4.5-air": 106_000_000_000,
    "glm4.5": 355_000_000_000,
    "kimi-k2-1t": 1_040_000_000_000,  # the Kimi K2 technical report: 1.04T total
    # deepseek-ai/DeepSeek-V3.2-Exp's card: 685B with its 14B MTP module, which the preset (as deepseek3-671b)
    # leaves out; its indexers add 0.85B to DeepSeek-V3's 671B.
    "deepseek3.2-671b": 671_000_000_000,
    "mixtral-200b": 200_000_000_000,  # no published model: the name's 200B
    "gemma4-12b": 12_000_000_000,  # the name's 12B (MaxText's file: gemma4-31b's text tower, smaller)
    # Qwen3.5 by the names' totals (Qwen/Qwen3.5-*), whose vision towers and MTP layers the text models leave out.
    "qwen3.5-9b": 9_000_000_000,
    "qwen3.5-27b": 27_000_000_000,
    "qwen3.5-35b-a3b": 35_000_000_000,
    "qwen3.5-397b-a17b": 397_000_000_000,
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_a_maxtext_preset_loads_by_its_maxtext_name_with_its_published_size(preset):
  config = mb.load_config(model_name=preset)
  assert config.model_name == preset
  params = dispatch.abstract_model(config).abstract_params()  # shapes only: no memory
  count = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
  assert count == pytest.approx(PUBLISHED[preset], rel=0.02), f"{preset}: {count:,} parameters"


def test_deepseek3_671b_trains_on_256_chips_of_95_gib_with_experts_split(capsys):
  mesh = ["ici_fsdp_parallelism=16", "ici_expert_parallelism=16"]
  assert cli.main(["shardings", "--devices", "256", "deepseek3-671b", *mesh]) == 0
  out = capsys.readouterr().out
  per_device = {
      label: int(value.replace(",", ""))
      for label, value in re.findall(r"^(parameters|optimizer state|total): ([\d,]+) bytes", out, re.M)
  }
  # float32 parameters, AdamW's mu and nu: 671B parameters, 8 TB in all, about 40.5 GiB on each chip.
  assert per_device["parameters"] + per_device["optimizer state"] <= per_device["total"] < 95 * 2**30, per_device
  assert per_device["total"] > 671e9 * 12 / 256, per_device  # no less than an even split of 8 TB
