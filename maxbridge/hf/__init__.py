"""Hugging Face interchange: config.json <-> Config, safetensors <-> the canonical tree.

    mb.from_pretrained("path/to/hf-or-checkpoint", backend="nnx")   # -> mb.Model
    hf.import_hf(hf_dir, dst, scan_layers=True, dtype="bfloat16")  # params-only checkpoint
    hf.export_hf(checkpoint, dst_dir)                               # config.json + model.safetensors

Supported: llama (llama2), mistral, qwen3, mixtral, gpt2 (our gpt3 block),
deepseek_v3 (our deepseek block). The mapping of each is data
(`families.FAMILIES`: Hugging Face name pattern -> canonical path + transform),
applied by one loop each way (`mapping.to_hf_tensors`, `mapping.from_hf_tensors`).
Import checks names and shapes before touching a value: a tensor no rule
claims, or one the model needs but the folder lacks, is an error naming it.
"""

from maxbridge.hf.families import FAMILIES, Family, HFError, Rule, family_for_config, family_for_model_type
from maxbridge.hf.folders import (
    abstract_params,
    export_hf,
    from_pretrained,
    import_hf,
    is_hf_folder,
    load_checkpoint,
    load_hf,
    load_pretrained,
    open_hf_tensors,
    read_hf_config,
    save_hf,
    tokenizer_folder,
    write_atomically,
)
from maxbridge.hf.mapping import (
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
    "export_hf",
    "family_for_config",
    "family_for_model_type",
    "from_hf_tensors",
    "from_pretrained",
    "import_hf",
    "is_hf_folder",
    "load_checkpoint",
    "load_hf",
    "load_pretrained",
    "open_hf_tensors",
    "read_hf_config",
    "save_hf",
    "to_hf_tensors",
    "tokenizer_folder",
    "write_atomically",
]
