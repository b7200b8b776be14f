"""Hugging Face interchange: config.json <-> Config, safetensors <-> the canonical tree.

    hf.import_hf(hf_dir, dst, scan_layers=True, dtype="bfloat16")  # params-only checkpoint

Supported: llama (llama2), mistral, qwen3, mixtral, gpt2 (our gpt3 block),
deepseek_v3 (our deepseek block). The mapping of each is data
(`families.FAMILIES`: Hugging Face name pattern -> canonical path + transform),
applied by one loop each way (`mapping.to_hf_tensors`, `mapping.from_hf_tensors`).
Reading any checkpoint (and `export_hf`) is `maxbridge.interop.pretrained`'s.
Import checks names and shapes before touching a value: a tensor no rule
claims, or one the model needs but the folder lacks, is an error naming it.
"""

from maxbridge.interop.hf.families import FAMILIES, Family, HFError, Rule, family_for_config, family_for_model_type
from maxbridge.interop.hf.folders import (
    abstract_params,
    import_hf,
    is_hf_folder,
    load_hf,
    open_hf_tensors,
    read_hf_config,
    save_hf,
    write_atomically,
)
from maxbridge.interop.hf.mapping import (
    config_from_hf,
    config_to_hf,
    expected_hf_shapes,
    from_hf_tensors,
    to_hf_tensors,
)

__all__ = [
    "FAMILIES",
    "Family",
    "HFError",
    "Rule",
    "abstract_params",
    "config_from_hf",
    "config_to_hf",
    "expected_hf_shapes",
    "family_for_config",
    "family_for_model_type",
    "from_hf_tensors",
    "import_hf",
    "is_hf_folder",
    "load_hf",
    "open_hf_tensors",
    "read_hf_config",
    "save_hf",
    "to_hf_tensors",
    "write_atomically",
]
