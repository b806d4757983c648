import math

import pytest

from fastforward.decoding.metrics import aup, aup_weight, speedup, token_agreement, tpf
from fastforward.errors import FastForwardError


def test_aup_hand_computed():
    # Points (TPF, accuracy %), given out of order; y1 = 80 (at the smallest TPF), so points below
    # 80 - 5 = 75 are dropped: (3, 70) goes, (4, 76) stays.
    points = [(4.0, 76.0), (1.0, 80.0), (3.0, 70.0), (2.0, 78.0)]
    # y_max = 80 (the best accuracy), so W(80) = 1,
    # W(78) = exp(-3 * (1 - 78/80)) = exp(-0.075), W(76) = exp(-3 * (1 - 76/80)) = exp(-0.15).
    f80, f78, f76 = 80.0, 78.0 * math.exp(-0.075), 76.0 * math.exp(-0.15)
    assert f78 == pytest.approx(72.36399, abs=1e-4)
    assert f76 == pytest.approx(65.41381, abs=1e-4)
    # AUP = 1 * 80 + (2 - 1) * (80 + 72.36399) / 2 + (4 - 2) * (72.36399 + 65.41381) / 2
    #     = 80 + 76.18200 + 137.77780 = 293.95980
    expected = 1.0 * f80 + (2 - 1) * (f80 + f78) / 2 + (4 - 2) * (f78 + f76) / 2
    assert expected == pytest.approx(293.9598, abs=1e-3)
    assert aup(points) == pytest.approx(expected, rel=1e-12)


def test_aup_single_point_and_explicit_y_max():
    assert aup([(2.0, 50.0)]) == pytest.approx(100.0)  # rho1 * y1 * W(y1) with W = 1
    # With y_max = 100: W(50) = exp(-1.5), so AUP = 2 * 50 * exp(-1.5).
    assert aup([(2.0, 50.0)], y_max=100.0) == pytest.approx(100.0 * math.exp(-1.5))
    assert aup_weight(120.0, 100.0) == 1.0  # capped at 1
    assert aup([(1.0, 0.0), (2.0, 0.0)]) == 0.0


def test_aup_bad_input():
    with pytest.raises(FastForwardError, match="at least one"):
        aup([])
    with pytest.raises(FastForwardError, match="percent"):
        aup([(1.0, 0.8), (2.0, 120.0)])
    with pytest.raises(FastForwardError, match="TPF"):
        aup([(0.0, 50.0)])


def test_token_agreement():
    assert token_agreement([1, 2, 3], [1, 2, 3]) == (True, 1.0)
    # positions 0 and 2 match, the longer has 4 tokens: 2 / 4
    assert token_agreement([1, 2, 3, 4], [1, 9, 3]) == (False, 0.5)
    assert token_agreement([], []) == (True, 1.0)
    assert token_agreement([5], []) == (False, 0.0)
    assert token_agreement([7, 8], [8, 7]) == (False, 0.0)


def test_tpf_and_speedup():
    assert tpf(12, 4) == 3.0
    assert tpf(0, 0) == 0.0 and tpf(1, 0) == 1.0  # a one-token answer came from the prefill: one forward's
    assert speedup(60.0, 30.0) == 2.0
    assert speedup(60.0, 0.0) == 0.0
