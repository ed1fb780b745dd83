"""Loading a compiled artifact and running it (the counterpart of MLC-LLM's serve/model.h)."""

from .model import Model

__all__ = ["Model"]
