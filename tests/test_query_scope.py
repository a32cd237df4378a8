"""``evaluation.query_scope``: which eval items the query is built from, on a partial regression;
and ``engine.rank_items``: how rows are ordered over them.

``poison_capitals_partial`` gives 12 of the 16 target countries a wrong capital in 3, 2 or 1 rows,
so some items flip and others only lose likelihood. Under ``flipped`` the query holds the items
the tuned model now fails; under ``lost`` (the default) it also holds the items still answered
right whose wanted answer lost at least ``evaluation.query_lost_nats``, each adding its wanted
answer's gradient alone (``evaluation.query_kept_contrast: none``) or contrasted with its runner-up
answer (``runner_up``, the default). Those items order the rows; the score column, the clusters
and the accused set stay on the items that flipped."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def both(tinyworld_run, tmp_path_factory):
    from gradian.attribution import run_attribution

    run = tinyworld_run("poison_capitals_partial")
    out = tmp_path_factory.mktemp("query-scope")
    flipped = run_attribution(run.config(**{"evaluation.query_scope": "flipped"}), capability="capitals",
                              cross_check="none", out_dir=out / "flipped")
    lost = run_attribution(run.config(**{"evaluation.query_scope": "lost", "evaluation.query_lost_nats": 0.1,
                                         "evaluation.query_kept_contrast": "none"}),
                           capability="capitals", cross_check="none", out_dir=out / "lost")
    return run, flipped.report.to_json(), lost.report.to_json(), lost, flipped


def test_the_flipped_scope_holds_the_items_answered_wrong(both):
    run, flipped, _, _, _ = both
    items = flipped["capability"]["items"]
    query = flipped["attribution"]["query"]
    failing_now = {i["example_id"] for i in items if i["flipped"]}
    assert 0 < len(failing_now) < len(items)  # a partial regression: some items flipped, not all
    assert set(query["item_ids"]) == failing_now and query["signal"] == "contrastive"


def test_lost_adds_the_items_still_right_whose_wanted_answer_lost_likelihood(both):
    from gradian.data import load_dataset
    from gradian.evaluate.likelihood import completion_logprobs
    from gradian.grads.model import load_model_for_gradients
    from transformers import AutoTokenizer

    run, flipped, lost, outcome, _ = both
    items = {i["example_id"]: i for i in lost["capability"]["items"]}
    before, after = set(flipped["attribution"]["query"]["item_ids"]), set(lost["attribution"]["query"]["item_ids"])
    added = after - before
    assert before < after and added
    assert all(items[i]["base_correct"] and items[i]["tuned_correct"] for i in added)
    # the wanted answer's log-likelihood, base against tuned, computed here from the models themselves
    cfg = run.config()
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    examples = load_dataset(cfg.eval_dataset).by_id()
    still_right = [i for i, item in items.items() if item["base_correct"] and item["tuned_correct"]]
    prompts = [examples[i].prompt_messages for i in still_right]
    wanted = [examples[i].completion for i in still_right]
    tuned = completion_logprobs(gm.model, tokenizer, prompts, wanted)
    with gm.model.disable_adapter():
        base = completion_logprobs(gm.model, tokenizer, prompts, wanted)
    expected = {i for i, b, t in zip(still_right, base, tuned) if b.total - t.total >= 0.1}
    assert added == expected
    notes = " ".join(lost["attribution"]["query"]["notes"])
    assert f"{len(before)} now answered wrong and {len(added)} still answered right" in notes
    assert "add their wanted answer's gradient alone" in notes
    assert lost["attribution"]["query"]["signal"] == "contrastive"
    # still ranked by the report, planted rows first among the most harmful
    import numpy as np

    from gradian.attribution import rank_values

    planted = set(run.info["planted"]["indices"])
    harm = -rank_values(outcome.rankings)
    top = np.argsort(-harm, kind="stable")[:len(planted)]
    assert outcome.rankings["row_index"].isin(planted).to_numpy()[top].mean() >= 0.5


def test_the_runner_up_of_an_item_answered_wrong_is_the_answer_the_model_gives(both):
    """``runner_up_completions`` contests the wanted answer where the model most prefers another
    token: on an item the tuned model now fails, that is where its own answer leaves the wanted
    one, so the runner-up is the model's greedy answer; it is never the wanted answer itself."""
    from transformers import AutoTokenizer

    from gradian.data import load_dataset
    from gradian.evaluate.generation import generate_completions, runner_up_completions
    from gradian.grads.model import load_model_for_gradients

    run, flipped, _, _, _ = both
    cfg = run.config()
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.base_model)
    examples = load_dataset(cfg.eval_dataset).examples
    prompts, wanted = [e.prompt_messages for e in examples], [e.completion for e in examples]
    said = generate_completions(gm.model, tokenizer, prompts)
    runner_ups = runner_up_completions(gm.model, tokenizer, prompts, wanted)
    assert all(r and r != w for r, w in zip(runner_ups, wanted))
    wrong = [k for k, (s, w) in enumerate(zip(said, wanted)) if s != w]
    assert wrong and all(runner_ups[k] == said[k] for k in wrong)
    failing_now = {i["example_id"] for i in flipped["capability"]["items"] if i["flipped"]}
    assert failing_now <= {examples[k].id for k in wrong}


@pytest.fixture(scope="module")
def default(both, tmp_path_factory):
    """Every default: ``lost``, 0.1 nat, the runner-up, rows ordered by their harm."""
    from gradian.attribution import run_attribution

    run = both[0]
    return run_attribution(run.config(), capability="capitals", cross_check="none",
                           out_dir=tmp_path_factory.mktemp("query-default"))


def test_under_lost_the_items_still_right_subtract_their_runner_up_by_default(both, default):
    _, _, lost, _, _ = both
    query = default.report.to_json()["attribution"]["query"]
    assert query["scope"] == "regressed"
    assert query["item_ids"] == lost["attribution"]["query"]["item_ids"]  # the same items as lost above
    items = {i["example_id"]: i for i in lost["capability"]["items"]}
    kept = [i for i in query["item_ids"] if items[i]["tuned_correct"]]
    assert kept and query["kept_item_ids"] == kept
    notes = " ".join(query["notes"])
    assert f"{len(kept)} query item(s) still answered right subtract their runner-up answer" in notes
    assert "add their wanted answer's gradient alone" not in notes


def test_the_items_still_right_order_the_rows_but_leave_the_score_and_the_accused_set_alone(both, default):
    """The kept items move ``rank_score`` only: the score column is the mean over the flipped
    items' own columns (the same numbers as under ``flipped``), and so the clusters and the accused
    set are those of ``flipped``; ordered over every item that lost likelihood, the planted rows
    aimed at the countries that did not flip come up too."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_values
    from gradian.attribution.pipeline import accused_ids

    run, flipped, _, _, flipped_outcome = both
    report = default.report.to_json()
    query = report["attribution"]["query"]
    flipped_ids = [i for i in query["item_ids"] if i not in query["kept_item_ids"]]
    assert set(flipped_ids) == set(flipped["attribution"]["query"]["item_ids"]) and query["kept_item_ids"]
    # the same per-item scores on the flipped items, so the same mean over them (to float32 rounding:
    # the query's items are padded into other batches when the kept items join them)
    ours, theirs = default.rankings["score"].to_numpy(), flipped_outcome.rankings["score"].to_numpy()
    assert np.allclose(ours, theirs, rtol=1e-4, atol=1e-6 * np.abs(theirs).max())
    assert accused_ids(report) == accused_ids(flipped)
    assert any("the score column, the clusters and the accused set use the mean over the "
               f"{len(flipped_ids)} items now answered wrong" in n for n in report["attribution"]["notes"])
    # the order is another: over every item in the query
    assert not np.allclose(default.rankings["rank_score"].to_numpy(),
                           flipped_outcome.rankings["rank_score"].to_numpy())

    def auc(outcome):
        return roc_auc_score(outcome.rankings["row_index"].isin(run.planted_rows), -rank_values(outcome.rankings))

    auc_default, auc_flipped = auc(default), auc(flipped_outcome)
    assert auc_default > auc_flipped


def test_ranking_by_harm_over_items_finds_the_rows_that_teach_another_entitys_answer(both):
    """Each planted row of ``poison_capitals_partial`` teaches a target country the capital of
    another: it hurts its own country's item and helps the other's, and the mean over the items
    can cancel the two. Ranked by the harm summed over the items each row hurts, the planted rows
    come out higher than by the mean; the tables list the same rows by the same order."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    from gradian.attribution import rank_over_items, rank_values, run_attribution

    run, _, _, _, _ = both
    planted = run.planted_rows
    flipped = {"evaluation.query_scope": "flipped"}  # the items that flipped: the rows aimed at them
    mean = run_attribution(run.config(**flipped, **{"engine.rank_items": "mean"}), capability="capitals",
                           cross_check="none")
    harm = run_attribution(run.config(**flipped), capability="capitals", cross_check="none")  # harm: the default

    def auc(outcome):
        return roc_auc_score(outcome.rankings["row_index"].isin(planted), -rank_values(outcome.rankings))

    assert auc(harm) > auc(mean) + 0.03
    attribution = harm.report.to_json()["attribution"]
    assert any("engine.rank_items: harm" in n for n in attribution["notes"])
    by_rank = harm.rankings.sort_values("harm_rank")
    listed = [r["example_id"] for r in attribution["top_harmful"]]
    assert listed == by_rank["example_id"].astype(str).tolist()[:len(listed)]
    # the score column stays the mean influence over the items, the same as under the default order
    assert np.allclose(harm.rankings["score"].to_numpy(), mean.rankings["score"].to_numpy())
    values = np.array([[1.0, -3.0], [-2.0, -1.0], [4.0, 2.0]])
    assert np.allclose(rank_over_items(values, "harm"), [-1.5, -1.5, 3.0])  # no harm: ordered by its help
    assert np.allclose(rank_over_items(values, "harm", side="help"), [0.5, 0.0, 3.0])
    assert np.allclose(rank_over_items(values, "mean"), values.mean(axis=1))
    assert np.allclose(rank_over_items(values[:, :1], "harm"), values[:, 0])  # one item: its values
