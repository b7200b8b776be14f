"""The interop layer: checkpoints a user holds, in every format we read or write.

Hugging Face folders (`hf`), any checkpoint as a model (`pretrained`: ours,
MaxText's, a LoRA run, a Hugging Face folder), `maxbridge lora-merge`
(`lora_merge`) and `maxbridge quantize` (`quantize`). The layout converters are
the top-level `converters` package, beside this one.
"""
