"""What ships inside the package beside the weights (the adapters in fastforward/presets, the demo's
checkpoints): its decoding defaults hold against the decoder registry, and its JSON says nothing of the
machine it was made on."""

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fastforward.decoding.model_defaults import FILE, read_decoding_defaults
from fastforward.shipped import SHIPPED_ADAPTERS, SHIPPED_CHECKPOINTS

ROOT = Path(__file__).resolve().parents[1]
JSON = sorted(path for root in (SHIPPED_ADAPTERS, SHIPPED_CHECKPOINTS) for path in root.rglob("*.json"))
ABSOLUTE = re.compile(r"(?<![\w.])/(?:[\w.-]+/)+")  # /work/main/..., /home/..., /tmp/...
RUNS = re.compile(r"(?<![\w-])runs/")  # a training folder under the checkout's runs/
DEFAULTS = sorted(path for root in (SHIPPED_ADAPTERS, SHIPPED_CHECKPOINTS) for path in root.glob(f"*/{FILE}"))


@pytest.mark.parametrize("path", DEFAULTS, ids=[str(p.relative_to(ROOT)) for p in DEFAULTS])
def test_every_shipped_decoding_json_holds_and_says_what_chose_it(path):
    defaults = read_decoding_defaults(path.parent)  # checked: decoder, options, bounds
    assert defaults.measured and "\n" not in defaults.measured


def test_the_models_that_measured_a_faster_lossless_decoder_carry_it():
    """The arithmetic adapter's figures chose jacobi at block 8, the demo's chose jacobi for demo-jf and
    sbd-verified for demo-sbd; the others measured no lossless decoder against one another."""
    assert {p.parent.name: read_decoding_defaults(p.parent).describe() for p in DEFAULTS} == {
        "smollm2-135m-jf-arithmetic": "jacobi --block-size 8",
        "jf": "jacobi --block-size 16",
        "sbd": "sbd-verified --block-size 16 --gamma inf",
    }


def strings(value: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """Every (key, text) of a JSON value: its keys and string values, each with the key it is under."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield k, k
            yield from strings(v, k)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v, key)
    elif isinstance(value, str):
        yield key, value


@pytest.mark.parametrize("path", JSON, ids=[str(p.relative_to(ROOT)) for p in JSON])
def test_shipped_json_names_no_path_of_the_machine_that_made_it(path):
    """A model a shipped file was made from goes by its name (a preset) or its role (`sft (a training
    folder)`), never by where it lay. A recorded command line may name its own output folders under runs/,
    relative to where it is rerun (`--work runs/...`), but no absolute path."""
    for key, text in strings(json.loads(path.read_text())):
        assert not ABSOLUTE.search(text), f"{key}: {text}"
        assert key == "command" or not RUNS.search(text), f"{key}: {text}"
