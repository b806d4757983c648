"""The extension guide's code runs as written (it uses only the tiny model)."""

import re
from pathlib import Path

from fastforward.decoding.decoders import registry
from fastforward.training.objectives import OBJECTIVES

DOC = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def test_extending_guide_examples_run(capsys, scratch_registries):
    # the guide registers a sketch decoder and objective: `scratch_registries` keeps them from other tests
    code = "\n".join(re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S))
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_extending"})
    out = capsys.readouterr().out
    assert "torch.Size([1, 4," in out and "{'name': 'ntp-sketch', 'weight': 0.5} [" in out
    assert "greedy-sketch" in registry.DECODERS and "ntp-sketch" in OBJECTIVES
