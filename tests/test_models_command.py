"""`fastforward models`: every name that loads without a path, with its kind, its base, the decoder it
decodes with by default and what it is; plain aligned text or JSON, without importing torch."""

import json
import subprocess
import sys

from fastforward.cli import main
from fastforward.shipped import PRESETS, adapter_names, checkpoint_names


def test_the_table_lists_every_name_aligned_with_its_default_decoder(capsys):
    assert main(["models"]) == 0
    header, *lines = capsys.readouterr().out.splitlines()
    assert header.split() == ["NAME", "KIND", "BASE", "DECODER", "DESCRIPTION"]
    rows = {line.split()[0]: line for line in lines}
    assert list(rows) == [*PRESETS, *adapter_names(), *checkpoint_names()]
    column = header.index("DECODER")
    assert rows["smollm2-135m-jf-arithmetic"][column:].startswith("jacobi --block-size 8  ")
    assert rows["smollm2-135m"][column:].startswith("lookup (no decoding.json)  ")  # a preset: generate's default
    assert rows["demo-sbd"][column:].startswith("sbd-verified --block-size 16 --gamma inf  ")


def test_json_gives_each_field(capsys):
    assert main(["models", "--json"]) == 0
    models = {m["name"]: m for m in json.loads(capsys.readouterr().out)}
    jf = models["smollm2-135m-jf-arithmetic"]
    assert (jf["kind"], jf["base"], jf["decoder"], jf["options"]) == (
        "adapter",
        "smollm2-135m",
        "jacobi",
        {"block_size": 8},
    )
    assert jf["decoding_json"] and "jacobi-8 67.9" in jf["measured"] and "arithmetic" in jf["description"]
    assert (models["smollm2-135m"]["decoder"], models["smollm2-135m"]["decoding_json"]) == ("lookup", False)
    assert models["demo-jf"]["base"] == "demo-ntp" and models["demo-ntp"]["base"].startswith("pretrain")
    assert all(m["description"] for m in models.values())


def test_it_imports_no_torch():
    code = (
        "import sys\nfrom fastforward.cli import main\nmain(['models'])\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.splitlines()[-1] == "[]"
