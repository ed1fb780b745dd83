"""Tensor sources (safetensors; GGUF later) and the declarative HF-name -> param-name mapping."""
