"""The fidelity pipeline (LDS, leave-one-group-out, bootstrap comparison) on models whose answer is known.

- a linear datamodel (the loss of a subset is exactly a sum over its examples): the oracle's
  scores give LDS 1, the negated oracle -1, random scores about 0;
- ridge regression, retrained exactly on every subset: first-order influence scores, computed
  with the sign convention of ``gradian.engines``, order the retrains well, and random ones do not.
"""

from __future__ import annotations

import numpy as np
import pytest

from gradian.counterfactual import (
    compare_rankings,
    group_removal_sums,
    group_removal_table,
    lds_difference,
    lds_table,
    linear_datamodeling_score,
    sample_subsets,
    spearman,
    subset_score_sums,
)


def test_subsets_are_exact_halves_and_reproducible():
    masks = sample_subsets(101, 40, seed=3)
    assert masks.shape == (40, 101) and (masks.sum(axis=1) == 50).all()
    assert (masks == sample_subsets(101, 40, seed=3)).all()
    assert not (masks == sample_subsets(101, 40, seed=4)).all()
    assert len({m.tobytes() for m in masks}) == 40
    with pytest.raises(ValueError, match="fraction"):
        sample_subsets(10, 4, fraction=1.0)
    with pytest.raises(ValueError, match="at least 2"):
        sample_subsets(10, 1)


def test_sums_and_spearman_basics():
    masks = np.array([[1, 0, 1], [0, 1, 1]], dtype=bool)
    assert subset_score_sums(masks, [1.0, 2.0, 4.0]).tolist() == [5.0, 6.0]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(spearman([1, 1, 1], [1, 2, 3]))
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # scipy's value with ties
    assert group_removal_sums([[0, 2], [1]], [1.0, 2.0, 4.0]).tolist() == [5.0, 2.0]
    with pytest.raises(ValueError, match="scores"):
        subset_score_sums(masks, [1.0, 2.0])


def _linear_world(n=300, k=64, noise=0.0, seed=0):
    """phi(S) = 3 - sum_{i in S} effect_i / n (+ noise): a datamodel that is exactly linear.

    ``effect_i > 0`` means example i lowers the loss, so the oracle's scores *are* the effects.
    """
    rng = np.random.default_rng(seed)
    effects = rng.standard_normal(n) * np.where(rng.random(n) < 0.1, 8.0, 1.0)
    masks = sample_subsets(n, k, seed=seed + 1)
    losses = 3.0 - subset_score_sums(masks, effects) / n + noise * rng.standard_normal(k)
    return effects, masks, losses


def test_perfect_oracle_scores_lds_one_and_its_negation_minus_one():
    effects, masks, losses = _linear_world()
    assert linear_datamodeling_score(losses, masks, effects) == pytest.approx(1.0)
    assert linear_datamodeling_score(losses, masks, -effects) == pytest.approx(-1.0)
    noisy_effects, noisy_masks, noisy_losses = _linear_world(noise=0.005)
    assert linear_datamodeling_score(noisy_losses, noisy_masks, noisy_effects) > 0.9


def test_random_scores_score_about_zero():
    effects, masks, losses = _linear_world()
    rng = np.random.default_rng(11)
    values = [linear_datamodeling_score(losses, masks, rng.standard_normal(effects.size)) for _ in range(40)]
    assert abs(np.mean(values)) < 0.06
    assert np.std(values) < 0.2  # about 1/sqrt(k - 1) for k = 64 subsets


def test_comparison_names_the_winner_with_intervals():
    effects, masks, losses = _linear_world(noise=0.002)
    rng = np.random.default_rng(5)
    table = lds_table(losses, masks, {"random": rng.standard_normal(effects.size), "oracle": effects,
                                      "blurred": effects + 2 * rng.standard_normal(effects.size)},
                      n_bootstrap=500, seed=1)
    assert table["best"] == "oracle" and table["ranking"][0] == "oracle" and table["ranking"][-1] == "random"
    oracle = table["engines"]["oracle"]
    assert oracle["ci"][0] > 0.9 and oracle["ci"][0] <= oracle["spearman"] <= oracle["ci"][1]
    lo, hi = table["engines"]["random"]["ci"]
    assert lo < 0 < hi
    assert table["margins"]["random"]["ci"][0] > 0 and table["margins"]["random"]["share_best_wins"] == 1.0
    assert table["margins"]["blurred"]["difference"] > 0
    assert table["n"] == 64 and table["n_bootstrap"] == 500


def test_leave_one_group_out_on_the_linear_world():
    effects, _, _ = _linear_world()
    groups = [list(range(i, i + 30)) for i in range(0, 300, 30)]
    deltas = group_removal_sums(groups, effects) / 300  # removing c raises the loss by its summed effect / n
    table = group_removal_table(deltas, groups, {"oracle": effects, "negated": -effects}, n_bootstrap=200)
    assert table["engines"]["oracle"]["spearman"] == pytest.approx(1.0)
    assert table["engines"]["negated"]["spearman"] == pytest.approx(-1.0)
    assert table["best"] == "oracle" and table["n"] == 10


def test_constant_measurements_give_no_correlation():
    masks = sample_subsets(20, 8)
    table = compare_rankings(np.ones(8), {"a": np.arange(8.0)}, n_bootstrap=50)
    assert np.isnan(table["engines"]["a"]["spearman"]) and table["engines"]["a"]["ci"] == [None, None]
    with pytest.raises(ValueError, match="predicts"):
        compare_rankings(np.ones(8), {"a": np.arange(7.0)})
    assert masks.shape == (8, 20)


# -- ridge regression: real retrains, first-order influence -----------------------------------------


def _ridge(X, y, lam):
    return np.linalg.solve(X.T @ X + lam * np.eye(X.shape[1]), X.T @ y)


def _test_loss(theta, Xt, yt):
    return float(np.mean((Xt @ theta - yt) ** 2))


def test_influence_scores_order_ridge_retrains():
    """Scores with the project's sign (positive: the example lowered the test loss) give a high LDS."""
    rng = np.random.default_rng(0)
    n, d, lam = 200, 6, 1.0
    w = rng.standard_normal(d)
    X = rng.standard_normal((n, d))
    y = X @ w + 0.1 * rng.standard_normal(n)
    bad = rng.choice(n, 25, replace=False)
    y[bad] += 3.0 * np.sign(X[bad, 0])  # planted rows that pull the fit away from the truth
    Xt = rng.standard_normal((30, d))
    yt = Xt @ w

    theta = _ridge(X, y, lam)
    H = 2 * (X.T @ X + lam * np.eye(d))  # Hessian of sum_i (x_i.theta - y_i)^2 + lam |theta|^2
    g_test = 2 * ((Xt @ theta - yt)[:, None] * Xt).mean(axis=0)
    g_train = 2 * (X @ theta - y)[:, None] * X
    # removing i moves theta by +H^-1 g_i, so the test loss by g_test.H^-1 g_i = score_i / n
    scores = n * g_train @ np.linalg.solve(H, g_test)

    masks = sample_subsets(n, 48, seed=2)
    losses = [_test_loss(_ridge(X[m], y[m], lam), Xt, yt) for m in masks]
    lds = linear_datamodeling_score(losses, masks, scores)
    assert lds > 0.6, lds
    assert scores[bad].mean() < 0 < np.delete(scores, bad).mean()  # the planted rows are the harmful ones
    noise = [linear_datamodeling_score(losses, masks, rng.standard_normal(n)) for _ in range(20)]
    assert abs(np.mean(noise)) < 0.1


def test_lds_difference_pairs_two_engines_on_the_same_resamples():
    """``lds_difference``: scores that predict the measured losses exactly are ahead of scores that
    predict them backwards by +2, with an interval above zero; swapped, the sign flips."""
    rng = np.random.default_rng(0)
    masks = rng.random((40, 30)) < 0.5
    truth = rng.normal(size=30)
    losses = list(-(masks * truth).sum(axis=1))
    got = lds_difference(losses, masks, truth, -truth, n_bootstrap=500, seed=0)
    assert got["difference"] == pytest.approx(2.0) and 0 < got["ci"][0] <= got["ci"][1] and got["share_ahead"] == 1.0
    back = lds_difference(losses, masks, -truth, truth, n_bootstrap=500, seed=0)
    assert back["difference"] == pytest.approx(-2.0) and back["ci"][1] < 0
