"""Work made once per model and setting, kept under $FASTFORWARD_HOME: quantized weights
(`quantized/`) and compiled decoding steps (`compiled/`).

Quantizing SmolLM2-135M to int4 takes seconds, and to int8 longer (its smoothing runs calibration
forwards); compiling its steps takes a minute. Every `generate` used to pay them again. The first load
at a setting writes the result (as `torch.save` pickles it) and later loads read it back in a fraction
of the time. An entry is keyed by everything it depends on: the SHA-256 of the source weights and
configuration files, the setting (dtype, scheme, `--exact`, fusion...), the int4 kernel, the code that
made it and the torch and transformers versions; so a stale entry is never found.
Each entry carries the CRC-32 of its own bytes, checked before it is read: a corrupt entry is
reported in one line, removed and made again, never loaded. Only files this module wrote are read.
An entry is read memory-mapped (its tensors are the page cache's until written to): with the
CRC-32, cheaper at load than a SHA-256 and a copying `torch.load`
(docs/notes/2026-11-28-cpu-speed-and-start-up.md, "From a fresh process").
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
import sys
import tempfile
import zlib
from pathlib import Path
from typing import Any

import torch
import transformers

from fastforward.cpu import native, w4a8

PACKAGE = Path(__file__).resolve().parents[1]
QUANTIZATION_CODE = (PACKAGE / "cpu",)  # the code an entry depends on: its files are part of the key
SOURCE_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json")  # weights and configuration: all the entry holds
ENTRY_FORMAT = "crc32-mmap"  # part of the key: entries checked another way are other entries
CHECK = ".check"  # an entry's checksum file
LEGACY_CHECK = ".sha256"  # the checksum files of entries made before ENTRY_FORMAT: removed with them


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _checksum(path: Path) -> str:
    """The CRC-32 of a file's bytes (read through a memory map: no copy), as the entry's check file holds it."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return "crc32:00000000"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            return f"crc32:{zlib.crc32(mapped):08x}"


class Store:
    """The entry of one model at one setting in one folder of the store (`what`: what a load that
    finds none does, for the messages)."""

    def __init__(
        self,
        root: Path,
        folder: str,
        source: Path,
        code: tuple[Path, ...] = QUANTIZATION_CODE,
        what: str = "quantizing again",
        **setting: object,
    ):
        self.directory = root / folder
        self.index = root / "sources.json"
        self.source, self.code, self.what = source, code, what
        self.setting = {key: str(value) for key, value in sorted(setting.items())}

    # ---- the key ------------------------------------------------------------------------------
    def _source_digest(self) -> str:
        """SHA-256 of the source's weight and configuration files (a pickled model holds its config:
        two models with the same weights and another context length are two entries), remembered per
        (path, size, mtime) so that a model is read through once, not at every load."""
        if self.source.is_file():
            files = [self.source]
        else:
            files = sorted(p for p in self.source.iterdir() if p.is_file() and p.suffix in SOURCE_SUFFIXES)
        stamp = json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files])
        index = _read_json(self.index)
        index = index if isinstance(index, dict) else {}
        if stamp not in index:
            index[stamp] = hashlib.sha256("".join(_digest(p) for p in files).encode()).hexdigest()
            _write_atomically(self.index, json.dumps(index, indent=1).encode())
        return index[stamp]

    def _key(self) -> str:
        return self._parts[0]

    @functools.cached_property
    def _parts(self) -> tuple[str, dict[str, str]]:
        """The entry's key, and the part of it that names the model and setting (an entry made by
        older code or an older torch for the same model and setting replaces that one)."""
        code = hashlib.sha256()
        for path in sorted(p for folder in self.code for p in folder.rglob("*")):
            if path.is_file() and path.suffix in (".py", ".cpp", ".h"):
                code.update(path.name.encode() + path.read_bytes())
        int4_kernel = f"native-{native.instruction_set()}" if w4a8.enabled() else "pytorch"
        parts = {
            "source": self._source_digest(),
            **self.setting,
            "int4_kernel": int4_kernel,
            "code": code.hexdigest(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "format": ENTRY_FORMAT,
        }
        key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
        return key, {"source": parts["source"], **self.setting}

    # ---- reading and writing ------------------------------------------------------------------
    def load(self) -> Any:
        """What the entry holds, or None when there is no sound entry (a corrupt one is said and removed)."""
        entry = self.directory / f"{self._key()}.pt"
        checksum = entry.with_suffix(CHECK)
        if not entry.exists():
            return None
        try:
            if not checksum.exists() or checksum.read_text().strip() != _checksum(entry):
                raise ValueError("its checksum does not match")
            return torch.load(entry, weights_only=False, map_location="cpu", mmap=True)
        except Exception as error:  # a truncated or altered file: make it again
            print(f"fastforward: {entry} is unusable ({error}); {self.what}", file=sys.stderr)
            entry.unlink(missing_ok=True)
            checksum.unlink(missing_ok=True)
            return None

    def save(self, value: Any) -> None:
        """Write the entry atomically (checksum last: an entry without one is never read), and remove
        the entries it replaces."""
        key, name = self._parts
        entry = self.directory / f"{key}.pt"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for old in self.directory.glob("*.json"):
                if old.stem != key and _read_json(old) == name:
                    for suffix in (".pt", CHECK, LEGACY_CHECK, ".json"):
                        old.with_suffix(suffix).unlink(missing_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.directory, suffix=".tmp", delete=False) as f:
                torch.save(value, f)
            os.replace(f.name, entry)
            _write_atomically(entry.with_suffix(".json"), json.dumps(name).encode())
            _write_atomically(entry.with_suffix(CHECK), _checksum(entry).encode())
        except OSError as error:  # a full or read-only disk: the next load quantizes again
            print(f"fastforward: could not keep an entry in {self.directory} ({error})", file=sys.stderr)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".tmp", delete=False) as f:
        f.write(data)
    os.replace(f.name, path)
