"""The models layer: a config made into a model, on either backend (`dispatch`, the one reader of the flags).

`mb.Model` (`model`), cached decoding below the engine (`decoding`), and the
hooks layers take: quantization's `dot_general` (`quantization`) and the LoRA
adapter math (`lora`). Builds on `linen_models`, `nnx_models`, `ops` and `core`.
"""
