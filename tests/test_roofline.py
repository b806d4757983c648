"""Roofline model (SBD paper Tables 3 and 4 to the printed digits), measured block cost, and the CLI."""

import json

import pytest

from fastforward.cli import main
from fastforward.evaluation import roofline
from fastforward.model.tiny import tiny_model

# (batch, KV length, k) -> Table 3 as printed in the paper.
TABLE_3 = {
    (1, 16, 16): 1.004,
    (1, 2**22, 64): 1.029,
    (4, 2**20, 64): 1.074,
    (8, 2**22, 64): 1.904,
    (16, 16, 32): 1.899,
    (16, 16, 64): 3.799,
    (16, 2**22, 64): 3.422,
}
# (NFE speedup, batch, KV length, k) -> Table 4 as printed in the paper.
TABLE_4 = {
    (2, 1, 16, 8): 1.996,
    (2, 8, 16, 64): 1.019,
    (4, 8, 16, 64): 1.978,
    (4, 4, 2**22, 64): 3.425,
    (8, 4, 2**22, 64): 6.534,
    (8, 8, 2**20, 32): 6.300,
}


@pytest.mark.parametrize(("cell", "printed"), TABLE_3.items())
def test_slowdown_matches_table_3(cell, printed):
    batch, kv, k = cell
    assert round(roofline.slowdown(k, kv, batch), 3) == printed
    (table,) = roofline.slowdown_table(batches=[batch])
    assert round(table.at(kv, k), 3) == printed


@pytest.mark.parametrize(("cell", "printed"), TABLE_4.items())
def test_speedup_matches_table_4(cell, printed):
    nfe, batch, kv, k = cell
    (table,) = roofline.speedup_table(nfe_speedups=[nfe], batches=[batch])
    assert round(table.at(kv, k), 3) == printed


def test_layer_count_cancels_and_quirks_are_optional():
    one, many = roofline.Transformer(layers=1), roofline.Transformer(layers=80)
    assert roofline.block_time(16, 4096, 8, tf=many) == pytest.approx(80 * roofline.block_time(16, 4096, 8, tf=one))
    assert roofline.slowdown(16, 4096, 8, tf=one) == pytest.approx(roofline.slowdown(16, 4096, 8, tf=many))
    fixed = roofline.Transformer(paper_quirks=False)
    assert roofline.slowdown(1, 4096, 8, tf=fixed) == 1.0
    # Real FFN widths make the weights far smaller, so the block forward turns compute bound sooner.
    assert roofline.slowdown(64, 16, 8, tf=fixed) > roofline.slowdown(64, 16, 8)


def test_wallclock_speedup_of_free_blocks_is_the_nfe_speedup():
    flat = {1: 1.0, 8: 1.0, 16: 1.0}
    assert roofline.wallclock_speedup(flat, 8, 4) == pytest.approx(4.0)
    assert roofline.wallclock_speedup(lambda k: float(k), 8, 2) == pytest.approx(8 / (16 + 3 * 8))
    with pytest.raises(ValueError):
        roofline.wallclock_speedup(flat, 8, 16)


def test_measure_block_cost_on_tiny_model_keeps_the_cache():
    model = tiny_model()
    cache = model.new_cache()
    cost = roofline.measure_block_cost(model, [2, 4], cache_len=24, repeats=2, warmup=1, cache=cache)
    assert sorted(cost.ratios) == [1, 2, 4]
    assert cost.ratios[1] == 1.0
    assert all(t > 0 for t in cost.times.values())
    assert cache.get_seq_length() == 24
    assert set(cost.speedups([2])[2]) == {2}  # k=2 needs time(4): measured
    with pytest.raises(ValueError):
        roofline.measure_block_cost(model, [2], cache_len=8, repeats=1, cache=cache)  # not empty
    causal = roofline.measure_block_cost(model, [2], cache_len=8, repeats=1, warmup=0, dense_mask=False)
    assert sorted(causal.ratios) == [1, 2] and causal.layout == "causal block"


def test_cli_prints_tables_and_writes_json(tmp_path, capsys):
    out = tmp_path / "roofline.json"
    assert main(["roofline", "--batch", "8", "16", "--kv", "16", "4194304", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Table 3" in text and "Table 4" in text
    assert "3.799" in text and "3.422" in text and "1.978" in text
    record = json.loads(out.read_text())
    assert len(record["slowdown"]) == 2 and len(record["speedup"]) == 6
    assert record["hardware"]["peak_flops"] == 1978e12


def test_cli_hardware_flags_and_bad_input(capsys):
    assert main(["roofline", "--table", "3", "--batch", "1", "--kv", "16", "--bandwidth", "1e9"]) == 0
    assert "custom hardware" in capsys.readouterr().out
    assert main(["roofline", "--kv", "-1"]) == 2
    assert "error" in capsys.readouterr().err


def test_cli_measure_on_a_saved_tiny_model(tmp_path, capsys):
    tiny_model().save(tmp_path / "tiny")
    argv = ["roofline", "--table", "none", "--measure", "--model", str(tmp_path / "tiny"), "--dtype", "float32"]
    argv += [
        "--cache-len",
        "16",
        "--measure-blocks",
        "1",
        "2",
        "4",
        "--repeats",
        "2",
        "--json",
        str(tmp_path / "m.json"),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "time(k)/t(1)" in text and "Eq. 16" in text
    measured = json.loads((tmp_path / "m.json").read_text())["measured"]
    assert measured["ratios"]["1"] == 1.0 and measured["cache_len"] == 16
    assert measured["layout"] == "SBD step" and "(SBD steps)" in text
    assert main([*argv, "--causal"]) == 0
    assert "(causal blocks)" in capsys.readouterr().out
    assert json.loads((tmp_path / "m.json").read_text())["measured"]["layout"] == "causal block"
