"""What a warm engine serves, and its key: free of torch, so that `generate`'s client finds the one
engine that serves its command line without importing a model library.

An engine serves one model (and adapter) at one precision on one device: the fields that change the
tokens it answers. `--compile` and `--cuda-graphs` change only how fast, so they are not part of it.
Both sides compute the key from the same `Serves`: the engine from its own flags at start, the client
from `generate`'s (`fastforward.cli.warm.flags`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


def model_name(name_or_path: str | None, cwd: str) -> str | None:
    """A --model or --adapter as engines compare it: a path that exists, absolute; else the name (a preset)."""
    if name_or_path is None:
        return None
    path = Path(cwd, name_or_path)
    return str(path.resolve()) if path.exists() else name_or_path


@dataclass(frozen=True)
class Serves:
    """The model, adapter, token-changing precision fields and device of an engine (checked when made)."""

    model: str
    dtype: str
    quantize: str
    exact: bool
    attention: str
    adapter: str | None
    device: str

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            wanted = bool if f.name == "exact" else str
            if not isinstance(value, wanted) and not (f.name == "adapter" and value is None):
                raise ValueError(f"what an engine serves: {f.name} must be a {wanted.__name__}, got {value!r}")

    @classmethod
    def of(cls, args: Any, cwd: str) -> Serves:
        """What a command's parsed flags ask an engine to serve, its precision flags resolved; relative
        paths lead from `cwd`."""
        return cls(
            model=model_name(args.model, cwd),
            dtype=args.dtype,
            quantize=args.quantize,
            exact=args.exact,
            attention=args.attention,
            adapter=model_name(args.adapter, cwd),
            device=args.device or "cpu",
        )

    @classmethod
    def from_json(cls, data: Any) -> Serves:
        if not isinstance(data, dict) or set(data) != {f.name for f in fields(cls)}:
            raise ValueError(f"what an engine serves: not an object of {', '.join(f.name for f in fields(cls))}")
        return cls(**data)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def key(self) -> str:
        """The engine's folder name: a digest of every field."""
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:12]

    def describe(self) -> str:
        """One line, e.g. `smollm2-135m (float32, int4, exact, sdpa) on cpu`."""
        exact = "exact" if self.exact else "not exact"
        adapter = f", adapter {self.adapter}" if self.adapter else ""
        return f"{self.model} ({self.dtype}, {self.quantize}, {exact}, {self.attention}{adapter}) on {self.device}"
