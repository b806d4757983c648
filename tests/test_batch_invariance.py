"""A prompt's tokens do not depend on what shares its batch: every decoder, at every precision
`load_model` offers, one prompt alone against mixed-length left-padded batches of 3 and of 8.

Lossless decoders must give one-prompt greedy AR's tokens; lossy ones their own one-prompt tokens.
float32 runs without `--exact` (its GEMMs round by row count, but the tiny model has no near-ties);
bfloat16, int8 and int4 run with `--exact`, which promises it bit for bit.
"""

from __future__ import annotations

import pytest
import torch

import fastforward as ff
from fastforward.cpu import row_chunks
from fastforward.cpu.row_chunks import SIZES, RowChunkedLinear, chunk_rows, plan
from fastforward.decoding.decoders import registry
from fastforward.decoding.runtime import start
from fastforward.model import load_model
from fastforward.model.tiny import tiny_model

SETTINGS = {
    "float32": {},
    "bfloat16 --exact": {"dtype": "bfloat16", "exact": True},
    "int8 --exact": {"quantize": "int8", "exact": True},
    "int4 --exact": {"quantize": "int4", "exact": True},
}
TEXTS = [
    "def add(a, b):",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "0",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "def add(a, b):\n    return a + b\n",
    "3 + 5 = 8\n#### 8",
    "The lazy dog",
    "How many apples does Tom have? 3 + 5",
]
NEW_TOKENS = 16
KNOBS = {"block_size": 4}  # small blocks: several per output


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    model = tiny_model(seed=0, init_std=0.5, hidden_size=64)
    model.add_mask_token()
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save(path)
    return str(path)


@pytest.fixture(scope="module", params=list(SETTINGS))
def model(request, saved):
    return load_model(saved, **SETTINGS[request.param])


def decoder(name: str, **extra):
    spec = registry.spec(name)
    return ff.build_decoder(name, **{k: v for k, v in {**KNOBS, **extra}.items() if spec.knob(k)})


def outputs(model, name: str, prompts: list[list[int]], **extra) -> list[list[int]]:
    return [g.token_ids for g in decoder(name, **extra).generate(model, prompts, NEW_TOKENS)]


@pytest.mark.parametrize("name", list(registry.specs()))
def test_a_prompt_decodes_the_same_alone_and_in_batches_of_3_and_8(model, name):
    prompts = [model.encode_prompt(text, chat_template=False) for text in TEXTS]
    reference = "ar" if registry.spec(name).lossless else name
    alone = [outputs(model, reference, [p])[0] for p in prompts]
    assert outputs(model, name, prompts[:3]) == alone[:3]
    assert outputs(model, name, prompts) == alone


def test_random_drafts_on_a_quantized_model(saved):
    model = load_model(saved, quantize="int4", exact=True)
    prompts = [model.encode_prompt(text, chat_template=False) for text in TEXTS]
    alone = [outputs(model, "ar", [p])[0] for p in prompts]
    assert outputs(model, "jacobi", prompts, draft_init="random") == alone


# Whether oneDNN packs bfloat16 weights on this CPU (not on one with AVX2 alone: the layers then call `linear`).
PACKS_BFLOAT16 = row_chunks.pack_weight(torch.zeros(16, 16, dtype=torch.bfloat16)) is not None


def test_bfloat16_linears_are_row_chunked_with_packed_weights(saved):
    model = load_model(saved, dtype="bfloat16", exact=True)
    chunked = [m for m in model.hf.modules() if isinstance(m, torch.nn.Linear)]
    assert chunked and all(type(m) is RowChunkedLinear for m in chunked)
    assert all((m.packed is not None) == PACKS_BFLOAT16 and set(m.sizes) <= set(SIZES) for m in chunked)


@pytest.mark.parametrize("sizes", ["probed", "small", "unpacked"])
def test_bfloat16_linears_compute_each_row_as_a_one_row_call(sizes, monkeypatch):
    """At SmolLM2-135M's MLP shapes, where the Xeon's bfloat16 GEMM changes kernel past 32 rows (and
    another CPU's already between 16 and 32): 600 rows (several calls), 136 and 40 rows, and 5 rows (a
    call filled with zero rows) equal each row alone, bit for bit."""
    if sizes == "small":  # the small-row kernel's sizes: both, or one alone where they disagree
        probe = row_chunks.call_sizes
        monkeypatch.setattr(row_chunks, "call_sizes", lambda weight, packed: probe(weight, packed, (16, 32)))
    if sizes == "unpacked":  # no oneDNN (or not a CPU): `linear` itself in the fixed calls
        monkeypatch.setattr(row_chunks, "PACKS", False)
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(576, 1536), torch.nn.Linear(1536, 576)).bfloat16()
    chunk_rows(layers)
    assert sizes != "small" or set(layers[0].sizes) <= {16, 32}
    assert (layers[0].packed is None) == (sizes == "unpacked" or not PACKS_BFLOAT16)
    x = torch.randn(600, 576).bfloat16()
    with torch.inference_mode():
        alone = torch.cat([layers(row[None]) for row in x])
        assert torch.equal(layers(x), alone)
        assert torch.equal(layers(x[100:236]), alone[100:236])
        assert torch.equal(layers(x[7:47]), alone[7:47])
        assert torch.equal(layers(x[3:8]), alone[3:8])
        assert layers(x[:0]).shape == (0, 576)


@pytest.mark.parametrize("setting", [name for name in SETTINGS if "exact" in name] + ["int4 --exact, PyTorch's kernel"])
def test_a_padded_prefill_gives_each_row_a_one_prompt_prefills_bits(saved, setting, monkeypatch):
    """One forward prefills a left-padded batch (each row's attention alone, `padded_prefill`): every
    row's logits and valid cache entries equal those of the row's prompt prefilled alone, bit for bit.
    With PyTorch's int4 kernel a prefill multiplies by bfloat16 copies of the weights from 16 rows on
    (`quantize.prefill_kernels`), whose rounding depends on the row count: each row alone there too."""
    if setting.endswith("PyTorch's kernel"):
        monkeypatch.setenv("FASTFORWARD_INT4_KERNEL", "pytorch")
    model = load_model(saved, **SETTINGS[setting.split(",")[0]])
    prompts = [model.encode_prompt(text) for text in TEXTS]
    with torch.inference_mode():
        batch = start(model, prompts, 4)
        for row, prompt in enumerate(prompts):
            alone = start(model, [prompt], 4)
            assert torch.equal(batch.next_logits[row], alone.next_logits[0])
            valid = batch.cache.validity(batch.batch)[row]
            for mine, theirs in zip(batch.cache.layers, alone.cache.layers, strict=True):
                assert torch.equal(mine.keys[row][:, valid], theirs.keys[0])
                assert torch.equal(mine.values[row][:, valid], theirs.values[0])
        unpadded, alone = start(model, [prompts[3]] * 3, 4), start(model, [prompts[3]], 4)  # no padding
        assert all(torch.equal(logits, alone.next_logits[0]) for logits in unpadded.next_logits)


def test_call_plans_cover_the_rows_in_the_fewest_calls():
    """Every row count goes in as few calls as the largest size allows, of the set's sizes, none spare."""
    for sizes in ((40, 48, 64, 80, 112, 128, 160), (16, 32), (32,)):
        for rows in range(1, 1100):
            calls = plan(rows, sizes)
            assert set(calls) <= set(sizes) and list(calls) == sorted(calls, reverse=True)
            assert sum(calls) >= rows > sum(calls[:-1])
            assert len(calls) == -(-rows // sizes[-1])
    assert plan(136, (40, 48, 64, 80, 112, 128, 160)) == (160,)


@pytest.mark.parametrize("name", ["ar", "jacobi", "lookup"])
def test_rows_joining_and_leaving_a_running_batch_keep_their_tokens(model, name):
    """Continuous batching (`Session.join` / `leave`, as the server schedules) at every precision:
    requests arriving while others decode give one-prompt greedy AR's tokens, bit for bit."""
    from test_continuous import run_staggered

    prompts = [model.encode_prompt(text, chat_template=False) for text in TEXTS]
    arrivals = [(0, 3, 16), (0, 1, 7), (1, 0, 12), (2, 5, 16), (2, 2, 9), (4, 7, 16), (5, 4, 11), (6, 6, 5)]
    got = run_staggered(model, decoder(name), prompts, arrivals, fused=True)
    assert got == [outputs(model, "ar", [prompts[index]])[0][:budget] for _, index, budget in arrivals]
