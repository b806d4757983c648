"""What ships inside the package beside the weights (the adapters in fastforward/presets, the demo's
checkpoints): its decoding defaults hold against the decoder registry."""

from pathlib import Path

import pytest

from fastforward.decoding.model_defaults import FILE, read_decoding_defaults
from fastforward.shipped import SHIPPED_ADAPTERS, SHIPPED_CHECKPOINTS

ROOT = Path(__file__).resolve().parents[1]
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
