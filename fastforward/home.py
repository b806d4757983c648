"""$FASTFORWARD_HOME: where fastforward keeps what it makes once (converted presets, quantized weights,
compiled steps, the local engines). Its own module, free of torch, so that a command as light as the
engine's client finds it without the seconds of importing a model library."""

from __future__ import annotations

import os
from pathlib import Path


def fastforward_home() -> Path:
    """$FASTFORWARD_HOME, default ~/.cache/fastforward."""
    return Path(os.environ.get("FASTFORWARD_HOME", Path.home() / ".cache" / "fastforward"))
