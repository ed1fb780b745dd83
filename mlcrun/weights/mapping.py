"""Declarative weight mapping: each of our params names its source tensors and a transform.

Conversion fails, naming the tensor, when a source is missing or has the wrong shape, when a
param is not produced, or when a source tensor is left unused (unless declared unused).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import MlcrunError

Shape = tuple[int, ...]


class TensorSource(Protocol):
    def names(self) -> list[str]: ...
    def __contains__(self, name: str) -> bool: ...
    def shape(self, name: str) -> Shape: ...
    def dtype(self, name: str) -> str: ...  # stored type: F32, F16, BF16, Q4_0, ...
    def get(self, name: str) -> np.ndarray: ...


def concat_rows(*arrays: np.ndarray) -> np.ndarray:
    return np.concatenate(arrays, axis=0)


def identity(array: np.ndarray) -> np.ndarray:
    return array


@dataclass(frozen=True)
class ParamRule:
    """Our param `name` is `transform(*sources)`; `source_shapes` are checked before it runs."""

    name: str
    sources: tuple[str, ...]
    source_shapes: tuple[Shape, ...]
    transform: Callable[..., np.ndarray] = identity


@dataclass(frozen=True)
class WeightMap:
    rules: tuple[ParamRule, ...]
    unused: tuple[str, ...] = field(default=())  # fnmatch patterns of HF tensors we may skip

    def check(self, source: TensorSource, param_names: Sequence[str]) -> None:
        """Coverage and shape checks, before any data is read."""
        produced = {rule.name for rule in self.rules}
        missing_params = [n for n in param_names if n not in produced]
        if missing_params:
            raise MlcrunError(f"no weight mapping produces param {missing_params[0]!r}")
        used: set[str] = set()
        for rule in self.rules:
            for name, shape in zip(rule.sources, rule.source_shapes, strict=True):
                if name not in source:
                    raise MlcrunError(f"weight {name!r} is missing from the checkpoint")
                if tuple(source.shape(name)) != tuple(shape):
                    raise MlcrunError(
                        f"weight {name!r} has shape {list(source.shape(name))}, "
                        f"expected {list(shape)}"
                    )
                used.add(name)
        leftover = [
            n
            for n in source.names()
            if n not in used and not any(fnmatch.fnmatch(n, p) for p in self.unused)
        ]
        if leftover:
            more = f" (and {len(leftover) - 1} more)" if len(leftover) > 1 else ""
            raise MlcrunError(
                f"weight {leftover[0]!r}{more} in the checkpoint is not used by the model"
            )

    def convert(self, source: TensorSource) -> Iterator[tuple[str, np.ndarray]]:
        for rule in self.rules:
            yield rule.name, convert_rule(source, rule)


def convert_rule(source: TensorSource, rule: ParamRule) -> np.ndarray:
    arrays = [source.get(n) for n in rule.sources]
    return np.ascontiguousarray(rule.transform(*arrays))


def is_row_wise(rule: ParamRule) -> bool:
    """Does the rule only stack whole rows of its sources (so it commutes with any per-row
    storage format, such as quantized blocks)?"""
    return rule.transform in (identity, concat_rows)
