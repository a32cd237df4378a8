"""``evaluation.query_scope``: which eval items the query is built from, on a partial regression.

``poison_capitals_partial`` gives 12 of the 16 target countries a wrong capital in 3, 2 or 1 rows,
so some items flip and others only lose likelihood. Under ``flipped`` (the default) the query holds
the items the tuned model now fails; under ``lost`` it also holds the items still answered right
whose wanted answer lost at least ``evaluation.query_lost_nats``, each adding its wanted answer's
gradient alone.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("torch")


@pytest.fixture(scope="module")
def both(tinyworld_run, tmp_path_factory):
    from gradian.attribution import run_attribution

    run = tinyworld_run("poison_capitals_partial")
    out = tmp_path_factory.mktemp("query-scope")
    flipped = run_attribution(run.config(), capability="capitals", cross_check="none", out_dir=out / "flipped")
    lost = run_attribution(run.config(**{"evaluation.query_scope": "lost", "evaluation.query_lost_nats": 0.1}),
                           capability="capitals", cross_check="none", out_dir=out / "lost")
    return run, flipped.report.to_json(), lost.report.to_json(), lost


def test_the_default_query_holds_the_flipped_items(both):
    run, flipped, _, _ = both
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

    run, flipped, lost, outcome = both
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
