"""Reveal policies on hand-computed distributions.

Three masked positions with probabilities (1, 0, 0, 0), (½, ½, 0, 0) and (¼, ¼, ¼, ¼):
entropies 0, ln 2, ln 4 and confidences 1, ½, ¼.
"""

import math

import pytest
import torch

from fastforward.decoding.policies import (
    ConfidenceBounded,
    EntropyBounded,
    EntropyLeftmost,
    EntropyPrefix,
    Factor,
    Threshold,
    entropy_and_confidence,
    make_policy,
    most_confident,
)
from fastforward.decoding.sampling import greedy
from fastforward.errors import FastForwardError

NEG = -1e4  # a probability of exp(-1e4) is 0 in float32


def _logits(order=(0, 1, 2)):
    rows = {
        0: [0.0, NEG, NEG, NEG],
        1: [0.0, 0.0, NEG, NEG],
        2: [0.0, 0.0, 0.0, 0.0],
    }
    return torch.tensor([[rows[i] for i in order]])


def _count(policy, logits, masked=None):
    masked = torch.ones(logits.shape[:2], dtype=torch.bool) if masked is None else masked
    return int(policy(logits, masked).sum())


def test_entropy_and_confidence_by_hand():
    entropy, confidence = entropy_and_confidence(_logits())
    torch.testing.assert_close(entropy[0], torch.tensor([0.0, math.log(2), math.log(4)]))
    torch.testing.assert_close(confidence[0], torch.tensor([1.0, 0.5, 0.25]))


@pytest.mark.parametrize(("gamma", "expected"), [(0.0, 2), (0.69, 2), (0.70, 3), (math.inf, 3)])
def test_entropy_bound_sums_entropies_before_the_last(gamma, expected):
    # sorted entropies 0, ln2, ln4: exclusive prefix sums 0, 0, ln2 = 0.693
    assert _count(EntropyBounded(gamma), _logits((2, 0, 1))) == expected


def test_entropy_leftmost_reveals_the_leftmost_position_when_none_is_confident():
    logits = _logits((2, 1, 2))  # entropies ln4, ln2, ln4: the lowest is in the middle
    masked = torch.tensor([[False, True, True]])  # position 0 is filled
    assert EntropyLeftmost(0.5)(logits, masked).tolist() == [[False, True, False]]  # ln2 > γ: leftmost masked
    assert EntropyLeftmost(0.5)(logits, torch.ones(1, 3, dtype=torch.bool)).tolist() == [[True, False, False]]
    assert EntropyBounded(0.5)(logits, torch.ones(1, 3, dtype=torch.bool)).tolist() == [[False, True, False]]
    confident = _logits((2, 0, 1))  # entropies ln4, 0, ln2: position 1 is confident, so the rule is EB's
    assert torch.equal(
        EntropyLeftmost(0.5)(confident, torch.ones(1, 3, dtype=torch.bool)),
        EntropyBounded(0.5)(confident, torch.ones(1, 3, dtype=torch.bool)),
    )


def test_entropy_prefix_reveals_a_run_from_the_leftmost_masked_position():
    logits = _logits((0, 1, 2, 0))  # entropies 0, ln2, ln4, 0: sums in position order 0, ln2, 3 ln2, 3 ln2
    masked = torch.ones(1, 4, dtype=torch.bool)
    assert EntropyPrefix(0.0)(logits, masked).tolist() == [[True, False, False, False]]
    assert EntropyPrefix(0.7)(logits, masked).tolist() == [[True, True, False, False]]
    assert EntropyPrefix(2.1)(logits, masked).tolist() == [[True, True, True, True]]
    assert EntropyBounded(0.0)(logits, masked).tolist() == [[True, True, False, True]]  # entropy order: 0, 0, ln2
    first_filled = torch.tensor([[False, True, True, True]])
    assert EntropyPrefix(0.0)(logits, first_filled).tolist() == [[False, True, False, False]]  # at least one


@pytest.mark.parametrize(("gamma", "expected"), [(0.0, 2), (0.69, 2), (0.70, 3)])
def test_confidence_bound_subtracts_the_largest_entropy(gamma, expected):
    # by confidence: H = 0, ln2, ln4 → Σ − max = 0, 0, ln2
    assert _count(ConfidenceBounded(gamma), _logits((1, 2, 0))) == expected


@pytest.mark.parametrize(("f", "expected"), [(0.5, 1), (1.6, 2), (3.0, 2), (3.1, 3)])
def test_factor_rule(f, expected):
    # (n + 1)(1 − c_(n)) = 2·0, 3·0.5, 4·0.75 = 0, 1.5, 3
    assert _count(Factor(f), _logits()) == expected


@pytest.mark.parametrize(("tau", "expected"), [(0.9, 1), (0.5, 2), (0.2, 3), (1.1, 1)])
def test_threshold(tau, expected):
    assert _count(Threshold(tau), _logits()) == expected


def test_reveals_the_best_positions_and_never_unmasked_ones():
    logits = _logits((2, 1, 0))
    reveal = EntropyBounded(0.0)(logits, torch.ones(1, 3, dtype=torch.bool))
    assert reveal.tolist() == [[False, True, True]]  # entropies ln4, ln2, 0: the two cheapest
    masked = torch.tensor([[True, True, False]])
    assert EntropyBounded(math.inf)(logits, masked).tolist() == [[True, True, False]]
    assert EntropyBounded(0.0)(logits, masked).tolist() == [[False, True, False]]
    assert not EntropyBounded(0.0)(logits, torch.zeros(1, 3, dtype=torch.bool)).any()


def test_rows_are_independent():
    logits = torch.cat([_logits(), _logits((2, 2, 2))])
    reveal = EntropyBounded(0.5)(logits, torch.ones(2, 3, dtype=torch.bool))
    assert reveal.sum(-1).tolist() == [2, 1]


def test_make_policy_rejects_bad_input():
    with pytest.raises(FastForwardError, match="unknown reveal policy"):
        make_policy("greedy", 0.1)
    with pytest.raises(FastForwardError, match="gamma must be >= 0, got -0.1"):
        make_policy("entropy", -0.1)


def test_greedy_breaks_ties_like_argmax():
    """Every decoder's greedy choice goes through sampling.greedy (max(...).indices, faster than
    argmax on CPU): on ties it must pick the first maximum, as argmax does."""
    generator = torch.Generator().manual_seed(0)
    for vocab in (2, 5, 17, 513, 4099):
        logits = torch.randint(0, 3, (64, 16, vocab), generator=generator).float()  # ties everywhere
        assert torch.equal(greedy(logits), logits.argmax(-1))


def test_most_confident_picks_the_first_on_a_tie_among_the_given_positions():
    confidence = [0.9, 0.2, 0.7, 0.7, 0.1]
    assert most_confident(confidence, range(5)) == 0
    assert most_confident(confidence, [1, 3, 2, 4]) == 2
    assert most_confident(confidence, [4]) == 4


def _reference(policy, logits, masked):
    """Each policy's rule written out per row, position by position."""
    entropy, confidence = entropy_and_confidence(logits)
    reveal = torch.zeros_like(masked)
    for r in range(masked.shape[0]):
        open_ = [i for i in range(masked.shape[1]) if masked[r, i]]
        if isinstance(policy, EntropyPrefix):
            order = open_
        elif isinstance(policy, EntropyBounded):
            order = sorted(open_, key=lambda i: float(entropy[r, i]))
        else:
            order = sorted(open_, key=lambda i: -float(confidence[r, i]))
        h = [float(entropy[r, i]) for i in order]
        c = [float(confidence[r, i]) for i in order]
        n = 0
        for s in range(len(order)):
            if isinstance(policy, EntropyPrefix):
                ok = sum(h[: s + 1]) <= policy.gamma
            elif isinstance(policy, EntropyBounded):
                ok = sum(h[:s]) <= policy.gamma
            elif isinstance(policy, ConfidenceBounded):
                ok = sum(h[: s + 1]) - max(h[: s + 1]) <= policy.gamma
            elif isinstance(policy, Factor):
                ok = (s + 2) * (1 - c[s]) < policy.factor
            else:
                ok = c[s] >= policy.threshold
            if not ok:
                break
            n = s + 1
        for i in order[: max(n, 1)]:
            reveal[r, i] = True
    return reveal


@pytest.mark.parametrize(
    "policy",
    [
        EntropyBounded(0.0),
        EntropyBounded(0.8),
        EntropyBounded(math.inf),
        EntropyPrefix(0.0),
        EntropyPrefix(0.8),
        ConfidenceBounded(0.5),
        Factor(2.0),
        Threshold(0.3),
    ],
)
def test_policies_match_their_rule_written_out(policy):
    generator = torch.Generator().manual_seed(1)
    for _ in range(20):
        logits = torch.randn(3, 8, 11, generator=generator) * 3
        masked = torch.rand(3, 8, generator=generator) < 0.6
        masked[0] = True
        assert torch.equal(policy(logits, masked), _reference(policy, logits, masked))
