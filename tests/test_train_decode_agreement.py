"""Training layouts agree with decoding layouts: the logits a loss trains are the logits a decoder reads.

Each test builds one situation twice — as the training objective lays it out (one uncached forward,
`Model.hidden_states` + `Model.logits`) and as a decoder runs it (a causal prefill into a KV cache,
then the decoder's forward through `Model.run` against that cache) — and asserts the logits are equal (fp32).

SBD (`objectives.sbd.sbd_layout`, `decoders.sbd`). A masked-copy position in block b (positions
b·k … b·k+k−1) sees the clean tokens before b·k, whose entries the clean half computes causally, and
its own block of the copy bidirectionally. That is the decoding forward of the same block contents
under `sbd_decode(0, k)` after a causal prefill of x[:b·k] — and equally the decoder's commit
forward `sbd_decode(k, k)` of [block b−1 (clean, kept) ; block b] after a prefill of x[:(b−1)·k],
then its later in-block forwards on the cache that commit leaves. What the copy holds outside block
b (masked or not) does not matter. Training blocks start at row position 0, decoding blocks at the
prompt's end: they coincide when k divides the prompt length (the tests place b·k freely).

Jacobi Forcing (`objectives.jacobi_forcing.pack`, `trajectories.rollout`, `decoders.jacobi`,
`decoders.multiblock_jacobi`). The alignment: noisy block i of a packed row holds the state y at the
block's positions s … s+n−1 (s = prompt length + i·n) and slot j predicts the token at position
s+j+1 (its teacher is clean slot j, its AR label response[i·n+j+1]). Trajectory collection is a run
of `JacobiDecoder` (`trajectories.rollout`): a recorded state y of block i is the block's committed
head and the decoder's drafts over the rest, and the next iterate is y's Jacobi update, [token after
the context, argmax of slots 0 … n−2] of that layout (y at positions s … s+n−1, causal, after the
prompt and the fixed points before block i). `JacobiDecoder`'s forward [last ; d_1 … d_n] at
positions p … p+n is a noisy block of n+1 whose slot 0 has converged (last = the token at p): its
read j equals noisy slot j of the training block [last, d_1 … d_n].

- noisy_context="clean" (Fig. 2a): noisy block i = that forward after the prompt and the clean
  blocks before i — what both trajectory collection and Jacobi decoding run.
- noisy_context="noisy" (Fig. 2b): the noisy stream is a causal LM over [prompt, noisy_1, noisy_2,
  …], so noisy block i = that forward after a causal prefill of the prompt and the noisy blocks
  before i. The multi-block decoder's draft chain (one causal run of the real-active block and the
  pseudo-active blocks after the committed text) is this, with the earlier blocks converged.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from fastforward.model import Layout, Model, visibility
from fastforward.model.cache import KVCache
from fastforward.training.data import Batch
from fastforward.training.objectives.jacobi_forcing import pack
from fastforward.training.objectives.sbd import sbd_layout
from fastforward.training.trajectories.rollout import jacobi_decoder, rollouts

TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
@torch.no_grad()
def responses(tiny, prompts):
    """Greedy continuations (24 tokens) of the first two prompts: realistic decoded text."""
    out = []
    for prompt in prompts[:2]:
        ids = list(prompt)
        for _ in range(24):
            ids.append(int(tiny.hf(torch.tensor([ids])).logits[0, -1].argmax()))
        out.append(ids[len(prompt) :])
    return out


def prefill(model: Model, context: list[list[int]]) -> KVCache:
    """A fresh cache holding a causal prefill of `context` (equal-length rows), as every decoder starts."""
    ids = torch.tensor(context)
    batch, length = ids.shape
    cache = model.new_cache()
    model.run(Layout(ids, torch.arange(length).expand(batch, length), None), cache)
    return cache


def decode(
    model: Model, cache: KVCache, tokens: torch.Tensor, rule: torch.Tensor | None, keep: int = 0
) -> torch.Tensor:
    """A decoding forward: `tokens` [B, T] at the positions after the cache, under `rule` over the new tokens
    (None: causal, the model's own path) and seeing the whole cache; logits of every new token. The
    first `keep` new entries stay in the cache."""
    batch, length = tokens.shape
    past = cache.get_seq_length()
    positions = (past + torch.arange(length)).expand(batch, length)
    mask = None if rule is None else visibility.over_cache(rule, past, batch=batch)
    logits = model.run(Layout(tokens, positions, mask, read=torch.arange(length)), cache)
    cache.truncate(past + keep)
    return logits


def decode_after(
    model: Model, context: list[list[int]], tokens: torch.Tensor, rule: torch.Tensor | None, keep: int = 0
) -> tuple[torch.Tensor, KVCache]:
    cache = prefill(model, context)
    return decode(model, cache, tokens, rule, keep), cache


# ---- SBD ----------------------------------------------------------------------------------------
def sbd_block_logits(model: Model, x: torch.Tensor, masked: torch.Tensor, k: int, b: int) -> torch.Tensor:
    """Training logits [B, k, V] of the masked copy's block b under the SBD layout of `x` [B, L]."""
    length = x.shape[1]
    batch = Batch(x, loss_mask=torch.ones_like(x, dtype=torch.bool), valid=torch.ones_like(x, dtype=torch.bool))
    layout, _ = sbd_layout(batch, masked, k, model.mask_token_id)
    return model.run(replace(layout, read=torch.arange(length + b * k, length + (b + 1) * k)), None)


def masks(length: int, k: int, b: int, inside: str, outside: str, seed: int) -> torch.Tensor:
    """A [1, L] mask pattern: block b fully or partly masked, the other blocks as `outside` says."""
    g = torch.Generator().manual_seed(seed)
    if outside == "none":
        out = torch.zeros(1, length, dtype=torch.bool)
    elif outside == "all":
        out = torch.ones(1, length, dtype=torch.bool)
    else:
        out = torch.rand(1, length, generator=g) < 0.5
    block = torch.ones(k, dtype=torch.bool)
    if inside == "partial":  # a block the decoder has already revealed some of (the same whatever the seed)
        block[torch.randperm(k, generator=torch.Generator().manual_seed(k))[: k // 2]] = False
    out[0, b * k : (b + 1) * k] = block
    return out


@pytest.mark.parametrize(("k", "b"), [(4, 3), (3, 5), (6, 1), (1, 12)])
@pytest.mark.parametrize("inside", ["all", "partial"])
@torch.no_grad()
def test_sbd_block_equals_decoding_after_a_prefill(tiny, prompts, responses, k, b, inside):
    x = torch.tensor([prompts[0] + responses[0][:15]])  # L = 24
    start = b * k
    variants = [
        masks(x.shape[1], k, b, inside, outside, seed) for outside, seed in [("none", 0), ("all", 1), ("random", 2)]
    ]
    # the same block contents in every variant: only the masks elsewhere differ
    assert all(torch.equal(v[:, start : start + k], variants[0][:, start : start + k]) for v in variants)
    copy = x.masked_fill(variants[0], tiny.mask_token_id)
    decoded, _ = decode_after(tiny, x[:, :start].tolist(), copy[:, start : start + k], visibility.sbd_decode(0, k))
    for masked in variants:
        torch.testing.assert_close(sbd_block_logits(tiny, x, masked, k, b), decoded, **TOL)


@pytest.mark.parametrize(("k", "b"), [(4, 3), (5, 2), (2, 9)])
@torch.no_grad()
def test_sbd_block_equals_the_decoders_commit_forward_and_the_forwards_after_it(tiny, prompts, responses, k, b):
    """The SBD decoder's sequence for block b: one forward carrying the finished block b−1 (kept,
    causal) in front of k masks, then in-block forwards over the cache it left, as tokens get revealed."""
    x = torch.tensor([prompts[0] + responses[0][:15]])
    start = b * k
    mask_id = tiny.mask_token_id
    block = torch.full((1, k), mask_id)
    tokens = torch.cat([x[:, start - k : start], block], dim=1)
    logits, cache = decode_after(tiny, x[:, : start - k].tolist(), tokens, visibility.sbd_decode(k, k), keep=k)
    masked = masks(x.shape[1], k, b, "all", "random", seed=3)
    torch.testing.assert_close(sbd_block_logits(tiny, x, masked, k, b), logits[:, k:], **TOL)
    assert cache.get_seq_length() == start
    # reveal the true tokens one at a time, as a γ = 0 policy would (any order: here right to left)
    for reveal in reversed(range(1, k)):
        block[0, reveal] = x[0, start + reveal]
        masked[0, start + reveal] = False
        logits = decode(tiny, cache, block, visibility.sbd_decode(0, k))
        torch.testing.assert_close(sbd_block_logits(tiny, x, masked, k, b), logits, **TOL)
    assert cache.get_seq_length() == start


@torch.no_grad()
def test_sbd_block_equals_decoding_for_a_batch_of_rows(tiny, prompts, responses):
    k, b = 4, 4
    x = torch.tensor([prompts[0] + responses[0][:15], prompts[1] + responses[1][:18]])  # both L = 24
    g = torch.Generator().manual_seed(4)
    masked = torch.rand(x.shape, generator=g) < 0.3
    masked[:, b * k : (b + 1) * k] = torch.rand(2, k, generator=g) < 0.6
    masked[:, b * k] = True
    copy = x.masked_fill(masked, tiny.mask_token_id)
    start = b * k
    decoded, _ = decode_after(tiny, x[:, :start].tolist(), copy[:, start : start + k], visibility.sbd_decode(0, k))
    torch.testing.assert_close(sbd_block_logits(tiny, x, masked, k, b), decoded, **TOL)
    for row in range(2):  # and each row equals itself decoded alone
        alone, _ = decode_after(
            tiny, x[row : row + 1, :start].tolist(), copy[row : row + 1, start : start + k], visibility.sbd_decode(0, k)
        )
        torch.testing.assert_close(alone, decoded[row : row + 1], **TOL)


# ---- Jacobi Forcing -----------------------------------------------------------------------------
N = 4  # Jacobi block size


def jacobi_rows(prompts: list[list[int]], responses: list[list[int]]) -> list:
    """(prompt, noisy blocks, clean blocks) rows of two prompts of different lengths (pack pads one):
    three blocks of N per row, their noisy states as Jacobi iterates look — the "repeat" first draft,
    an iterate whose first slots have converged, random tokens."""
    g = torch.Generator().manual_seed(6)
    rows = []
    for prompt, response in zip(prompts[:2], responses, strict=True):
        clean = [response[i * N : (i + 1) * N] for i in range(3)]
        noisy = [
            [prompt[-1]] * N,
            clean[1][:2] + [clean[1][0]] * (N - 2),
            torch.randint(0, 300, (N,), generator=g).tolist(),
        ]
        assert all(a != b for a, b in zip(noisy, clean, strict=True))
        rows.append((prompt, noisy, clean))
    return rows


def noisy_slots(prompt_len: int, block_lens: list[int], i: int) -> list[int]:
    """Packed indices of noisy block i in `[prompt, noisy_0, clean_0, noisy_1, clean_1, …]`."""
    at = prompt_len + 2 * sum(block_lens[:i])
    return list(range(at, at + block_lens[i]))


def packed_logits(model: Model, rows: list, context: str):
    """The packed layout and the logits of every packed token (a training forward)."""
    packed = pack(rows, model.pad_token_id, context)
    return packed, model.run(replace(packed.layout, read=torch.arange(packed.layout.tokens.shape[1])), None)


def pairs(index: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[int, int]]:
    return list(zip(index[0].tolist(), index[1].tolist(), strict=True))


@torch.no_grad()
def test_clean_context_noisy_blocks_equal_the_jacobi_forward_after_the_clean_blocks(tiny, prompts, responses):
    rows = jacobi_rows(prompts, responses)
    packed, logits = packed_logits(tiny, rows, "clean")
    student, read = pairs(packed.noisy), pairs(packed.read)
    teacher = dict(zip(student, (read[t] for t in packed.teacher.tolist()), strict=True))
    labels = dict(zip(read, packed.labels.tolist(), strict=True))
    for r, (prompt, noisy, clean) in enumerate(rows):
        response = [t for c in clean for t in c]
        for i in range(len(clean)):
            context = prompt + response[: i * N]
            decoded, _ = decode_after(tiny, [context], torch.tensor([noisy[i]]), None)
            slots = noisy_slots(len(prompt), [N] * len(clean), i)
            torch.testing.assert_close(logits[r, slots], decoded[0], **TOL)
            # what the loss makes of slot j: teacher = clean slot j (N further on), label = the token after j
            for j, slot in enumerate(slots):
                following = i * N + j + 1
                if following == len(response):  # the response's last slot predicts nothing: not a student
                    assert (r, slot) not in teacher
                    continue
                assert teacher[(r, slot)] == (r, slot + N)
                assert labels[(r, slot + N)] == response[following]


@pytest.mark.parametrize("drafts", ["partly_right", "garbage"])
@torch.no_grad()
def test_jacobi_decoder_forward_is_a_noisy_block_whose_first_slot_converged(tiny, prompts, responses, drafts):
    """JacobiDecoder runs [last ; d_1 … d_n] after a cache of prompt + response[:m], last = response[m]."""
    prompt, response = prompts[0], responses[0]
    m = 6  # committed response tokens: not a multiple of n (the decoder's cache need not end on a block)
    g = torch.Generator().manual_seed(5)
    if drafts == "partly_right":
        d = response[m + 1 : m + 3] + [response[m + 2]] * (N - 2)  # two confirmed, then filler
    else:
        d = torch.randint(0, 300, (N,), generator=g).tolist()
    last = response[m]
    decoded, _ = decode_after(tiny, [prompt + response[:m]], torch.tensor([[last, *d]]), None, keep=N + 1)
    # training: the committed text as a clean block (its noisy copy anything), then the block [last, d]
    noise = torch.randint(0, 300, (m,), generator=g).tolist()
    clean = [response[:m], response[m : m + N + 1]]
    _, logits = packed_logits(tiny, [(prompt, [noise, [last, *d]], clean)], "clean")
    torch.testing.assert_close(logits[0, noisy_slots(len(prompt), [m, N + 1], 1)], decoded[0], **TOL)


@torch.no_grad()
def test_noisy_context_noisy_blocks_equal_a_forward_after_the_noisy_blocks_before(tiny, prompts, responses):
    rows = jacobi_rows(prompts, responses)
    _, logits = packed_logits(tiny, rows, "noisy")
    for r, (prompt, noisy, clean) in enumerate(rows):
        for i in range(len(clean)):
            context = prompt + [t for block in noisy[:i] for t in block]
            decoded, _ = decode_after(tiny, [context], torch.tensor([noisy[i]]), None)
            torch.testing.assert_close(logits[r, noisy_slots(len(prompt), [N] * len(clean), i)], decoded[0], **TOL)


@torch.no_grad()
def test_noisy_context_blocks_equal_the_multiblock_decoders_draft_chain(tiny, prompts, responses):
    """Block 0 converged (the progressive schedule's t₀ = 0 picks the fixed point) and in the cache; blocks
    1 and 2 drafted, block 1's first slot the committed `last`: one causal forward of the chain
    [last ; drafts of 1 ; drafts of 2] gives every noisy slot of both blocks."""
    (prompt, noisy, clean), _ = jacobi_rows(prompts, responses)
    noisy = [clean[0], *noisy[1:]]
    _, logits = packed_logits(tiny, [(prompt, noisy, clean)], "noisy")
    chain = torch.tensor([noisy[1] + noisy[2]])
    decoded, _ = decode_after(tiny, [prompt + clean[0]], chain, visibility.causal(2 * N), keep=2 * N)
    lens = [N] * 3
    training = logits[0, noisy_slots(len(prompt), lens, 1) + noisy_slots(len(prompt), lens, 2)]
    torch.testing.assert_close(training, decoded[0], **TOL)


@pytest.fixture(scope="module")
def trajectories(tiny, prompts):
    """Real Jacobi trajectories of two prompts of different lengths (`rollouts`: how training data is
    collected)."""
    chosen = prompts[:2]
    return chosen, [r.blocks for r in rollouts(tiny, jacobi_decoder(N, "repeat"), chosen, max_new_tokens=3 * N)]


@torch.no_grad()
def test_trajectory_iterates_are_argmaxes_of_the_clean_context_training_forward(tiny, trajectories):
    """Each stored iterate is the Jacobi update read off the training layout of the one before it:
    [token after the context, argmax of noisy slots 0 … n−2]; a fixed point maps to itself."""
    prompts, blocks = trajectories
    assert all(len(example) == 3 for example in blocks)
    assert any(len(b.trajectory) > 2 for example in blocks for b in example)  # some blocks take several steps
    depth = max(len(b.trajectory) for example in blocks for b in example)
    rows, updates = [], []
    for j in range(depth):  # one row per example and iterate j: every block at its j-th point (or fixed point)
        for prompt, example in zip(prompts, blocks, strict=True):
            at = [b.trajectory[min(j, len(b.trajectory) - 1)] for b in example]
            rows.append((prompt, at, [b.fixed for b in example]))
            updates.append([b.trajectory[min(j + 1, len(b.trajectory) - 1)] for b in example])
    _, logits = packed_logits(tiny, rows, "clean")
    for r, ((prompt, _, clean), update) in enumerate(zip(rows, updates, strict=True)):
        for i in range(len(clean)):
            guess = logits[r, noisy_slots(len(prompt), [N] * len(clean), i)].argmax(-1).tolist()
            assert [clean[i][0], *guess[:-1]] == update[i]
