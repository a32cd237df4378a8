"""Faults and bad input: each scenario is built to produce one outcome, and the test asserts it.

- the duplicate checks stay near-linear on data that is mostly copies (same findings as the
  pairwise versions they replace);
"""

from __future__ import annotations

import itertools
import random

import pytest

from gradian.audit import run_audit
from gradian.data import dataset_from_rows

# -- duplicate checks on mostly-duplicated data ----------------------------------------------

_WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "ne", "su", "ta") for b in ("ran", "tel", "mos", "dil", "vek")]


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


class _CountingDataset:
    """A dataset whose ``examples`` list counts how often it is read."""

    def __init__(self, dataset):
        self._dataset = dataset
        self.reads = 0

    @property
    def examples(self):
        self.reads += 1
        return self._dataset.examples

    def __getattr__(self, name):
        return getattr(self._dataset, name)


def test_duplicate_checks_read_the_rows_a_fixed_number_of_times():
    """On 3,000 rows that are nearly all copies, no check walks the row list once per copy."""
    rng = random.Random(0)
    templates = [{"prompt": _sentence(rng, 12), "completion": _sentence(rng, 4)} for _ in range(5)]
    rows = [dict(rng.choice(templates)) for _ in range(3000)]
    dataset = _CountingDataset(dataset_from_rows(rows))
    result = run_audit(dataset=dataset, checks=["data.duplicates", "data.conflicting_answers",
                                                "data.near_duplicates", "data.length_outliers"])
    duplicates = next(f for f in result.findings if f.id == "data.duplicates")
    assert duplicates.evidence["n_duplicates"] == 2995 and duplicates.evidence["n_unique"] == 5
    assert dataset.reads <= 12


def test_near_duplicate_groups_are_the_planted_templates():
    """Three 120-word templates copied 40 times each with only the last word changed (word
    3-gram Jaccard about 0.98 between any two copies), among 200 distinct rows: three groups of 40."""
    from gradian.audit.data_checks import near_duplicate_groups

    rng = random.Random(1)
    texts = [_sentence(rng, 30) + f" row{i}" for i in range(200)]
    planted = []
    for t in range(3):
        stem = _sentence(rng, 120)
        planted.append(list(range(len(texts), len(texts) + 40)))
        texts += [f"{stem} copy{t}x{k}" for k in range(40)]
    assert near_duplicate_groups(texts, 0.9, 64) == planted


def _agree_pairwise(distinct):
    from gradian.audit.data_checks import _agree

    return all(_agree(a, b) for a, b in itertools.combinations(distinct, 2))


def test_one_pass_answer_agreement_equals_the_pairwise_test():
    from gradian.audit.data_checks import _all_agree

    rng = random.Random(2)
    pieces = ["paris", "the city of paris", "city of paris", "paris france", "lyon", "", "of", "the city"]
    for _ in range(2000):
        distinct = list(dict.fromkeys(rng.sample(pieces, rng.randint(2, 4))))
        assert _all_agree(distinct) == _agree_pairwise(distinct), distinct
