"""Counterfactual retraining: drop the accused examples, retrain, and see if the capability returns.

An attribution names the training examples it believes degraded a capability; this stage puts
that claim to the only test that settles it. It removes the accused set (or the accused cluster, or
a given list of example ids), retrains from the same base model with the same recipe and seed, measures the
capability again, and reports:

- recovery: base, original and retrained scores, the share of the loss recovered, and for pass/fail
  metrics how many items remain below the base;
- removal precision and recall, when the truly bad rows are known (tinyworld's planted rows);
- the accusing attribution's scores summed over the whole set and over the kept rows, and whether
  the sign changed (the data was net harmful, and is net helpful once the accused rows are gone).

Public interface: ``plan_removal`` / ``load_report`` / ``parse_id_list`` -> ``RemovalPlan``; ``load_planted``;
``run_counterfactual(cfg, plan, ...) -> CounterfactualOutcome`` (rounds of it, attributing each
retrain again, are ``gradian.attribution.run_until_recovered``); ``retrain_config``;
``write_kept_rows``; the pure figures ``capability_recovery``, ``removal_precision``,
``predicted_score_sums``, ``counterfactual_outcome`` and ``OUTCOMES``; and, for checking scores
against many retrains at once (``gradian.counterfactual.datamodel``), ``sample_subsets``,
``subset_score_sums``, ``spearman``, ``linear_datamodeling_score``, ``group_removal_sums``,
``compare_rankings``, ``lds_table``, ``lds_difference`` and ``group_removal_table``.
``gradian counterfactual`` is the command line.
"""

from gradian.counterfactual.datamodel import (
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
from gradian.counterfactual.experiment import (
    KEPT_DATA_FILE,
    RETRAIN_SUBDIR,
    CounterfactualOutcome,
    retrain_config,
    run_counterfactual,
)
from gradian.counterfactual.figures import (
    OUTCOMES,
    capability_recovery,
    counterfactual_outcome,
    predicted_score_sums,
    removal_precision,
)
from gradian.counterfactual.selection import DROP_CHOICES, RemovalPlan, load_planted, load_report, parse_id_list, plan_removal
from gradian.counterfactual.subset import write_kept_rows

__all__ = [
    "DROP_CHOICES",
    "KEPT_DATA_FILE",
    "OUTCOMES",
    "RETRAIN_SUBDIR",
    "CounterfactualOutcome",
    "RemovalPlan",
    "capability_recovery",
    "compare_rankings",
    "counterfactual_outcome",
    "group_removal_sums",
    "group_removal_table",
    "lds_difference",
    "lds_table",
    "linear_datamodeling_score",
    "load_planted",
    "load_report",
    "parse_id_list",
    "plan_removal",
    "predicted_score_sums",
    "removal_precision",
    "retrain_config",
    "run_counterfactual",
    "sample_subsets",
    "spearman",
    "subset_score_sums",
    "write_kept_rows",
]
