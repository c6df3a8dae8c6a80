"""The model manifest: the tensor names, shapes, dtypes and groups a decoder validates against."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedmq.errors import CodecError


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"  # numpy dtype name of the *decoded* tensor
    group: str = "model"  # e.g. "encoder" / "decoder" for seq2seq (dynamic pulling thresholds per group)

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1


@dataclass(frozen=True)
class Manifest:
    tensors: tuple[TensorSpec, ...]

    @classmethod
    def from_arrays(cls, state: Mapping[str, Any], groups: Mapping[str, str] | None = None) -> Manifest:
        """Build a manifest from a name -> array mapping (numpy arrays or torch tensors)."""
        specs = []
        for name, arr in state.items():
            dtype = str(arr.dtype).replace("torch.", "")
            specs.append(
                TensorSpec(name, tuple(int(s) for s in arr.shape), dtype, (groups or {}).get(name, "model"))
            )
        return cls(tuple(specs))

    def __post_init__(self) -> None:
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError("manifest has duplicate tensor names")

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def spec(self, name: str) -> TensorSpec:
        for t in self.tensors:
            if t.name == name:
                return t
        raise CodecError("unknown-tensor", f"tensor {name!r} is not in the model manifest")

    def groups(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for t in self.tensors:
            out.setdefault(t.group, []).append(t.name)
        return out

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def message_bound(self) -> int:
        """Upper bound of one message carrying the whole model (raw fp32 plus framing), for queue sizing."""
        return self.numel * 4 + (1 << 16)

    def extended(self, extra: Mapping[str, str]) -> Manifest:
        """This manifest and, after it, a tensor for each ``extra`` name shaped like the model tensor it maps
        to (a strategy's tensors beside the model: fedmq.hooks.ClientHook.extra_tensors)."""
        if not extra:
            return self
        more = [
            TensorSpec(name, self.spec(like).shape, self.spec(like).dtype, "strategy")
            for name, like in extra.items()
        ]
        return Manifest((*self.tensors, *more))

    def to_dict(self) -> list[dict]:
        return [
            {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "group": t.group} for t in self.tensors
        ]

    @classmethod
    def from_dict(cls, rows: list[dict]) -> Manifest:
        return cls(
            tuple(TensorSpec(r["name"], tuple(r["shape"]), r["dtype"], r.get("group", "model")) for r in rows)
        )
