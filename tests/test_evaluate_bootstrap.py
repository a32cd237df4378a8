"""The paired bootstrap against its exact distribution, and its determinism."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from gradian.errors import ConfigError
from gradian.evaluate import bootstrap_deltas, paired_bootstrap, status_of_interval

# four items: base passed all, the tuned model lost items 0 and 2 and gained nothing
BASE = [1.0, 1.0, 1.0, 0.0]
TUNED = [0.0, 1.0, 0.0, 1.0]


def exact_distribution(differences):
    """Every one of the n**n equally likely resamples, enumerated: {mean delta: probability}."""
    d = np.asarray(differences, dtype=np.float64)
    n = d.size
    dist: dict[float, float] = {}
    for idx in itertools.product(range(n), repeat=n):
        value = float(d[list(idx)].mean())
        dist[value] = dist.get(value, 0.0) + 1.0 / n**n
    return dict(sorted(dist.items()))


def exact_quantile(dist, q):
    """Inverse of the exact distribution function: the smallest value whose CDF reaches q."""
    acc = 0.0
    for value, p in dist.items():
        acc += p
        if acc >= q - 1e-12:
            return value
    return value


def test_resample_frequencies_match_exhaustive_enumeration():
    d = np.subtract(TUNED, BASE)
    dist = exact_distribution(d)
    draws = 200_000
    deltas = bootstrap_deltas(d, draws, seed=7)
    values, counts = np.unique(deltas, return_counts=True)
    assert set(np.round(values, 12)) <= set(np.round(list(dist), 12))
    for value, p in dist.items():
        observed = counts[np.isclose(values, value)].sum() / draws
        sd = math.sqrt(p * (1 - p) / draws)
        assert abs(observed - p) < 5 * sd + 1e-12, (value, observed, p)


def test_moments_match_the_closed_form():
    d = np.array([0.0, -1.0, 0.5, -1.0, 0.0, 1.0, -0.5])
    deltas = bootstrap_deltas(d, 100_000, seed=3)
    # the resampled mean is unbiased for mean(d), with variance equal to the plug-in variance / n
    expected_var = d.var() / d.size
    assert abs(deltas.mean() - d.mean()) < 5 * math.sqrt(expected_var / deltas.size)
    assert deltas.var() == pytest.approx(expected_var, rel=0.02)


def test_interval_equals_the_exact_quantiles():
    d = np.subtract(TUNED, BASE)
    dist = exact_distribution(d)
    for level in (0.5, 0.8, 0.95):
        result = paired_bootstrap(BASE, TUNED, n_bootstrap=200_000, ci_level=level, seed=11)
        alpha = 1 - level
        assert result.ci == (exact_quantile(dist, alpha / 2), exact_quantile(dist, 1 - alpha / 2))
        assert result.delta == pytest.approx(-0.25)


def test_reruns_are_bit_identical_and_the_seed_matters():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 2, 40).astype(float)
    tuned = rng.integers(0, 2, 40).astype(float)
    a = bootstrap_deltas(tuned - base, 5000, seed=1234)
    b = bootstrap_deltas(tuned - base, 5000, seed=1234)
    assert a.tobytes() == b.tobytes()
    assert paired_bootstrap(base, tuned, 5000, 0.95, 1234) == paired_bootstrap(base, tuned, 5000, 0.95, 1234)
    assert bootstrap_deltas(tuned - base, 5000, seed=1235).tobytes() != a.tobytes()


def test_chunked_draws_cover_every_resample(monkeypatch):
    import gradian.evaluate.bootstrap as boot

    monkeypatch.setattr(boot, "_CHUNK_INDICES", 10)  # 2 resamples of 4 items per chunk
    deltas = bootstrap_deltas([1.0, -1.0, 0.0, 0.0], 9, seed=0)
    assert deltas.shape == (9,) and np.isfinite(deltas).all()


def test_every_item_lost_is_regressed_with_a_degenerate_interval():
    result = paired_bootstrap([1.0] * 16, [0.0] * 16, n_bootstrap=500, seed=0)
    assert result.ci == (-1.0, -1.0) and result.status == "regressed" and result.excludes_zero


def test_no_change_is_not_significant():
    result = paired_bootstrap([1.0, 0.0, 1.0], [1.0, 0.0, 1.0], n_bootstrap=500, seed=0)
    assert result.delta == 0.0 and result.ci == (0.0, 0.0) and result.status == "not_significant"


def test_one_flip_in_sixteen_does_not_clear_the_gate():
    base = [1.0] * 16
    tuned = [0.0] + [1.0] * 15
    result = paired_bootstrap(base, tuned, n_bootstrap=2000, seed=1234)
    assert result.status == "not_significant" and result.ci[1] == 0.0


def test_many_gains_are_improved():
    result = paired_bootstrap([0.0] * 12 + [1.0] * 4, [1.0] * 16, n_bootstrap=2000, seed=1)
    assert result.status == "improved" and result.ci[0] > 0


@pytest.mark.parametrize("lo,hi,status", [(-0.5, -0.1, "regressed"), (0.1, 0.3, "improved"),
                                          (-0.2, 0.0, "not_significant"), (0.0, 0.0, "not_significant")])
def test_status_of_interval(lo, hi, status):
    assert status_of_interval(lo, hi) == status


def test_bad_inputs_are_refused_with_the_key_named():
    with pytest.raises(ConfigError, match="evaluation.ci_level"):
        paired_bootstrap([1.0], [0.0], ci_level=1.5)
    with pytest.raises(ConfigError, match="evaluation.n_bootstrap"):
        paired_bootstrap([1.0], [0.0], n_bootstrap=0)
    with pytest.raises(ValueError, match="one base and one tuned score per item"):
        paired_bootstrap([1.0, 1.0], [0.0])
    with pytest.raises(ValueError, match="zero items"):
        paired_bootstrap([], [])
    with pytest.raises(ValueError, match="non-finite"):
        paired_bootstrap([float("nan")], [0.0])
