"""The attribution run: every lane joined into one report.

Public interface: ``run_attribution(config, ...) -> AttributionOutcome`` (the report dict, the
per-example rankings, the capability result and the paths written). ``gradian attribute`` and the
MLflow entry point both call it. ``index_from_config(config) -> IndexBuild``: the index a config
describes, loaded, built or reused (``gradian index`` calls it). ``run_until_recovered(config, plan,
...) -> RoundsOutcome``: counterfactual rounds that attribute each retrain again and remove its
accused rows too (``gradian counterfactual --until-recovered``).
"""

from gradian.attribution.index_build import IndexBuild, index_from_config

from gradian.attribution.pipeline import (AttributionOutcome, fill_from_run, rank_over_items, rank_values, rankings_frame,
                                         run_attribution)
from gradian.attribution.rounds import MAX_ROUNDS, RoundsOutcome, capability_back, run_until_recovered

__all__ = ["MAX_ROUNDS", "AttributionOutcome", "IndexBuild", "RoundsOutcome", "index_from_config", "fill_from_run",
           "rank_over_items", "rank_values", "rankings_frame", "run_attribution", "run_until_recovered", "capability_back"]
