"""Compiled decoding steps (`load_model(..., compile=True)`): lossless decoders stay exact."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fastforward.api import build_decoder
from fastforward.cpu import attention, native
from fastforward.cpu import compiled as compiled_module
from fastforward.cpu.compiled import AOT_COMPILE_WORKS, MergeRepeatedCalls
from fastforward.cpu.fusion import FusedMember
from fastforward.cpu.quantize import quantize
from fastforward.cpu.w4a8 import W4A8Linear
from fastforward.decoding.decoders import ARDecoder, registry
from fastforward.errors import FastForwardError
from fastforward.model import load_model, store
from fastforward.model.tiny import tiny_model
from fastforward.serving.warm_up import warm_up

WHY = f"--compile needs torch 2.13, not {torch.__version__}"
needs_aot_compile = pytest.mark.skipif(not AOT_COMPILE_WORKS, reason=WHY)


@pytest.fixture(scope="module")
def compiled():
    """A tiny int4 model with row-invariant attention and compiled steps (compiled once per module:
    each graph takes seconds to build)."""
    if not AOT_COMPILE_WORKS:
        pytest.skip(WHY)
    torch._dynamo.reset()
    model = tiny_model(seed=0, init_std=0.5, hidden_size=64)
    model.add_mask_token()
    quantize(model.hf, "int4")
    model.hf.config._attn_implementation = attention.NAME
    model.compile_steps()
    model.graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return model


def compiled_inputs(model, monkeypatch) -> list[torch.Tensor]:
    """The input ids of every forward that goes through the model's compiled forward from now on."""
    seen, forward = [], model.compiled_forward

    def spy(**inputs):
        seen.append(inputs["input_ids"])
        return forward(**inputs)

    monkeypatch.setattr(model, "compiled_forward", spy)
    return seen


def test_steps_run_compiled_and_the_prefill_eager(compiled, prompts, monkeypatch):
    seen = compiled_inputs(compiled, monkeypatch)
    ARDecoder().generate(compiled, [prompts[0]], max_new_tokens=4)
    assert [tuple(ids.shape) for ids in seen] == [(1, 1)] * 3  # the three steps after the prefill's token


@pytest.mark.parametrize("name", ["lookup", "jacobi", "jacobi-mr"])
def test_lossless_decoders_equal_compiled_ar(compiled, prompts, name):
    decoder = build_decoder(name)
    for prompt in prompts:
        ar = ARDecoder().generate(compiled, [prompt], max_new_tokens=30)[0]
        assert decoder.generate(compiled, [prompt], max_new_tokens=30)[0].token_ids == ar.token_ids
    # graphs per kind of forward, not per length: {one token, a block} x {a one-entry cache (the
    # one-token prompt), longer} + a masked block (jacobi-mr)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - compiled.graphs_before <= 5


@pytest.mark.skipif(not native.available(), reason="fused int4 layers need the native kernel")
@pytest.mark.parametrize("name", ["ar", "jacobi"])
def test_compiled_decoders_give_each_prompt_its_one_prompt_tokens_in_a_batch(compiled, prompts, name):
    alone = [ARDecoder().generate(compiled, [p], max_new_tokens=20)[0].token_ids for p in prompts[:3]]
    assert [g.token_ids for g in build_decoder(name).generate(compiled, prompts[:3], max_new_tokens=20)] == alone


def test_fused_projections_run_once_per_step(compiled, cached_step):
    """Query, key and value (gate and up) are one fused layer that each member's trace calls; the
    compiled graph calls its kernel once (`compiled.MergeRepeatedCalls`)."""
    kernels = {id(m) for m in compiled.hf.modules() if isinstance(m, W4A8Linear)}
    assert len(kernels) < sum(isinstance(m, (W4A8Linear, FusedMember)) for m in compiled.hf.modules())
    cache = compiled.new_cache()
    with torch.inference_mode():
        cached_step(compiled, cache, [1, 2, 3])  # the prefill, eager
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            cached_step(compiled, cache, [4])
    calls = sum(event.count for event in trace.key_averages() if event.key == "fastforward::w4a8_linear")
    assert calls == len(kernels)


@pytest.mark.parametrize("low_rank", [False, True])
def test_repeated_kernel_calls_are_merged_and_others_kept(low_rank):
    graph = torch.fx.Graph()
    x, y, codes, scales, groups = (graph.placeholder(name) for name in ("x", "y", "codes", "scales", "groups"))
    view = torch.ops.aten.view.default
    kernel = torch.ops.fastforward.w4a8_lowrank.default if low_rank else torch.ops.fastforward.w4a8_linear.default
    weights = (codes, scales, groups, 32) if low_rank else (codes, scales)  # an adapted layer's: with its update
    calls = [graph.call_function(kernel, (graph.call_function(view, (t, [-1, 32])), *weights)) for t in (x, x, y)]
    graph.output(tuple(calls))
    MergeRepeatedCalls()(graph)
    kept = [node for node in graph.nodes if node.target is kernel]
    assert [call.args[0].args[0] for call in kept] == [x, y]
    assert [node.target for node in graph.nodes].count(view) == 2


@needs_aot_compile
def test_a_growing_cache_compiles_no_new_graph(cached_step):
    """150 one-token steps: the cache's buffers double twice (past 64 and 128 entries) and fill up to
    their spare entry; one graph serves them all. Head size 64, as the first capacity: sizes that
    coincide must not be traced as one symbol (dynamo's duck sizing)."""
    model = tiny_model(seed=0, init_std=0.5, hidden_size=256)
    quantize(model.hf, "int4")
    model.hf.config._attn_implementation = attention.NAME
    model.compile_steps()
    cache, graphs = model.new_cache(), torch._dynamo.utils.counters["stats"]["unique_graphs"]

    with torch.inference_mode():
        logits = cached_step(model, cache, [1, 2, 3])
        for _ in range(150):
            logits = cached_step(model, cache, [int(logits[0, -1].argmax())])
    assert cache.get_seq_length() == 153
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1


@needs_aot_compile
def test_each_compiled_model_runs_its_own_graphs(cached_step):
    """Compiled graphs skip the guards on a model's parameters, so two models of one class but of
    other sizes must not share them; and a model changed by `add_mask_token` compiles again."""
    models = [tiny_model(seed=0, init_std=0.5, hidden_size=width) for width in (64, 128)]
    for model in models:
        model.compile_steps()
    with torch.inference_mode():
        for model in models:
            eager = cached_step(model, model.new_cache(), [1, 2, 3])  # against an empty cache: eager
            cache = model.new_cache()
            cached_step(model, cache, [1, 2])
            assert torch.allclose(cached_step(model, cache, [3]), eager, atol=1e-4)  # a compiled step
        model = models[0]
        vocab = model.hf.get_input_embeddings().num_embeddings
        model.add_mask_token()
        cache = model.new_cache()
        cached_step(model, cache, [1, 2])
        assert cached_step(model, cache, [model.mask_token_id]).shape[-1] == vocab + 1


def test_warm_up_compiles_one_row_and_a_batch_of_one_token_and_of_blocks(compiled, monkeypatch):
    seen = compiled_inputs(compiled, monkeypatch)
    assert warm_up(compiled, ARDecoder()) > 0
    assert {(ids.shape[0], ids.shape[1] > 1) for ids in seen} == {(1, False), (2, False), (1, True), (2, True)}


def test_after_a_warm_up_a_kind_it_did_not_prepare_runs_eagerly(compiled, prompts, monkeypatch, capsys):
    """A server's warm-up stops compiling: a kind compiled in the middle of serving would hold every
    request for a minute or more. Such steps run eagerly, with the same tokens, said once."""
    steps = compiled.compiled_forward
    monkeypatch.setattr(steps, "compile_new_kinds", True)  # restored after: the fixture is shared
    monkeypatch.setattr(steps, "said_eager", False)
    warm_up(compiled, ARDecoder())
    assert steps.compile_new_kinds is False
    monkeypatch.setattr(steps, "kinds", [])  # every kind is then one the warm-up did not prepare
    no_compiling(monkeypatch)
    batch = prompts[:3]
    decoded = [g.token_ids for g in build_decoder("jacobi").generate(compiled, batch, max_new_tokens=12)]
    monkeypatch.setattr(compiled, "compiled_forward", None)
    assert [g.token_ids for g in build_decoder("jacobi").generate(compiled, batch, max_new_tokens=12)] == decoded
    assert capsys.readouterr().err.count("a kind of step the warm-up did not prepare runs eagerly") == 1


@needs_aot_compile
def test_a_step_that_fails_to_compile_runs_eagerly_and_says_so_once(prompts, monkeypatch, capsys):
    model = tiny_model(seed=0)
    eager = ARDecoder().generate(model, [prompts[0]], max_new_tokens=6)[0].token_ids
    model.compile_steps()
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("dynamo cannot trace this\nsecond line")

    monkeypatch.setattr("fastforward.cpu.compiled.aot_compile_fullgraph", broken)
    for _ in range(2):
        assert ARDecoder().generate(model, [prompts[0]], max_new_tokens=6)[0].token_ids == eager
    assert len(calls) == 1  # not tried again at every step
    err = capsys.readouterr().err
    assert err.count("could not compile this step (RuntimeError: dynamo cannot trace this); it runs eagerly") == 1


def test_compile_without_a_cxx_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(FastForwardError, match="needs a C\\+\\+ compiler"):
        tiny_model(seed=0).compile_steps()


def test_compile_on_a_torch_before_2_13_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(compiled_module, "AOT_COMPILE_WORKS", False)
    with pytest.raises(FastForwardError, match="needs dynamo's AOT compile as torch 2.13 has it"):
        tiny_model(seed=0).compile_steps()


@pytest.fixture
def saved_int4(tmp_path, monkeypatch):
    """A tiny model on disk, its home (store) in tmp_path, and inductor's kernels kept in it."""
    if not AOT_COMPILE_WORKS:
        pytest.skip(WHY)
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    tiny_model(seed=0, init_std=0.5, hidden_size=64).save(tmp_path / "model")
    return str(tmp_path / "model")


def decoded(model, prompts) -> list[list[int]]:
    """AR's and jacobi's tokens: steps of one token and of a block."""
    runs = [build_decoder(name).generate(model, [p], max_new_tokens=24) for name in ("ar", "jacobi") for p in prompts]
    return [run[0].token_ids for run in runs]


def no_compiling(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("compiled a graph that the store held")

    monkeypatch.setattr("fastforward.cpu.compiled.aot_compile_fullgraph", refuse)


def test_a_second_load_reads_the_compiled_steps_back(saved_int4, prompts, monkeypatch):
    """The graphs a load compiled are kept: the next load (a new process's, after dynamo forgets them)
    runs them without compiling, with the same tokens."""
    torch._dynamo.reset()
    first = load_model(saved_int4, quantize="int4", exact=True, compile=True)
    tokens = decoded(first, prompts[:2])
    ARDecoder().generate(first, prompts[:2], max_new_tokens=4)  # and a kind these prompts alone do not need
    kinds = len(first.compiled_forward.kinds)
    assert kinds >= 3  # one token and a block, for one row; one token for two
    torch._dynamo.reset()
    no_compiling(monkeypatch)
    second = load_model(saved_int4, quantize="int4", exact=True, compile=True)
    assert len(second.compiled_forward.kinds) == kinds
    assert decoded(second, prompts[:2]) == tokens
    # each kind is read back when a step of its signature first comes: the two-row kind never did
    assert sum(kind.compiled is not None for kind in second.compiled_forward.kinds) == kinds - 1


def test_another_thread_count_is_another_kind_and_no_kind_is_kept_twice(saved_int4, prompts, monkeypatch, capsys):
    """Every graph is guarded on torch's global state, thread count included (inductor writes it into
    its kernels): a process with another count once found each kept kind refused and compiled it again
    beside it, under the same signature. Now the count is part of a kind's signature: one kind per
    count, and a later process at either count compiles nothing."""
    torch._dynamo.reset()
    first = load_model(saved_int4, quantize="int4", exact=True, compile=True)
    ARDecoder().generate(first, prompts[:1], max_new_tokens=4)  # one kind at 1 thread (conftest)
    torch.set_num_threads(2)
    ARDecoder().generate(first, prompts[:1], max_new_tokens=4)  # the same kind at 2 threads: compiled
    said = capsys.readouterr().err
    assert "(one token, one row, 2 threads; kept for later processes); the store holds it for 1 thread " in said
    assert "(`--threads 1` reads it back)" in said
    signatures = [kind.signature for kind in first.compiled_forward.kinds]
    assert len(signatures) == 2 and len(set(signatures)) == 2
    torch._dynamo.reset()
    no_compiling(monkeypatch)
    for threads in (1, 2):
        torch.set_num_threads(threads)
        second = load_model(saved_int4, quantize="int4", exact=True, compile=True)
        ARDecoder().generate(second, prompts[:1], max_new_tokens=4)
        steps = second.compiled_forward
        assert not steps.failed and "compiling" not in capsys.readouterr().err  # (a refused compile runs eagerly)
        assert sorted(map(repr, (kind.signature for kind in steps.kinds))) == sorted(map(repr, signatures))
        assert sum(kind.compiled is not None for kind in steps.kinds) == 1  # this count's kind, read back


# Another checkout's process: its own copy of the package, the same home; it must compile nothing.
READ_BACK = """
import sys, torch
torch.set_num_threads(1)
import fastforward
assert fastforward.__file__.startswith(sys.argv[1]), fastforward.__file__
from fastforward.cpu import compiled
from fastforward.decoding.decoders import ARDecoder
from fastforward.model import load_model
compiled.aot_compile_fullgraph = None  # compiling would fail
model = load_model(sys.argv[2], quantize="int4", exact=True, compile=True)
print(ARDecoder().generate(model, [[3, 17, 42]], max_new_tokens=6)[0].token_ids)
"""


def test_a_copy_of_the_code_elsewhere_reads_the_kept_steps_back(saved_int4, tmp_path):
    """Two checkouts of the same commit share kept steps: their store key is made of the code's bytes,
    not its place, and the graphs hold no path of it."""
    torch._dynamo.reset()
    model = load_model(saved_int4, quantize="int4", exact=True, compile=True)
    tokens = ARDecoder().generate(model, [[3, 17, 42]], max_new_tokens=6)[0].token_ids
    copy = tmp_path / "elsewhere"
    shutil.copytree(store.PACKAGE, copy / "fastforward", ignore=shutil.ignore_patterns("__pycache__"))
    code = (copy / "fastforward" / "cpu", copy / "fastforward" / "model")
    assert model.compiled_forward.store.code != code
    assert store.Store(tmp_path, "compiled", Path(saved_int4), code, **model.compiled_forward.store.setting)._key() == (
        model.compiled_forward.store._key()
    )
    env = {**os.environ, "PYTHONPATH": str(copy)}
    out = subprocess.run(
        [sys.executable, "-c", READ_BACK, str(copy), saved_int4], capture_output=True, text=True, env=env, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tokens) and "compiling" not in out.stderr


def test_a_corrupt_or_stale_compiled_entry_is_said_and_compiled_again(saved_int4, prompts, tmp_path, capsys):
    torch._dynamo.reset()
    tokens = decoded(load_model(saved_int4, quantize="int4", exact=True, compile=True), prompts[:1])
    (entry,) = (tmp_path / "home" / "compiled").glob("*.pt")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    capsys.readouterr()
    torch._dynamo.reset()
    assert decoded(load_model(saved_int4, quantize="int4", exact=True, compile=True), prompts[:1]) == tokens
    said = capsys.readouterr().err
    assert said.count("unusable") == 1 and "compiling again" in said
    # an entry with a sound checksum that this code cannot read (as from another build): the same
    store = load_model(saved_int4, quantize="int4", exact=True, compile=True).compiled_forward.store
    store.save({"kinds": [b"not a graph"], "modules": {}})
    capsys.readouterr()
    model = load_model(saved_int4, quantize="int4", exact=True, compile=True)
    assert "unusable" in capsys.readouterr().err and model.compiled_forward.kinds == []
    assert decoded(model, prompts[:1]) == tokens
    # a kind read back only when its first step comes: found unusable then, said, compiled again
    signatures = [kind.signature for kind in model.compiled_forward.kinds]
    store.save({"kinds": [(signature, b"not a graph") for signature in signatures], "modules": {}, "vector_isas": []})
    capsys.readouterr()
    model = load_model(saved_int4, quantize="int4", exact=True, compile=True)
    assert ARDecoder().generate(model, prompts[:1], max_new_tokens=24)[0].token_ids == tokens[0]  # ar's: one kind
    said = capsys.readouterr().err
    assert said.count("a kept compiled step is unusable") == 1 and "compiling it again" in said


@pytest.mark.parametrize("name", sorted(registry.specs()))
def test_compiling_changes_speed_not_tokens(compiled, prompts, monkeypatch, name):
    """Every decoder, lossless or not, gives the compiled model the eager model's tokens, in a batch
    (each decoder's own layouts through the graphs). On this tiny model the rounding `eager_rounding`
    fixes is too small to flip a token: the logits test below is the one that catches its absence."""
    decoder = build_decoder(name)
    batch = prompts[:3]
    fast = [g.token_ids for g in decoder.generate(compiled, batch, max_new_tokens=16)]
    monkeypatch.setattr(compiled, "compiled_forward", None)
    assert [g.token_ids for g in decoder.generate(compiled, batch, max_new_tokens=16)] == fast


@pytest.mark.parametrize("tokens", [[5], [7, 9, 11, 13]])
def test_a_compiled_step_has_the_eager_steps_logits(compiled, cached_step, monkeypatch, tokens):
    """Bit for bit: without `eager_rounding`, inductor's norms and rotary embeddings differ from eager in
    the last bits (2e-6 here), enough to flip near-ties over a long generation."""
    prompt = list(range(3, 40))
    with torch.inference_mode():
        cache = compiled.new_cache()
        cached_step(compiled, cache, prompt)
        fast = cached_step(compiled, cache, tokens)
        monkeypatch.setattr(compiled, "compiled_forward", None)
        cache = compiled.new_cache()
        cached_step(compiled, cache, prompt)
        assert torch.equal(cached_step(compiled, cache, tokens), fast)


def test_serve_warm_up_only_prepares_the_servers_steps_and_exits(tmp_path, monkeypatch, capsys):
    """The warm-up itself is tested above; here the command's wiring: the server's model (compiled by
    default) and decoder, then exit 0 without serving."""
    from fastforward.cli import main

    tiny_model(seed=0).save(tmp_path / "model")
    monkeypatch.setenv("FASTFORWARD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(compiled_module, "unavailable", lambda device_type: None)  # compiled by default
    monkeypatch.setattr("fastforward.model.Model.compile_steps", lambda model, store=None: None)
    warmed = []
    monkeypatch.setattr(
        "fastforward.serving.warm_up.warm_up", lambda model, decoder: warmed.append(decoder.name) or 1.0
    )
    command = ["serve", "--model", str(tmp_path / "model"), "--decoder", "jacobi", "--warm-up-only"]
    assert main([*command, "--no-compile"]) == 2
    assert "--warm-up-only prepares compiled steps: leave out --no-compile" in capsys.readouterr().err
    assert main(command) == 0 and warmed == ["jacobi"]


@needs_aot_compile
def test_compiled_bfloat16_steps_give_eager_tokens_in_a_batch(tmp_path):
    """bfloat16 `--exact`: compiled steps round their fused operations as eager's kernels do
    (`eager_rounding`), and the linears' fixed-size calls stay one opaque operation, so compiled `ar`
    and a batch of compiled `jacobi` give each prompt eager one-prompt AR's tokens."""
    torch._dynamo.reset()
    tiny_model(seed=0, init_std=0.5).save(tmp_path / "model")
    eager = load_model(str(tmp_path / "model"), dtype="bfloat16", exact=True)
    compiled = load_model(str(tmp_path / "model"), dtype="bfloat16", exact=True, compile=True)
    texts = ["def add(a, b):", "Tom has 3 apples and buys 5 more.", "0", "The quick brown fox"]
    prompts = [eager.encode_prompt(text, chat_template=False) for text in texts]
    alone = [ARDecoder().generate(eager, [p], max_new_tokens=16)[0].token_ids for p in prompts]
    assert [ARDecoder().generate(compiled, [p], max_new_tokens=16)[0].token_ids for p in prompts] == alone
    assert [g.token_ids for g in build_decoder("jacobi").generate(compiled, prompts, max_new_tokens=16)] == alone
