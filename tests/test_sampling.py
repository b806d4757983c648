"""Sampling with every decoder: the verifying decoders sample exactly the model's distribution (AR's
own tokens for the same seed), a seeded row samples alike in any batch, the mask decoders sample
what they reveal, and a wrong acceptance rule is caught."""

from collections import Counter

import pytest
import torch

from fastforward.api import build_decoder
from fastforward.decoding.decoders import ARDecoder, JacobiDecoder, SBDDecoder, VerifiedSBDDecoder
from fastforward.decoding.policies import EntropyBounded
from fastforward.decoding.runtime import Prompt, Session
from fastforward.decoding.sampling import BatchSampler, Sampler, greedy, uniforms
from fastforward.model import Layout, visibility

SAMPLER = Sampler(temperature=1.0, top_p=0.75)
KNOBS = {"temperature": SAMPLER.temperature, "top_p": SAMPLER.top_p}
TOKENS = 4  # the sampled sequences compared: the first TOKENS tokens of each output
SAMPLES = 2000  # one batch of identical prompts, a seed per row
ALPHA = 1e-3  # significance level; every draw is seeded, so a pass or a failure is the same on every run


def target(logits: torch.Tensor, sampler: Sampler) -> torch.Tensor:
    """The sampling distribution over the last axis, written out independently of `Sampler`:
    softmax(logits / T), cut to the most probable tokens whose mass before each is at most top_p."""
    probs = torch.softmax(logits.double() / sampler.temperature, dim=-1)
    ordered, order = probs.sort(dim=-1, descending=True)
    ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered > sampler.top_p, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, ordered)
    return kept / kept.sum(-1, keepdim=True)


def sequence_probabilities(model, prompt: list[int], length: int, floor: float) -> dict[tuple[int, ...], float]:
    """The exact probability, under AR sampling, of every `length`-token continuation at least
    `floor` likely (a sequence is never likelier than its prefix, so the tree is cut there)."""
    level: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        heads = list(level)
        with torch.inference_mode():
            logits = model.hf(torch.tensor([prompt + list(h) for h in heads])).logits[:, -1]
        level = {
            (*head, token): level[head] * q
            for head, row in zip(heads, target(logits, SAMPLER).tolist(), strict=True)
            for token, q in enumerate(row)
            if level[head] * q >= floor
        }
    return level


def chi_square(samples: list[tuple[int, ...]], probabilities: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """Pearson's chi-square statistic of the samples against the probabilities, and its p-value: a
    bin for each sequence expected at least 5 times, the others (and any sequence not listed) pooled
    into one bin, itself expected at least 5 times."""
    counts, n = Counter(samples), len(samples)
    bins = sorted((n * p, counts[s]) for s, p in probabilities.items())  # (expected, observed), rarest first
    rest = [n - sum(e for e, _ in bins), n - sum(o for _, o in bins)]
    while bins and (bins[0][0] < 5 or rest[0] < 5):
        expected, observed = bins.pop(0)
        rest = [rest[0] + expected, rest[1] + observed]
    stat = sum((o - e) ** 2 / e for e, o in [*bins, rest])
    dof = torch.tensor(len(bins) / 2, dtype=torch.float64)  # (bins - 1) / 2, the pooled bin included
    return stat, torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)).item()


@pytest.fixture(scope="module")
def prompt(tiny) -> list[int]:
    """A raw prompt cut where greedy decoding starts repeating a token (…, 155 → 176 176 176): the
    likely continuations repeat their last token, so Jacobi drafts (copies of it) and n-gram drafts
    are accepted often, and rejected often."""
    ids = tiny.encode_prompt("0", chat_template=False)
    greedy_run = ARDecoder().generate(tiny, [ids], 16)[0].token_ids
    repeat = next(i for i in range(len(greedy_run) - 1) if greedy_run[i] == greedy_run[i + 1])
    return ids + greedy_run[:repeat]


@pytest.fixture(scope="module")
def exact(tiny, prompt) -> dict[tuple[int, ...], float]:
    return sequence_probabilities(tiny, prompt, TOKENS, 5 / SAMPLES)


@pytest.fixture(scope="module")
def ar_samples(tiny, prompt) -> list[tuple[int, ...]]:
    rows = [Prompt(prompt, seed=seed) for seed in range(SAMPLES)]
    return [tuple(g.token_ids) for g in build_decoder("ar", **KNOBS).generate(tiny, rows, TOKENS)]


class _GreedyDrafts(VerifiedSBDDecoder):
    """Drafts the prompt's greedy continuation, whatever the row sampled (a one-hot drafter that
    ignores the draws): the tiny model's untrained masks would almost never be accepted."""

    def __init__(self, truth: list[int], block_size: int):
        super().__init__(block_size, sampler=SAMPLER)
        self.truth = truth

    def _reveal(self, session, logits, candidates, own):
        for row, masked in zip(session.rows, candidates, strict=True):
            start, draft = row.state.start, row.state.draft
            for j, candidate in enumerate(masked[: len(draft)]):
                if candidate:
                    draft[j] = self.truth[min(start + j, len(self.truth) - 1)]


class _GreedyAcceptance(BatchSampler):
    """The broken rule: a draft equal to the greedy prediction is kept whatever the draw says; only
    where a draft is not kept is the token sampled."""

    def __init__(self, session: Session):
        super().__init__(session.rows, session.device)
        self.session = session

    def sample(self, logits, positions):
        tokens = super().sample(logits, positions)
        if logits.dim() == 3 and logits.shape[1] > 1:  # a Jacobi forward: [last ; drafts] → predictions
            drafts = self.session.fed[:, 1:]
            tokens[:, :-1] = torch.where(drafts == greedy(logits[:, :-1]), drafts, tokens[:, :-1])
        return tokens


class _BrokenJacobi(JacobiDecoder):
    """Jacobi sampling with the broken rule: every step's session remembers the tokens it feeds
    (`fed`) and samples with `_GreedyAcceptance` over its rows of the moment."""

    def step(self, session):
        forward = Session.forward.__get__(session)

        def feeding(tokens, *args, **kwargs):
            session.fed = tokens
            return forward(tokens, *args, **kwargs)

        session.forward = feeding
        session.sampler = _GreedyAcceptance(session)
        super().step(session)


def _verifier(name: str, tiny, prompt: list[int]):
    if name == "greedy-drafts":  # sbd-verified verifying one-hot drafts it did not sample
        return _GreedyDrafts(ARDecoder().generate(tiny, [prompt], 24)[0].token_ids, 3)
    knobs = {"jacobi": {"block_size": 3}, "jacobi-mr": {"block_size": 3}, "lookup": {"min_match": 1}}
    return build_decoder(name, **knobs.get(name, {}), **KNOBS)


@pytest.mark.parametrize(
    ("name", "rows"),
    [("ar", SAMPLES), ("jacobi", SAMPLES), ("sbd-verified", SAMPLES), ("greedy-drafts", SAMPLES), ("lookup", 400),
     ("jacobi-mr", 400)],
)  # fmt: skip
def test_verifying_decoders_sample_the_models_distribution(tiny, prompt, exact, ar_samples, name, rows):
    """Each decoder's first tokens, one sample per seed, pass a chi-square test against the exact
    AR sampling distribution, and are AR's own samples for the same seeds (lookup and jacobi-mr, whose
    forwards carry more tokens a row, on fewer seeds)."""
    gens = _verifier(name, tiny, prompt).generate(tiny, [Prompt(prompt, seed=s) for s in range(rows)], TOKENS)
    samples = [tuple(g.token_ids) for g in gens]
    stat, p_value = chi_square(samples, exact)
    assert p_value > ALPHA, (stat, p_value)
    assert samples == ar_samples[:rows]
    if name not in ("ar", "sbd-verified"):  # drafts were accepted, so acceptance was tested
        assert any(k > 1 for g in gens for k in g.stats.tokens_per_step)


def test_greedy_acceptance_of_sampled_drafts_fails_the_test(tiny, prompt, exact):
    """The chi-square test has the power to catch a wrong acceptance rule: Jacobi that keeps drafts
    equal to the greedy prediction is far off the model's distribution."""
    rows = [Prompt(prompt, seed=seed) for seed in range(SAMPLES)]
    gens = _BrokenJacobi(3, sampler=SAMPLER).generate(tiny, rows, TOKENS)
    stat, p_value = chi_square([tuple(g.token_ids) for g in gens], exact)
    assert p_value < ALPHA, (stat, p_value)


@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("ar", {}),
        ("jacobi", {"block_size": 3}),
        ("sbd-verified", {"block_size": 4}),
        ("sbd", {"block_size": 4, "gamma": 1.0}),
        ("setdlm", {"window": 3, "threshold": 0.5}),
    ],
)
def test_a_seeded_prompt_samples_alike_alone_and_in_any_batch(tiny, prompts, name, knobs):
    decoder = build_decoder(name, **knobs, **KNOBS, seed=5)
    rows = [Prompt(p, seed=s) for p, s in zip(prompts, (None, 1, 2, None), strict=True)]  # None: the decoder's
    alone = [decoder.generate(tiny, [row], 12)[0].token_ids for row in rows]
    assert [g.token_ids for g in decoder.generate(tiny, rows, 12)] == alone
    assert [g.token_ids for g in decoder.generate(tiny, rows[::-1], 12)] == alone[::-1]
    assert [g.token_ids for g in decoder.generate(tiny, [rows[1], rows[1]], 12)] == [alone[1]] * 2
    # a row's own seed stands for the decoder's
    assert build_decoder(name, **knobs, **KNOBS, seed=1).generate(tiny, [prompts[1]], 12)[0].token_ids == alone[1]


def test_sampled_sbd_with_blocks_of_one_is_sampled_ar(tiny, prompts):
    """A block of one whose token is the next-token prediction is an AR step, draw included."""
    sbd = SBDDecoder(1, EntropyBounded(0.0), sampler=SAMPLER, first_token_from_ntp=True)
    rows = [Prompt(p, seed=s) for s, p in enumerate(prompts)]
    assert [g.token_ids for g in sbd.generate(tiny, rows, 16)] == [
        g.token_ids for g in ARDecoder(SAMPLER).generate(tiny, rows, 16)
    ]


def test_sbd_samples_each_revealed_position_from_its_distribution(tiny, prompt):
    """γ = inf reveals a whole block in its first forward: over many seeds, each position's token
    follows the distribution that forward predicts for it (the mask logits, at the temperature)."""
    size, rows = 3, 600
    decoder = SBDDecoder(size, EntropyBounded(float("inf")), sampler=SAMPLER)
    gens = decoder.generate(tiny, [Prompt(prompt, seed=s) for s in range(rows)], size)
    cache, n = tiny.new_cache(), len(prompt)
    with torch.inference_mode():
        tiny.run(Layout(torch.tensor([prompt]), torch.arange(n)[None], None), cache)
        block = torch.full((1, size), tiny.mask_token_id)
        mask = visibility.over_cache(visibility.sbd_decode(0, size), n)
        logits = tiny.run(Layout(block, torch.arange(n, n + size)[None], mask, read=torch.arange(size)), cache)
    for position, probs in enumerate(target(logits[0], SAMPLER).tolist()):
        tokens = [(g.token_ids[position],) for g in gens]
        stat, p_value = chi_square(tokens, {(t,): q for t, q in enumerate(probs) if q > 0})
        assert p_value > ALPHA, (position, stat, p_value)


@pytest.mark.parametrize(
    ("name", "knobs"),
    [("sbd", {"block_size": 4, "gamma": 1.0}), ("mbd", {"block_size": 4, "accept_threshold": 0.5}), ("setdlm", {})],
)
def test_mask_decoders_sample_what_they_reveal(tiny, prompts, name, knobs):
    def run(**sampling) -> list[list[int]]:
        return [g.token_ids for g in build_decoder(name, **knobs, **sampling).generate(tiny, prompts, 12)]

    greedy_run = run()
    assert run(temperature=1.0, top_p=1e-9) == greedy_run  # only the most probable token is kept: greedy
    assert run(**KNOBS, seed=0) == run(**KNOBS, seed=0) != run(**KNOBS, seed=1)
    assert run(**KNOBS, seed=0) != greedy_run


def test_uniform_draws_depend_on_key_and_position_alone():
    keys = torch.tensor([3, 3, 9])
    at = torch.arange(20_000).reshape(1, -1).expand(3, -1)
    draws = uniforms(keys, at)
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    assert torch.equal(uniforms(keys[2:], at[2:, 7_000:7_003]), draws[2:, 7_000:7_003])
    assert draws.min() > 0 and draws.max() < 1
    counts = torch.histc(draws[::2].flatten(), bins=20, min=0, max=1)  # two keys' 40,000 draws
    stat = ((counts - 2_000) ** 2 / 2_000).sum()
    assert torch.special.gammaincc(torch.tensor(9.5), stat / 2) > ALPHA
