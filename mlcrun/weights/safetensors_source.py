"""Lazy, validated reading of Hugging Face safetensors checkpoints (one file or sharded).

We parse the safetensors header ourselves and memory-map the data so that a 10 GB checkpoint
is never loaded whole, bf16 works without torch, and a truncated file is reported by name
before any conversion starts.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from ..errors import MlcrunError

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,  # widened to float32 on read
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsSource:
    """All tensors of a checkpoint folder, by HF name, read on demand."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._index: dict[str, tuple[Path, dict]] = {}
        for file in self._files():
            for name, info in _read_header(file).items():
                self._index[name] = (file, info)

    def _files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError) as err:
                raise MlcrunError(f"{index}: not a valid safetensors index ({err})") from None
            files = sorted({self.folder / f for f in weight_map.values()})
            for file in files:
                if not file.exists():
                    raise MlcrunError(f"{index} names {file.name}, which is missing")
            return files
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise MlcrunError(f"{self.folder}: no *.safetensors weights found")
        return files

    def names(self) -> list[str]:
        return sorted(self._index)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._index[name][1]["shape"])

    def dtype(self, name: str) -> str:
        """The stored dtype name (F32, F16, BF16, ...)."""
        return self._index[name][1]["dtype"]

    def get(self, name: str) -> np.ndarray:
        """The tensor as a numpy array (float tensors as float32 or float16)."""
        file, info = self._index[name]
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        data = np.memmap(
            file, dtype=np.uint8, mode="r", offset=info["_base"] + begin, shape=(end - begin,)
        )
        array = np.frombuffer(data, dtype=dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            return (array.astype(np.uint32) << 16).view(np.float32)
        return array


def _read_header(file: Path) -> dict[str, dict]:
    size = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise MlcrunError(f"{file}: truncated safetensors file (no header)")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > size - 8:
            raise MlcrunError(f"{file}: truncated or corrupt safetensors file (bad header length)")
        try:
            header = json.loads(f.read(header_len))
        except ValueError:
            raise MlcrunError(f"{file}: corrupt safetensors header") from None
    header.pop("__metadata__", None)
    base = 8 + header_len
    for name, info in header.items():
        if info.get("dtype") not in _DTYPES:
            raise MlcrunError(f"{file}: tensor {name!r} has unsupported dtype {info.get('dtype')}")
        begin, end = info["data_offsets"]
        expected = (
            int(np.prod(info["shape"], dtype=np.int64)) * np.dtype(_DTYPES[info["dtype"]]).itemsize
        )
        if end - begin != expected:
            raise MlcrunError(f"{file}: tensor {name!r} size does not match its shape")
        if base + end > size:
            raise MlcrunError(
                f"{file}: truncated safetensors file (tensor {name!r} ends at byte {base + end}, "
                f"file has {size})"
            )
        info["_base"] = base
    return header
