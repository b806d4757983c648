"""The native int4 x int8 kernel (fastforward.cpu.w4a8): its bits recomputed in PyTorch, its packing, its fallbacks."""

import functools
import os
import subprocess
import sys

import pytest
import torch

from fastforward.cpu import native, w4a8
from fastforward.cpu import quantize as quantization
from fastforward.cpu.low_rank import LowRank, LowRankLinear, W4A8LowRankLinear
from fastforward.cpu.quantize import Int4Linear, quantize
from fastforward.model.tiny import tiny_model

needs_native = pytest.mark.skipif(not native.available(), reason="needs x86 AVX2 or AVX-512 and a C++ compiler")


def _recomputed(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in PyTorch, in the kernel's order of float operations."""
    rows, width = x.shape
    blocks = x.reshape(rows, -1, w4a8.GROUP)
    d = blocks.abs().amax(-1) / 127
    q = torch.round(blocks * torch.where(d > 0, 1 / d, 0)[..., None]).clamp(-127, 127)
    dsum = d * q.sum(-1)
    # [tiles, groups, 32] -> per output column and group: scale, minimum
    s = scales[..., : w4a8.TILE].transpose(1, 2).reshape(-1, width // w4a8.GROUP).float()
    m = scales[..., w4a8.TILE :].transpose(1, 2).reshape(-1, width // w4a8.GROUP).float()
    dots = torch.einsum("rgi,ngi->rng", q.double(), codes.reshape(len(s), -1, w4a8.GROUP).double()).float()
    y = torch.zeros(rows, len(s))
    for g in range(width // w4a8.GROUP):
        y = y + (dots[..., g] * (s[:, g] * d[:, g, None]) + m[:, g] * dsum[:, g, None])
    return y


@needs_native
@pytest.mark.parametrize(("rows", "width", "out"), [(1, 32, 16), (3, 96, 48), (19, 160, 32), (8, 64, 160)])
def test_kernel_gives_the_bits_of_its_recomputation(rows, width, out):
    # 19 rows take the kernel's 8-, 2- and 1-row paths; every path must give the same bits.
    torch.manual_seed(rows)
    weight, x = torch.randn(out, width) * 0.1, torch.randn(rows, width)
    x[0, :32] = 0  # an all-zero block: scale 0
    packed, scales, codes = w4a8.pack(weight)
    y = torch.ops.fastforward.w4a8_linear(x, packed, scales)
    assert torch.equal(y, _recomputed(x, codes, scales))
    for r in range(rows):
        assert torch.equal(torch.ops.fastforward.w4a8_linear(x[r : r + 1].contiguous(), packed, scales), y[r : r + 1])


@needs_native
def test_layer_takes_any_layout_and_dtype_of_its_input():
    # float32 contiguous input goes to the kernel as is; anything else is converted first
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 32)
    layer = w4a8.W4A8Linear(linear)
    x = torch.randn(2, 3, 64)
    kernel = torch.ops.fastforward.w4a8_linear
    expected = (kernel(x.reshape(6, 64), layer.codes, layer.scales) + linear.bias).reshape(2, 3, 32)
    assert torch.equal(layer(x), expected)
    assert torch.equal(layer(x.transpose(0, 1).contiguous().transpose(0, 1)), expected)  # not contiguous
    half = x.bfloat16()
    rows = half.float().reshape(6, 64)
    y = layer(half)
    assert y.dtype == torch.bfloat16 and y.shape == (2, 3, 32)
    direct = (kernel(rows, layer.codes, layer.scales) + linear.bias).bfloat16()
    assert torch.equal(y, direct.reshape(2, 3, 32))
    # without a bias the layer is the kernel alone: it takes [..., in] in any layout and dtype itself
    bare = w4a8.W4A8Linear(torch.nn.Linear(64, 32, bias=False))
    flat = kernel(x.reshape(6, 64), bare.codes, bare.scales)
    assert torch.equal(bare(x), flat.reshape(2, 3, 32))
    assert torch.equal(bare(x.transpose(0, 1).contiguous().transpose(0, 1)), flat.reshape(2, 3, 32))
    y = bare(half)
    expected = kernel(rows, bare.codes, bare.scales).bfloat16().reshape(2, 3, 32)
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)


@needs_native
@pytest.mark.parametrize("bias", [False, True])
def test_an_output_width_between_tiles_is_padded_and_keeps_each_columns_bits(bias):
    """An output layer grown by a mask token (49,153 rows: not a whole number of 16-column tiles) takes the
    native kernel too: zero rows pad it to the next tile and are cut off; each column keeps its bits, whatever
    the rows, so `--exact` decoding stays batch- and block-invariant."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(64, 37, bias=bias)
    padded = torch.nn.Linear(64, 48, bias=bias)
    with torch.no_grad():
        padded.weight.zero_()
        padded.weight[:37] = linear.weight
        if bias:
            padded.bias.zero_()
            padded.bias[:37] = linear.bias
    layer, whole = w4a8.W4A8Linear(linear), w4a8.W4A8Linear(padded)
    x = torch.randn(5, 64)
    y = layer(x)
    assert y.shape == (5, 37) and torch.equal(y, whole(x)[:, :37])
    assert all(torch.equal(layer(x[r : r + 1]), y[r : r + 1]) for r in range(5))
    assert quantization._kind(576, 49153, "int4") is w4a8.W4A8Linear  # not int8: SBD's output layer
    assert quantization._kind(48, 49153, "int4") is quantization.Int8Linear  # inputs still in whole groups


@needs_native
@pytest.mark.parametrize("bias", [False, True])
def test_a_low_rank_update_in_one_call_gives_the_bits_of_two_calls(bias):
    """W·x + B·(A·x) by one call (`fastforward::w4a8_lowrank`) against the unfused path: the layer of W's and
    A's rows, B's layer, a slice and an addition. The same bits at every row count, each row alone as in a
    block; here a fused group's update, whose B is block-diagonal and whose zero groups the call skips."""
    torch.manual_seed(0)
    updates = [  # ranks 8 and 40 (padded to 32 and 64 apart), none, 32: the group's rank is 128
        LowRank(torch.randn(8, 96) * 0.1, torch.randn(48, 8) * 0.1),
        LowRank(torch.randn(40, 96) * 0.1, torch.randn(32, 40) * 0.1),
        None,
        LowRank(torch.randn(32, 96) * 0.1, torch.randn(16, 32) * 0.1),
    ]
    update = LowRank.side_by_side(updates, [48, 32, 16, 16])
    linear = torch.nn.Linear(96, 112, bias=bias)
    layer = functools.partial(quantization._quantized, scheme="int4", smoothing=None, dense=False)
    one, two = W4A8LowRankLinear(linear, update), LowRankLinear(linear, update, layer, layer)
    assert one.up_groups.tolist() == [[0, 1]] * 3 + [[1, 3]] * 2 + [[0, 0]] + [[3, 4]]  # B's groups each tile reads
    assert isinstance(two.stacked, w4a8.W4A8Linear) and isinstance(two.up, w4a8.W4A8Linear)
    for rows in (1, 2, 5, 19):  # 19: every row-count path of the kernel
        x = torch.randn(rows, 96)
        y = one(x)
        assert torch.equal(y, two(x))
        assert all(torch.equal(one(x[r : r + 1]), y[r : r + 1]) for r in range(rows))
    x = torch.randn(2, 3, 96).bfloat16()  # other dtypes: computed in float32, rounded once at the end
    assert one(x).dtype == torch.bfloat16 and torch.equal(one(x), one(x.float()).bfloat16())


@needs_native
def test_the_low_rank_kernel_refuses_weights_that_do_not_match():
    update = LowRank(torch.randn(32, 64), torch.randn(32, 32))
    layer = W4A8LowRankLinear(torch.nn.Linear(64, 32, bias=False), update)
    kernel, x = torch.ops.fastforward.w4a8_lowrank, torch.randn(1, 64)
    beyond = torch.tensor([[0, 2], [0, 1]], dtype=torch.int32)  # a rank of 32 has one group
    with pytest.raises(RuntimeError, match="up_groups out of range"):
        kernel(x, layer.codes, layer.scales, beyond, 32)
    with pytest.raises(RuntimeError, match="do not match"):
        kernel(x, layer.codes[:-1], layer.scales, layer.up_groups, 32)


def test_pack_keeps_codes_that_dequantize_close_to_the_weights():
    torch.manual_seed(0)
    weight = torch.randn(32, 64)
    weight[3, :32] = 0.25  # a constant group: scale 0, every code 0, the minimum exact
    _, scales, codes = w4a8.pack(weight)
    s = scales[..., : w4a8.TILE].transpose(1, 2).reshape(32, 2).float()
    m = scales[..., w4a8.TILE :].transpose(1, 2).reshape(32, 2).float()
    dequantized = codes.reshape(32, 2, 32).float() * s[..., None] + m[..., None]
    step = s.repeat_interleave(32, dim=1)
    assert (dequantized.reshape(32, 64) - weight).abs().le(step / 2 + 1e-3).all()
    assert codes.max() == 15 and codes.min() == 0
    assert torch.equal(dequantized[3, 0], torch.full((32,), 0.25))


@needs_native
def test_native_int4_layers_compile_without_a_graph_break():
    model = tiny_model(seed=0)
    quantize(model.hf, "int4")
    assert all(not isinstance(m, Int4Linear) for m in model.hf.modules())
    explanation = torch._dynamo.explain(model.hf)(input_ids=torch.tensor([[3, 4, 5]]))
    assert explanation.graph_break_count == 0


def test_int4_falls_back_to_pytorchs_kernel(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FASTFORWARD_INT4_KERNEL", "pytorch")
    model = tiny_model(seed=0)
    quantize(model.hf, "int4")
    assert not any(isinstance(m, w4a8.W4A8Linear) for m in model.hf.modules())
    monkeypatch.setenv("FASTFORWARD_INT4_KERNEL", "fast")
    with pytest.raises(quantization.FastForwardError, match="choose native or pytorch"):
        w4a8.enabled()
    # A failed build is said once, with the reason, and leaves PyTorch's kernel in place.
    monkeypatch.delenv("FASTFORWARD_INT4_KERNEL")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(native, "instruction_set", lambda: "avx2")
    monkeypatch.setattr(native, "_build", _failing_build)
    native.available.cache_clear()
    try:
        assert not w4a8.enabled() and not w4a8.enabled()
    finally:
        native.available.cache_clear()
    assert capsys.readouterr().err.count("native CPU kernels did not build: no compiler") == 1


def _failing_build(isa: str) -> None:
    raise RuntimeError("no compiler")


@pytest.mark.skipif(native.instruction_set() is None, reason="needs x86 AVX2 or AVX-512")
def test_a_failed_build_says_its_first_error_and_log_once_per_machine(monkeypatch, capsys, tmp_path):
    sources = tmp_path / "csrc"  # the sources without the header they include: a broken include path
    sources.mkdir()
    for source in native.SOURCES:
        (sources / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(native, "SOURCES", [sources / source.name for source in native.SOURCES])
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "build"))
    native.available.cache_clear()
    try:
        assert not native.available()
        said = capsys.readouterr().err
        native.available.cache_clear()
        assert not native.available()  # another process on this machine: nothing said, no build tried
        assert capsys.readouterr().err == ""
    finally:
        native.available.cache_clear()
        log = native._build_directory(native.instruction_set()) / "build-error.log"
    assert log.is_relative_to(tmp_path / "build")
    first = next(line.strip() for line in log.read_text().splitlines() if "error:" in line)
    assert "simd.h" in first and said.count(first) == 1 and str(log) in said and "PyTorch's kernels serve" in said


def test_the_narrow_build_may_be_asked_for_and_nothing_else(monkeypatch):
    found = native.instruction_set()
    monkeypatch.setenv("FASTFORWARD_NATIVE_ISA", "avx2")
    assert native.instruction_set() == (None if found is None else "avx2")
    monkeypatch.setenv("FASTFORWARD_NATIVE_ISA", "sse2")
    with pytest.raises(quantization.FastForwardError, match="only avx2 may be asked for"):
        native.instruction_set()


def test_a_complete_build_is_loaded_directly_and_another_sources_build_is_not(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = native._build_directory("avx2")
    other = build.with_name("avx2-0123456789abcdef")  # a build of other sources: never looked at
    other.mkdir(parents=True)
    (other / "old.so").write_bytes(b"")
    (other / native.BUILT).write_text("old.so\n")
    compiled, loaded = [], []

    def compile_and_load(isa, directory):  # what torch's builder leaves: a library
        compiled.append(isa)
        (directory / "new.so").write_bytes(b"")

    monkeypatch.setattr(native, "_compile_and_load", compile_and_load)
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    native._build("avx2")
    assert compiled == ["avx2"] and loaded == []
    assert (build / native.BUILT).read_text() == "new.so\n"
    assert sorted(p.name for p in tmp_path.joinpath("native").iterdir()) == sorted([build.name, other.name])
    native._build("avx2")  # the next process: straight to the library
    assert compiled == ["avx2"] and loaded == [str(build / "new.so")]


def test_a_build_completed_meanwhile_by_another_process_is_kept(monkeypatch, tmp_path):
    """Two processes building the same sources at once: each in its own folder; the first to finish
    puts its build in place, the second's is dropped, and neither sees half-made files."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = native._build_directory("avx2")

    def compile_and_load(isa, directory):
        assert directory != build and not (directory / native.BUILT).exists()
        (directory / "mine.so").write_bytes(b"")
        build.mkdir(parents=True)  # the other process finishes first
        (build / "theirs.so").write_bytes(b"")
        (build / native.BUILT).write_text("theirs.so\n")

    monkeypatch.setattr(native, "_compile_and_load", compile_and_load)
    stopped = tmp_path / "native" / f".{build.name}-stopped"  # a process stopped midway, long ago
    stopped.mkdir(parents=True)
    os.utime(stopped, (0, 0))
    native._build("avx2")
    assert native._built_library(build) == build / "theirs.so"
    assert [p.name for p in tmp_path.joinpath("native").iterdir()] == [build.name]  # no folder left behind


def test_the_build_is_named_by_the_sources_bytes_not_their_place(monkeypatch, tmp_path):
    """Two checkouts of the same code share one build: a copy of the sources elsewhere has the same
    digest, in this process and in another; a changed byte has another."""
    isa = native.instruction_set() or "avx2"
    here = native._sources_digest(isa)
    copy = tmp_path / "elsewhere" / "csrc"
    copy.mkdir(parents=True)
    for path in native.SOURCES[0].parent.iterdir():
        (copy / path.name).write_bytes(path.read_bytes())
    monkeypatch.setattr(native, "SOURCES", [copy / source.name for source in native.SOURCES])
    assert native._sources_digest(isa) == here
    code = f"from fastforward.cpu import native; print(native._sources_digest({isa!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == here
    source = copy / native.SOURCES[0].name
    source.write_bytes(source.read_bytes() + b"\n")
    assert native._sources_digest(isa) != here
    assert native._sources_digest("avx512" if isa == "avx2" else "avx2") != here  # the flags are part of it


def test_builds_are_kept_under_fastforward_home(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path))
    assert native._build_directory("avx2").parent == tmp_path / "native"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "torch"))  # torch's own setting, where set
    assert native._build_directory("avx2").parent == tmp_path / "torch" / "native"


@pytest.mark.skipif(not native.available(), reason="needs the built kernels")
def test_a_fresh_process_loads_the_kernels_without_the_extension_builder():
    code = "import sys; from fastforward.cpu import native; assert native.available(); "
    code += "print('torch.utils.cpp_extension' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
