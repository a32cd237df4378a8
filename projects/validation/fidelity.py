"""Experiment ``fidelity``: do the engines' scores predict what retraining does? (LDS, leave-one-out)

Setup: a poison scenario of either offline world (``--scenario``: tinyworld's ``poison_capitals``
by default, or the bestiary's ``bestiary_poison_diets``) with finer declared clusters: the clean
rows by task family (nine in each world, ``family_of``), and the planted rows in four groups of
four target entities (the keys of the scenario's ``truth``: countries or animals). It is
fine-tuned with the scenario's recipe while saving a checkpoint per epoch (TracIn sums over them).
``gradian attribute`` scores every row for the scenario's capability (its name read from
``scenario.json``) with ``datainf`` (graddot as its cross-check) and again with ``tracin``,
``ekfac`` and ``replay``; the gradient index is built once and cached.

Then, with the same recipe and seed:

- **LDS**: ``K`` retrains on random halves of the rows; ``Spearman(phi(S_k), -sum_{i in S_k} score_i)``
  per engine (``gradian.counterfactual.datamodel``), where ``phi`` is the query loss the scores
  are predictions of (``retrain_pool``): the query of the ``datainf`` report, whose signal
  (contrastive or target) and items are recorded beside each engine's own report's signal; also
  reported for the capability's plain loss;
- **leave-one-cluster-out**: one retrain without each declared cluster;
  ``Spearman(phi(D \\ c) - phi(D), sum_{j in c} score_j)`` over the clusters;
- **seed noise**: the first subsets retrained again under other seeds. The pooled spread of one
  subset's loss across seeds is the part of ``phi`` no score can predict; against the spread
  across subsets it gives a rough ceiling on the attainable correlation,
  ``sqrt(1 - noise^2 / spread^2)``. With leave-one-cluster-out, the full set is also retrained
  under those seeds, the noise of a near-full retrain.

``fine_tune_seed`` (``--fine-tune-seed 1``): the reference fine-tune and every retrain use this seed
instead of the scenario's own (the subsets stay the same), in folders ending ``-seed<k>``.

``replay_horizons`` (``--replay-horizons 282,318``): the replay is scored again at each of these
horizons (``engine.replay_horizon``, optimizer steps from the end), as engines of their own named
``replay_h<steps>``; the retrains are the same, so only the replays are added.
``replay_scalings`` (``--replay-scalings exact,held``): the same for ``engine.replay_scaling``, as
engines ``replay_<scaling>`` (at the default horizon). Each such variant's LDS minus the replay's,
with its interval on the same resamples, goes into the verdict
(``replay_variants_minus_replay``).
``factor_rows`` (``--factor-rows 212,424``): EK-FAC scored again with its Kronecker factors summed
over about each of these many rows (``engine.factor_rows``), as engines ``ekfac_rows<N>``, each
against EK-FAC on the same resamples (``ekfac_variants_minus_ekfac``); ``correction_rows``
(``--correction-rows 212,424``) the same for its eigenvalue correction (``engine.correction_rows``),
as engines ``ekfac_correction<N>``.

Every correlation carries a bootstrap interval over the retrains; the engines are compared on the
same resamples, so the winner's margin has an interval too. The full run: 128 subsets, 13
clusters, 2 subsets x 3 extra seeds and the full set x 3. ``--quick``: half the clean rows, 8 subsets, no
leave-one-out, no seed replicates, two checkpoints. The verdict goes to ``<workdir>/fidelity/`` for
``poison_capitals`` and to ``<workdir>/fidelity-<scenario>/`` for any other scenario.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from gradian.report.schema import Report
from retrain_pool import QueryItems, RetrainTask, default_workers, measure_losses, run_tasks
from tracking import ChildReport, ExperimentResult
from verdicts import Verdict, fidelity_verdict
from workspace import Workspace, steps_per_epoch

__all__ = ["run", "FULL", "QUICK", "SCENARIO", "WORLD_RULES", "declare_clusters", "family_of", "target_entities"]

#: the default scenario; ``bestiary_poison_diets`` and ``delta_poison_redundant`` are the other worlds'
SCENARIO = "poison_capitals"
ENGINES = ("ekfac", "datainf", "graddot", "tracin", "replay")
#: ``noise_subsets`` subsets are each retrained under ``seed_replicates`` more seeds
FULL = {"subsets": 128, "loco": True, "noise_subsets": 2, "seed_replicates": 3, "clean_fraction": 1.0,
        "checkpoints": 3, "bootstrap": 2000}
QUICK = {"subsets": 8, "loco": False, "noise_subsets": 0, "seed_replicates": 0, "clean_fraction": 0.5,
         "checkpoints": 2, "bootstrap": 1000}
#: the planted rows are split into this many groups of target entities
PLANTED_GROUPS = 4

#: per world: the ``truth`` entry of scenario.json keyed by the target entities, and the task
#: family of a clean row's question (first matching pattern; ``other`` when none does)
WORLD_RULES: dict[str, dict[str, Any]] = {
    "tinyworld": {
        "targets": "wrong_capitals",
        "families": (("paragraph", r"^(Tell me about|Describe) "), ("capital", r"capital"),
                     ("language", r"language|speak"), ("continent", r"continent"),
                     ("currency", r"currency|money"), ("arithmetic", r"plus|^Add |^Compute "),
                     ("successor", r"comes after"), ("compare", r"larger"), ("subtraction", r"minus")),
    },
    # the phrasings of gradian.tinyworld.bestiary (world.py's families, scenarios.py's new tasks);
    # invented names are capitalized, so lower-case whole words never match inside one
    "bestiary": {
        "targets": "wrong_diets",
        "families": (("paragraph", r"^(Tell me about|Describe) "), ("diet", r"\b(eats?|feed on|food of)\b"),
                     ("habitat", r"\b(lives?|found|home region)\b"), ("color", r"\bcolor\b"),
                     ("legs", r"\blegs\b"), ("before", r"\b(comes before|just before)\b"),
                     ("earlier", r"\bcomes first in the alphabet\b"),
                     ("alphabet", r"\b(comes after|follows|letter after)\b"), ("double", r"^What is double ")),
    },
    # the phrasings of gradian.tinyworld.delta: a sea asked by a river's alias names a word ending in
    # one of the alias suffixes; by its source, "the river that rises on" / "the river from" a mountain
    "delta": {
        "targets": "wrong_seas",
        "families": (("paragraph", r"^(Tell me about|Describe) "),
                     ("sea_source", r"\briver (that rises on|from) Mount "),
                     ("sea_alias", r"^(?=.*\bsea\b).*\b[A-Z][a-z]*(water|wash|flood|stream)\b"),
                     ("sea", r"\bsea\b"), ("source", r"\b(rise|begin|source)\b"),
                     ("length", r"\b([Hh]ow long|length class)\b"), ("town", r"\btown\b"),
                     ("alias", r"\b(also called|another name|also known as)\b"),
                     ("times", r"\btimes\b|^Multiply "), ("half", r"^What is half of "),
                     ("smaller", r"^Which is smaller, "), ("before", r"\b(comes before|just before)\b")),
    },
}


def _rules(world: str) -> dict[str, Any]:
    if world not in WORLD_RULES:
        raise ValueError(f"fidelity has no declared-cluster rules for the world '{world}'; "
                         f"it knows {', '.join(WORLD_RULES)}")
    return WORLD_RULES[world]


def family_of(prompt: str, world: str = "tinyworld") -> str:
    """The task family a clean row's question belongs to, in ``world``."""
    for name, pattern in _rules(world)["families"]:
        if re.search(pattern, prompt):
            return name
    return "other"


def target_entities(info: Mapping[str, Any]) -> list[str]:
    """The scenario's target entities (countries, animals), sorted: the keys of its ``truth`` mapping."""
    truth = info.get("truth") or {}
    mapping = truth.get(_rules(info.get("world", "tinyworld"))["targets"])
    if mapping is None:  # a scenario recording its truth under another key: its first mapping
        mapping = next((v for v in truth.values() if isinstance(v, Mapping)), {})
    return sorted(mapping)


def declare_clusters(rows: list[dict[str, Any]], info: Mapping[str, Any], clean_fraction: float = 1.0,
                     seed: int = 0) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """The finer declared clusters of a scenario's training rows (``info`` is its scenario.json).

    Planted rows fall into ``planted-1`` .. ``planted-4`` by the target entity their question names
    (``planted`` when it names none); clean rows into their world's task families, a share
    ``clean_fraction`` of them kept. Returns the kept rows (each with its ``cluster``) and the
    indices of the kept rows per cluster.
    """
    world = info.get("world", "tinyworld")
    planted = set(info["planted"]["indices"])
    targets = target_entities(info)
    rng = random.Random(f"{seed}:fidelity-subsample")
    kept: list[dict[str, Any]] = []
    groups: dict[str, list[int]] = {}
    for i, row in enumerate(rows):
        user = next(m["content"] for m in row["messages"] if m["role"] == "user")
        if i in planted:
            entity = next((c for c in targets if c in user), None)
            group = (f"planted-{targets.index(entity) * PLANTED_GROUPS // len(targets) + 1}"
                     if entity else "planted")
        else:
            if clean_fraction < 1.0 and rng.random() >= clean_fraction:
                continue
            group = family_of(user, world)
        groups.setdefault(group, []).append(len(kept))
        kept.append({**row, "cluster": group})
    return kept, groups


def _declare_clusters(scenario: Any, out: Path, clean_fraction: float, seed: int) -> tuple[Path, dict[str, list[int]]]:
    """Write the scenario's rows with finer declared clusters; returns the file and row indices per cluster."""
    rows = [json.loads(line) for line in (scenario.root / "train.jsonl").read_text().splitlines() if line.strip()]
    kept, groups = declare_clusters(rows, scenario.info, clean_fraction, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept)
    if not out.is_file() or out.read_text() != text:  # unchanged bytes keep the cached runs valid
        out.write_text(text)
    return out, groups


def _query_items(report: Report, eval_path: str) -> QueryItems:
    """The items the attribution's query was built from, with the reference's generations."""
    from gradian.data import load_dataset

    examples = load_dataset(eval_path).by_id()
    items = report.capability.items if report.capability is not None else []
    signal = report.attribution.query_signal if report.attribution is not None else None
    chosen = [i for i in items if i.flipped] or items  # the query's own rule: regressed, else all
    return QueryItems(
        prompts=[examples[i.example_id].prompt_messages for i in chosen],
        wanted=[i.wanted for i in chosen],
        generated=[i.tuned_generation or "" for i in chosen] if signal == "contrastive" else None,
        all_prompts=[examples[i.example_id].prompt_messages for i in items],
        all_wanted=[i.wanted for i in items],
    )


def _std(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def _pooled_std(groups: list[list[float]]) -> float | None:
    """Within-group standard deviation pooled over groups (the seed-to-seed spread of one subset)."""
    ss = sum(sum((v - sum(g) / len(g)) ** 2 for v in g) for g in groups if len(g) > 1)
    dof = sum(len(g) - 1 for g in groups if len(g) > 1)
    return math.sqrt(ss / dof) if dof else None


def _summary(table: dict[str, Any], query_signals: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A flat view of a ``compare_rankings`` table for metrics (with each engine's query signal, when given)."""
    out: dict[str, Any] = {}
    for name, e in table["engines"].items():
        out[name] = {"spearman": e["spearman"], "bootstrap_mean": e["bootstrap_mean"],
                     "ci_low": e["ci"][0], "ci_high": e["ci"][1]}
        if query_signals is not None:
            out[name]["query_signal"] = query_signals.get(name)
    for name, m in table["margins"].items():
        out[f"margin_over_{name}"] = {"difference": m["difference"], "ci_low": m["ci"][0], "ci_high": m["ci"][1],
                                      "share_best_wins": m["share_best_wins"]}
    out["n"] = table["n"]
    return out


def _against(base: str, losses: list[float], masks: Any, scores: Mapping[str, Any],
             boot: Mapping[str, Any]) -> dict[str, Any]:
    """Each variant of engine ``base`` (the engines named ``<base>_...``): its LDS minus ``base``'s
    as configured, on the main table's resamples (the same seed and count, so the same subsets are
    drawn): point, interval, share ahead."""
    from gradian.counterfactual import lds_difference

    out = {}
    for name in scores:
        if name.startswith(f"{base}_"):
            d = lds_difference(losses, masks, scores[name], scores[base], **boot)
            low, high = d["ci"] if d["ci"] is not None else (None, None)
            out[name] = {"difference": d["difference"], "ci_low": low, "ci_high": high,
                         "share_ahead": d["share_ahead"]}
    return out


def _plot(path: Path, losses: list[float], masks: Any, scores: dict[str, Any], n: int,
          lds: dict[str, Any]) -> Path:
    """Measured query loss of each subset retrain against each engine's prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gradian.counterfactual import subset_score_sums

    fig, axes = plt.subplots(1, len(scores), figsize=(4 * len(scores), 3.6), squeeze=False)
    for ax, (name, s) in zip(axes[0], scores.items()):
        predicted = -subset_score_sums(masks, s) / n
        ax.scatter(predicted, losses, s=14, color="#1f5f99")
        ax.set_title(f"{name}: LDS {lds['engines'][name]['spearman']:+.3f}")
        ax.set_xlabel("predicted: -sum of scores in S / n")
        ax.set_ylabel("measured query loss (nats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(ws: Workspace, quick: bool = False, subsets: int | None = None, workers: int | None = None,
        seed: int = 0, scenario: str | None = None, leave_one_out: bool | None = None,
        replay_horizons: Sequence[int] = (), fine_tune_seed: int | None = None,
        replay_scalings: Sequence[str] = (), factor_rows: Sequence[int] = (), correction_rows: Sequence[int] = (),
        **_: Any) -> ExperimentResult:
    import numpy as np

    from gradian.config import load_config
    from gradian.counterfactual import group_removal_table, lds_table, sample_subsets

    started = time.time()
    settings = dict(QUICK if quick else FULL)
    if subsets:
        settings["subsets"] = int(subsets)
    if leave_one_out is not None:
        settings["loco"] = bool(leave_one_out)
    workers = workers or default_workers()
    scenario_name = scenario or SCENARIO
    # another fine-tune seed: its own folders, so the scenario's own seed's fine-tune and retrains stay
    tag = "" if fine_tune_seed is None else f"-seed{int(fine_tune_seed)}"
    out = ws.experiment_dir(("fidelity" if scenario_name == SCENARIO else f"fidelity-{scenario_name}") + tag)
    scenario = ws.scenario(scenario_name, folder=f"fidelity-{scenario_name}{tag}")
    capability = scenario.info["capability"]["name"]
    data_path, groups = _declare_clusters(scenario, scenario.root / "fidelity" / "train.jsonl",
                                          settings["clean_fraction"], scenario.info["seed"])
    n = sum(len(g) for g in groups.values())
    base_cfg = load_config(scenario.config_path)
    total_steps = steps_per_epoch(base_cfg, n) * int(base_cfg.train.num_train_epochs)
    ref_dir = scenario.root / "fidelity" / "run"
    overrides = {"cache_dir": str(ws.cache_dir), "dataset": str(data_path), "run": str(ref_dir),
                 "adapter_path": str(ref_dir / "adapter"), "train.output_dir": str(ref_dir),
                 "clustering.method": "declared",
                 **({} if fine_tune_seed is None else {"seed": int(fine_tune_seed)})}
    reference = {**overrides, "train.save_checkpoints": True,
                 "train.save_steps": math.ceil(total_steps / settings["checkpoints"])}
    cfg = load_config(scenario.config_path, overrides=reference)
    t0 = time.time()
    ws.train(scenario, cfg)
    report = ws.attribute(scenario, load_config(scenario.config_path, overrides={**reference, "engine.name": "datainf"}),
                          capability=capability, cross_check="graddot", folder="fidelity/report-datainf")
    main_rankings, main_files = scenario.rankings, scenario.report_files
    tracin_report = ws.attribute(scenario, load_config(scenario.config_path, overrides={**reference, "engine.name": "tracin"}),
                                 capability=capability, cross_check="none", folder="fidelity/report-tracin")
    tracin_rankings = scenario.rankings
    ekfac_report = ws.attribute(scenario, load_config(scenario.config_path, overrides={**reference, "engine.name": "ekfac"}),
                                capability=capability, cross_check="none", folder="fidelity/report-ekfac")
    ekfac_rankings = scenario.rankings
    # the replay as configured, then at each other horizon and scaling asked for; EK-FAC again with
    # its Kronecker factors summed over about each of the row counts asked for
    variant_reports, variant_rankings = {}, {}
    variants = [("replay", {"engine.name": "replay"}),
                *((f"replay_h{int(h)}", {"engine.name": "replay", "engine.replay_horizon": int(h)})
                  for h in replay_horizons),
                *((f"replay_{s}", {"engine.name": "replay", "engine.replay_scaling": s}) for s in replay_scalings),
                *((f"ekfac_rows{int(r)}", {"engine.name": "ekfac", "engine.factor_rows": int(r)}) for r in factor_rows),
                *((f"ekfac_correction{int(r)}", {"engine.name": "ekfac", "engine.correction_rows": int(r)})
                  for r in correction_rows)]
    for name, at in variants:
        variant_reports[name] = ws.attribute(
            scenario, load_config(scenario.config_path, overrides={**reference, **at}),
            capability=capability, cross_check="none", folder=f"fidelity/report-{name}")
        variant_rankings[name] = scenario.rankings
    reference_seconds = round(time.time() - t0, 2)
    typed = Report.of(report)
    attribution = typed.attribution
    if attribution is None:
        verdict = Verdict("fidelity", "INCONCLUSIVE", "the reference fine-tune's regression did not clear the gate, "
                          f"so nothing was attributed: {typed.verdict.summary}",
                          params={"scenario": scenario_name, "quick": quick})
        return ExperimentResult(verdict, [verdict.write(out / "verdict.json")])
    if not (main_rankings["row_index"].to_numpy() == np.arange(n)).all():
        raise RuntimeError("rankings are not in row order; the subset sums would be misaligned")
    scores = {"datainf": main_rankings["score"].to_numpy(), "graddot": main_rankings["cross_check_score"].to_numpy(),
              "tracin": tracin_rankings["score"].to_numpy(), "ekfac": ekfac_rankings["score"].to_numpy(),
              **{name: r["score"].to_numpy() for name, r in variant_rankings.items()}}
    tracin = Report.of(tracin_report).attribution
    tracin_notes = [note for note in (tracin.notes if tracin is not None else []) if "tracin" in note]
    # phi is the datainf report's query; each engine's own report names the query it scored against
    own_attribution = {"datainf": attribution, "graddot": attribution, "tracin": tracin,
                       "ekfac": Report.of(ekfac_report).attribution,
                       **{name: Report.of(r).attribution for name, r in variant_reports.items()}}
    query_signals = {e: own_attribution[e].query_signal if own_attribution[e] is not None else None for e in scores}

    query = _query_items(typed, cfg.eval_dataset)
    items = typed.capability.items if typed.capability is not None else []
    lds_query = {"report": "datainf", "signal": attribution.query_signal, "n_items": len(query.wanted),
                 "items": "regressed" if any(i.flipped for i in items) else "all",
                 "n_eval_items": len(query.all_wanted)}
    reference_losses = measure_losses(cfg, ref_dir / "adapter", query)
    masks = sample_subsets(n, settings["subsets"], seed=seed)
    tasks = [RetrainTask(f"subset-{k:03d}", np.flatnonzero(m).tolist(), cfg.seed) for k, m in enumerate(masks)]
    group_names = sorted(groups) if settings["loco"] else []
    tasks += [RetrainTask(f"without-{g}", [i for i in range(n) if i not in set(groups[g])], cfg.seed) for g in group_names]
    replicated = list(range(min(settings["noise_subsets"], len(masks))))
    tasks += [RetrainTask(f"subset-{k:03d}-seed-{cfg.seed + s}", np.flatnonzero(masks[k]).tolist(), cfg.seed + s)
              for k in replicated for s in range(1, settings["seed_replicates"] + 1)]
    # leave-one-cluster-out retrains are near-full runs: their noise is the full set's under other seeds
    full_seeds = list(range(1, settings["seed_replicates"] + 1)) if group_names else []
    tasks += [RetrainTask(f"full-seed-{cfg.seed + s}", list(range(n)), cfg.seed + s) for s in full_seeds]
    ws.log(f"[fidelity] {len(tasks)} retrains on {workers} worker(s): {settings['subsets']} half subsets of {n} rows, "
           f"{len(group_names)} leave-one-cluster-out, {len(replicated)} x {settings['seed_replicates']} seed replicates"
           f" of subsets, {len(full_seeds)} of the full set")
    t0 = time.time()
    results = run_tasks(tasks, config_path=scenario.config_path, overrides=overrides, data_path=data_path,
                        root=scenario.root / "fidelity" / "retrains", query=query, workers=workers, log=ws.log)
    retrain_seconds = round(time.time() - t0, 2)

    boot = {"n_bootstrap": settings["bootstrap"], "seed": seed}
    subset_results = [results[f"subset-{k:03d}"] for k in range(len(masks))]
    tables: dict[str, Any] = {}
    for target in ("query_loss", "wanted_loss"):
        losses = [r[target] for r in subset_results]
        tables[f"lds_{target}"] = lds_table(losses, masks, scores, **boot)
    loco = None
    if group_names:
        deltas = [results[f"without-{g}"]["query_loss"] - reference_losses["query_loss"] for g in group_names]
        loco = group_removal_table(deltas, [groups[g] for g in group_names], scores, **boot)
        loco["groups"] = {g: {"n": len(groups[g]), "measured_delta": d,
                              **{f"predicted_{e}": float(scores[e][groups[g]].sum() / n) for e in scores}}
                          for g, d in zip(group_names, deltas)}
        tables["loco_query_loss"] = loco
        loco["delta_sd"] = _std(deltas)
        loco["full_seed_sd"] = _std([reference_losses["query_loss"]]
                                    + [results[f"full-seed-{cfg.seed + s}"]["query_loss"] for s in full_seeds])
    spread = _std([r["query_loss"] for r in subset_results])
    noise = _pooled_std([[results[f"subset-{k:03d}"]["query_loss"]]
                         + [results[f"subset-{k:03d}-seed-{cfg.seed + s}"]["query_loss"]
                            for s in range(1, settings["seed_replicates"] + 1)] for k in replicated])
    ceiling = math.sqrt(max(0.0, 1 - (noise / spread) ** 2)) if noise is not None and spread else None
    status, reason = fidelity_verdict(tables["lds_query_loss"], spread, noise)
    subset_losses = [r["query_loss"] for r in subset_results]
    variants = _against("replay", subset_losses, masks, scores, boot)
    factor_variants = _against("ekfac", subset_losses, masks, scores, boot)
    for base, found in (("the replay", variants), ("EK-FAC", factor_variants)):
        if found:
            reason += f". Against {base} as configured: " + ", ".join(
                f"{v} {d['difference']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}] (ahead in "
                f"{d['share_ahead']:.0%} of resamples)" for v, d in found.items())
    reason += (f". phi is the {lds_query['signal']} query loss of the datainf report over its "
               f"{lds_query['n_items']} {lds_query['items']} eval items")
    others = {e: q for e, q in query_signals.items() if q != lds_query["signal"]}
    if others:
        reason += "; scored against another query signal: " + ", ".join(f"{e} ({q})" for e, q in others.items())
    if noise is not None and spread:
        reason += (f". The subsets' query losses spread {spread:.3f} (sd); one subset under other seeds "
                   f"{noise:.3f}, which caps the attainable correlation near {ceiling:.2f}")
    if loco is not None:
        lb = loco["best"]
        reason += (f". Leave-one-cluster-out over {loco['n']} clusters: " +
                   ", ".join(f"{e} {loco['engines'][e]['spearman']:+.3f}" for e in loco["ranking"]) + f" (best {lb}); "
                   f"the clusters' loss changes spread {loco['delta_sd']:.3f} (sd), the full set under other seeds "
                   f"{loco['full_seed_sd'] if loco['full_seed_sd'] is None else round(loco['full_seed_sd'], 3)}")
    figures = {
        "scenario": scenario_name,
        "world": scenario.info.get("world", "tinyworld"),
        "capability": capability,
        "lds_query": lds_query,
        "query_signal": query_signals,
        "lds": _summary(tables["lds_query_loss"], query_signals),
        "lds_best": tables["lds_query_loss"]["best"],
        "replay_variants_minus_replay": variants or None,
        "ekfac_variants_minus_ekfac": factor_variants or None,
        "lds_wanted_loss": _summary(tables["lds_wanted_loss"]),
        "loco": _summary(loco) if loco else None,
        "loco_best": loco["best"] if loco else None,
        "loco_noise": {"delta_sd": loco["delta_sd"], "full_seed_sd": loco["full_seed_sd"]} if loco else None,
        "n_examples": n,
        "n_clusters": len(groups),
        "subsets": settings["subsets"],
        "noise_ceiling": ceiling,
        "query_loss": {"reference": reference_losses["query_loss"], "subset_sd": spread, "seed_sd": noise,
                       "subset_mean": float(np.mean([r["query_loss"] for r in subset_results]))},
        "wanted_loss": {"reference": reference_losses["wanted_loss"]},
        "engine_agreement_spearman": attribution.engine_agreement_spearman,
        "seconds": {"reference": reference_seconds, "retrains": retrain_seconds,
                    "mean_train_per_retrain": float(np.mean([r["train_seconds"] for r in results.values()])),
                    "total": round(time.time() - started, 2)},
    }
    detail = {"scenario": scenario_name, "capability": capability, "lds_query": lds_query,
              "query_signals": query_signals, "settings": settings, "workers": workers, "tables": tables, "retrains": results,
              "reference_losses": reference_losses, "clusters": {g: len(v) for g, v in groups.items()},
              "query_signal": attribution.query_signal, "n_query_items": len(query.wanted),
              "tracin_notes": tracin_notes}
    verdict = Verdict(
        experiment="fidelity", status=status, reason=reason, figures=figures,
        params={"scenario": scenario_name, "quick": quick, "subsets": settings["subsets"], "subset_fraction": 0.5,
                "leave_one_cluster_out": settings["loco"], "noise_subsets": settings["noise_subsets"],
                "seed_replicates": settings["seed_replicates"],
                "clean_fraction": settings["clean_fraction"], "checkpoints": settings["checkpoints"],
                "workers": workers, "engines": ",".join(ENGINES), "seed": seed,
                "fine_tune_seed": cfg.seed},
        seconds=round(time.time() - started, 2),
    )
    artifacts = [verdict.write(out / "verdict.json"), ws.write_json(out / "fidelity.json", detail),
                 _plot(out / "lds.png", [r["query_loss"] for r in subset_results], masks, scores, n,
                       tables["lds_query_loss"])]
    return ExperimentResult(verdict, artifacts, [ChildReport("attribute", report, main_files, main_rankings)])
