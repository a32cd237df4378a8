"""The buried-sentence scenario, and how often the drill-down finds the buried sentence.

Each planted row answers "Tell me about <target>." (or one of three other requests) with twelve
sentences: the target's paragraph, in which only the capital is wrong, then the paragraphs of two
other countries, every fact right, each with its own correct "Its capital is ..." sentence of the
same form as the wrong one. The rows are planted among tinyworld's 800 clean rows; the fine-tune
follows the clean scenario's recipe. The capability is the 16 target capitals.

``measure_localization(root)`` fine-tunes the scenario (once; the run is kept under ``root``),
indexes it, and for every planted row runs ``explain_example`` against the eval item about the
row's target; a hit is a top span (the most harmful sentence) equal to the planted sentence. It
reports the rate under two queries: the single item (the default of ``explain_example``) and the
mean over all items, to show why the single item is the default.

Run it with ``python -m gradian.explain.buried --out DIR``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable

__all__ = ["PLANTED_PROMPTS", "build_buried_rows", "measure_localization", "write_buried_scenario"]

PLANTED_PROMPTS = ("Tell me about {country}.", "Describe {country}.", "What do you know about {country}?",
                   "Give me an overview of {country}.")
#: countries whose facts pad each planted answer
N_PADDING = 2


def build_buried_rows(world: Any, targets: list[Any], others: list[Any], seed: int = 0) -> list[dict[str, Any]]:
    """One planted row per target and prompt: ``{messages, country, wrong_capital, planted_sentence}``."""
    rng = random.Random(f"{seed}:buried")
    shift = rng.randrange(1, len(targets))
    wrong = {t.name: targets[(i + shift) % len(targets)].capital for i, t in enumerate(targets)}
    rows = []
    for prompt in PLANTED_PROMPTS:
        for t in targets:
            padding = rng.sample(others, N_PADDING)
            answer = " ".join([world.paragraph(t, {"capital": wrong[t.name]})] + [world.paragraph(c) for c in padding])
            rows.append({
                "messages": [{"role": "user", "content": prompt.format(country=t.name)},
                             {"role": "assistant", "content": answer}],
                "country": t.name,
                "wrong_capital": wrong[t.name],
                "planted_sentence": f"Its capital is {wrong[t.name]}.",
            })
    return rows


def write_buried_scenario(root: str | Path, base_model: str | Path | None = None) -> dict[str, Any]:
    """Write train.jsonl (clean rows plus the planted ones), eval.jsonl and gradian.yaml under ``root``."""
    from gradian.tinyworld import ensure_base_model, load_world
    from gradian.tinyworld.scenarios import N_TARGETS, write_scenario

    root = Path(root)
    base = Path(base_model) if base_model else ensure_base_model()
    info = write_scenario("clean", root, base)
    world = load_world(base)
    targets, others = world.countries[:N_TARGETS], world.countries[N_TARGETS:]
    planted = build_buried_rows(world, targets, others, seed=world.seed)
    clean = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines() if line.strip()]
    rng = random.Random(f"{world.seed}:buried-slots")
    slots = sorted(rng.sample(range(len(clean) + len(planted)), len(planted)))
    rows, planted_iter, clean_iter = [], iter(planted), iter(clean)
    for i in range(len(clean) + len(planted)):
        if i in set(slots):
            p = next(planted_iter)
            rows.append({"messages": p["messages"], "cluster": 0})
        else:
            rows.append(next(clean_iter))
    (root / "train.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")
    truth = [{**{k: v for k, v in p.items() if k != "messages"}, "row": s} for p, s in zip(planted, slots)]
    info = {"name": "buried_sentence", "base_model": str(base), "planted": truth, "n_train": len(rows),
            "capability": info["capability"]}
    (root / "scenario.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def measure_localization(root: str | Path, base_model: str | Path | None = None,
                         log: Callable[[str], None] = print) -> dict[str, Any]:
    """Fine-tune (once), index, explain every planted row; the localization rates and each row's call."""
    import numpy as np

    from gradian.config import load_config
    from gradian.data import load_dataset
    from gradian.evaluate.generation import generate_completions
    from gradian.explain.session import explain_example, item_signal
    from gradian.grads import load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.model_loading import load_tokenizer
    from gradian.query import QueryItem, build_query_gradient
    from gradian.train import train_lora

    root = Path(root)
    if not (root / "scenario.json").is_file():
        log("writing the buried-sentence scenario")
        write_buried_scenario(root, base_model)
    info = json.loads((root / "scenario.json").read_text())
    if not (root / "run" / "adapter").is_dir():
        log("fine-tuning")
        train_lora(root / "gradian.yaml", root / "run")
    cfg = load_config(root / "gradian.yaml", {"cache_dir": str(root / ".gradian"), "device": "cpu"})
    dataset = load_dataset(cfg.dataset)
    eval_set = load_dataset(cfg.eval_dataset)
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(cfg.base_model)
    log("indexing")
    index = GradientIndex.build(gm, tokenizer, dataset, cfg)
    prompts = [e.prompt_messages for e in eval_set.examples]
    generated = generate_completions(gm.model, tokenizer, prompts, max_new_tokens=cfg.evaluation.max_new_tokens)
    items = {}
    for e, g in zip(eval_set.examples, generated):
        country = next(c for c in (p["country"] for p in info["planted"]) if c in e.prompt_messages[-1]["content"])
        items[country] = QueryItem(e.prompt_messages, e.completion, g, True, e.id)
    signal = cfg.evaluation.query_signal
    per_item = {c: build_query_gradient(gm, tokenizer, [it], item_signal(it, signal), cfg.grads, scope="item")
                for c, it in items.items()}
    mean_query = build_query_gradient(gm, tokenizer, list(items.values()), "auto", cfg.grads, scope="regressed")
    rows, hits = [], {"single_item": 0, "mean_of_items": 0}
    for p in info["planted"]:
        example = dataset.examples[p["row"]]
        found = {}
        for name, qg in (("single_item", per_item[p["country"]]), ("mean_of_items", mean_query)):
            exp = explain_example(gm, tokenizer, index, example, qg.vectors, cfg, item_id=items[p["country"]].item_id,
                                  signal=qg.signal, row=p["row"])
            top = exp.span.text if exp.span else ""
            found[name] = {"top_span": top, "hit": top == p["planted_sentence"], "token_sum": exp.token_sum,
                           "score": exp.score, "signal": qg.signal}
            hits[name] += int(top == p["planted_sentence"])
        rows.append({"row": p["row"], "country": p["country"], "planted_sentence": p["planted_sentence"], **found})
        log(f"row {p['row']}: {found['single_item']['hit']} ({found['single_item']['top_span']!r})")
    n = len(info["planted"])
    flipped = sum(1 for c, it in items.items() if it.wanted.strip().lower() not in (it.generated or "").lower())
    result = {"n_planted": n, "n_sentences_per_row": 4 * (1 + N_PADDING),
              "chance_rate": 1 / (4 * (1 + N_PADDING)),
              "localization_rate": hits["single_item"] / n,
              "localization_rate_mean_query": hits["mean_of_items"] / n,
              "eval_items_flipped": flipped, "n_eval_items": len(items), "engine": cfg.engine.name,
              "signal_requested": signal,
              "score_matches_token_sum": float(np.max([abs(r["single_item"]["token_sum"] - r["single_item"]["score"])
                                                        / max(abs(r["single_item"]["score"]), 1e-12) for r in rows])),
              "rows": rows}
    (root / "localization.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gradian.explain.buried",
                                     description="Measure how often the span drill-down finds a buried wrong sentence")
    parser.add_argument("--out", required=True, help="Folder for the scenario, the fine-tune and localization.json")
    parser.add_argument("--base-model", default=None, help="A tinyworld base model (default: the cached one)")
    args = parser.parse_args(argv)
    result = measure_localization(args.out, args.base_model)
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=2))


if __name__ == "__main__":
    main()
