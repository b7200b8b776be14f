"""The serving layer: the engine (prefill, insert, generate over decode slots with a KV cache)."""
