"""Writing a model directory so that a reader never sees half of one, and transformers' progress bars kept
out of logs."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging


def save_atomically(hf: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Write weights (safetensors), config and tokenizer into a hidden directory beside `directory`, then
    rename it into place: a crash never leaves a half-written model at `directory`."""
    directory = directory.resolve()
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        with quiet_progress():
            hf.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if directory.exists():
            old = directory.with_name(f".{directory.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(directory, old)
            os.replace(tmp, directory)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Hide transformers' progress bars ("Loading weights", "Writing model shards") for a block: for a
    local model they flash by in under a second, and where stderr is a log they fill it with redraws."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()
