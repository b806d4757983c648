"""Multi-Block Diffusion decoding: exact cache, batch, stops, budget, the multi-block path, stats."""

import pytest
import torch
from driving import decode

from fastforward.api import build_decoder
from fastforward.decoding.decoders import SBDDecoder
from fastforward.decoding.decoders.mbd import MultiBlockDiffusionDecoder, _Block
from fastforward.decoding.policies import Threshold
from fastforward.decoding.runtime import start
from fastforward.errors import FastForwardError
from fastforward.model import visibility


def _ids(gens):
    return [g.token_ids for g in gens]


class _Recording(MultiBlockDiffusionDecoder):
    """Records, per forward, the sizes of the running blocks its rule lays out."""

    def begin(self, session, rows):
        self.forwards: list[tuple[int, ...]] = []
        self.last_position = 0
        original = session.forward

        def forward(tokens, positions, rule, read):
            if rule.dim() == 2:  # one row: its running blocks start where the read starts
                sizes, i = [], read.start
                while i < rule.shape[0]:  # a block's first token sees up to the end of its block
                    end = i + int(rule[i, i:].sum())
                    sizes.append(end - i)
                    i = end
                self.forwards.append(tuple(sizes))
            for row, places in zip(session.rows, positions, strict=True):
                self.last_position = max(self.last_position, int(places.max()) - row.origin)
            return original(tokens, positions, rule, read)

        session.forward = forward
        super().begin(session, rows)


def test_block_causal_rule():
    rule = visibility.block_causal_decode(2, (2, 3))
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0],
            [1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(rule, expected)
    assert torch.equal(visibility.block_causal_decode(3, (4,)), visibility.sbd_decode(3, 4))


class _BackFirst(MultiBlockDiffusionDecoder):
    """Reveals the last running block whole while a block before it is still masked, then the
    front block one position per forward: later blocks complete before earlier ones."""

    def _choose(self, running, confidence):
        chosen = [[] for _ in running]
        masked = [[j for j in range(b.size) if not b.done[j]] for b in running]
        last = max(i for i, m in enumerate(masked) if m)
        chosen[last] = masked[last] if last else masked[0][:1]
        return chosen


@pytest.mark.parametrize(
    "decoder",
    [
        MultiBlockDiffusionDecoder(4, 2, 0.0, 0.5, 0.5),
        MultiBlockDiffusionDecoder(5, 3, 0.2, 0.3, 0.5),
        MultiBlockDiffusionDecoder(3, 2, 0.5, 1.0, 0.5),
        _BackFirst(4, 3, 0.0),
        _BackFirst(4, 3, 0.0, static=True),
        MultiBlockDiffusionDecoder(5, 3, 0.2, 0.3, 0.5, static=True),
    ],
)
def test_cache_after_mbd_equals_fresh_prefill(tiny, prompts, decoder, cache_is_prefill):
    prompt = prompts[0]
    with torch.inference_mode():
        session = start(tiny, [prompt], 23)
        decode(decoder, session)
    generated = session.rows[0].output
    cached = session.cache.get_seq_length() - len(prompt)
    # the last blocks are read, never written: at most a buffer of them is missing from the cache
    assert len(generated) - decoder.buffer_size * decoder.block_size <= cached < len(generated)
    cache_is_prefill(session.cache, prompt + generated[:cached])


@pytest.mark.parametrize("accept", [1.0, 0.5])
@pytest.mark.parametrize("block", [1, 4, 7])
def test_buffer_of_one_is_sbd_with_a_threshold(tiny, prompts, block, accept):
    """One running block, revealed above the threshold or else its most confident position: SBD's
    threshold policy (τ above every confidence: one token per forward), forward for forward."""
    sbd = SBDDecoder(block, Threshold(1.01 if accept == 1.0 else accept))
    sbd = [sbd.generate(tiny, [p], max_new_tokens=19)[0] for p in prompts]  # a batch of SBD moves in lockstep
    mbd = MultiBlockDiffusionDecoder(block, 1, 0.0, accept, 0.9).generate(tiny, prompts, max_new_tokens=19)
    assert [(g.token_ids, g.stats.nfe, g.stats.tokens_per_step) for g in mbd] == [
        (g.token_ids, g.stats.nfe, g.stats.tokens_per_step) for g in sbd
    ]
    if accept == 1.0:
        assert all(g.stats.tokens_per_step == {1: 19} for g in mbd)


@pytest.mark.parametrize("decoder", [MultiBlockDiffusionDecoder(4, 2, 0.1, 0.5), MultiBlockDiffusionDecoder(3, 3, 0.0)])
def test_batch_equals_one_at_a_time(tiny, prompts, decoder):
    batched = _ids(decoder.generate(tiny, prompts, max_new_tokens=17))
    single = [decoder.generate(tiny, [p], max_new_tokens=17)[0].token_ids for p in prompts]
    assert batched == single


@pytest.mark.parametrize("decoder", [_Recording(4, 2, 0.0, 0.5), _Recording(16, 3)])
def test_max_new_tokens_is_respected(tiny, prompts, decoder):
    for n in (1, 5, 7, 18):
        gens = decoder.generate(tiny, prompts, max_new_tokens=n)
        assert all(len(g.token_ids) == n for g in gens)
        assert all(sum(k * v for k, v in g.stats.tokens_per_step.items()) == n for g in gens)
        assert decoder.last_position == n - 1  # no forward carries a position past the budget


def test_forwards_carry_several_running_blocks(tiny, prompts):
    decoder = _Recording(4, buffer_size=3, add_threshold=0.0, accept_threshold=0.5, semi_threshold=0.0)
    decoder.generate(tiny, [prompts[2]], max_new_tokens=24)
    assert any(len(sizes) == 3 for sizes in decoder.forwards), decoder.forwards
    assert all(len(sizes) <= 3 for sizes in decoder.forwards)


def test_stats_count_every_revealed_token(tiny, prompts):
    gens = MultiBlockDiffusionDecoder(4, 2, 0.1, 0.5).generate(tiny, prompts, max_new_tokens=21)
    for g in gens:
        assert sum(g.stats.tokens_per_step.values()) == g.stats.nfe
        assert sum(k * v for k, v in g.stats.tokens_per_step.items()) == g.stats.tokens == 21
    assert any(g.stats.nfe < 21 for g in gens)


def test_acceptance_and_forcing_rules():
    decoder = MultiBlockDiffusionDecoder(4, 3, accept_threshold=0.9, semi_threshold=0.5)
    front = _Block(0, [1, None, None, None], [True, False, False, False])  # progress 1/4
    second = _Block(4, [None] * 4, [False] * 4)
    third = _Block(8, [None] * 4, [False] * 4)
    low = [0.0, 0.2, 0.3, 0.1] * 3  # nothing passes: only the front block forces its top position
    assert decoder._choose([front, second, third], low) == [[2], [], []]
    front.done[1:3] = [True, True]  # progress 3/4 >= semi: the second block forces too, the third waits
    assert decoder._choose([front, second, third], low) == [[3], [2], []]
    high = [0.95, 0.95, 0.5, 0.91] + [0.2, 0.99, 0.2, 0.2] + [0.2] * 4
    assert decoder._choose([front, second, third], high) == [[3], [1], []]  # only masked positions count


def test_registry_builds_and_checks_mbd():
    decoder = build_decoder("mbd", buffer_size=3)
    assert isinstance(decoder, MultiBlockDiffusionDecoder) and decoder.buffer_size == 3
    assert decoder.block_size == 16 and decoder.accept_threshold == 0.9
    for bad in ({"buffer_size": 0}, {"add_threshold": 1.5}, {"accept_threshold": -0.1}, {"semi_threshold": 2.0}):
        with pytest.raises(FastForwardError):
            build_decoder("mbd", **bad)


class _ScriptedOrder(MultiBlockDiffusionDecoder):
    """One running block; one position per forward, the first still masked in `order`."""

    def __init__(self, block_size, order):
        super().__init__(block_size, buffer_size=1, add_threshold=0.0)
        self.order = order

    def _choose(self, running, confidence):
        (block,) = running
        return [[next(j for j in self.order if not block.done[j])]]


def test_no_forward_is_spent_after_a_revealed_stop(tiny, prompts, stop_on):
    """Position 2 is revealed first and holds a stop token: position 5 (after it) is never revealed,
    so the block ends after revealing positions 0 and 1, in three forwards."""
    decoder = _ScriptedOrder(8, [2, 5, 0, 1, 3, 4, 6, 7])
    free = decoder.generate(tiny, [prompts[0]], max_new_tokens=8)[0].token_ids
    assert free[2] not in free[:2]
    with stop_on(free[2]):
        gen = decoder.generate(tiny, [prompts[0]], max_new_tokens=8)[0]
    assert gen.token_ids[2] == free[2] and len(gen.token_ids) == 3  # 0 and 1 are revealed without 5
    assert gen.stats.nfe == 3 and gen.stats.tokens_per_step == {1: 3}  # position 5 would cost a fourth


class _Widths(MultiBlockDiffusionDecoder):
    """Records the width (tokens) of every forward."""

    def begin(self, session, rows):
        self.widths: list[int] = []
        original = session.forward

        def forward(tokens, positions, rule, read):
            self.widths.append(tokens.shape[1])
            return original(tokens, positions, rule, read)

        session.forward = forward
        super().begin(session, rows)


@pytest.mark.parametrize("options", [(4, 2, 0.0, 0.5, 0.5), (5, 3, 0.2, 0.3, 0.0), (3, 1, 0.0, 0.9, 0.9)])
def test_static_mode_gives_the_same_tokens_at_a_fixed_width(tiny, prompts, options):
    block, buffer = options[:2]
    dynamic, static = _Widths(*options), _Widths(*options, static=True)
    for prompt in prompts:
        a = dynamic.generate(tiny, [prompt], max_new_tokens=22)[0]
        b = static.generate(tiny, [prompt], max_new_tokens=22)[0]
        assert (a.token_ids, a.stats.tokens_per_step) == (b.token_ids, b.stats.tokens_per_step)
        assert set(static.widths) == {(buffer + 1) * block}
        assert max(dynamic.widths) <= (buffer + 1) * block and len(set(dynamic.widths)) > 1


def test_back_first_completions_never_overfill_the_buffer(tiny, prompts):
    """Blocks finishing out of order leave several to-cache blocks at once; a forward still holds
    at most buffer_size + 1 blocks, so the static width is always enough."""

    class Recorder(_BackFirst, _Widths):
        pass

    decoder = Recorder(4, 3, 0.0)
    dynamic = decoder.generate(tiny, [prompts[1]], max_new_tokens=30)[0]
    assert max(decoder.widths) == 16  # a to-cache block beside a full buffer: one block more
    static = _BackFirst(4, 3, 0.0, static=True).generate(tiny, [prompts[1]], max_new_tokens=30)[0]
    assert static.token_ids == dynamic.token_ids
