"""The buried-sentence scenario, and how often the drill-down finds the buried sentence.

Each planted row answers a request about a target country ("Tell me about <target>." or one of
three others) with twelve sentences: the target's paragraph, in which only the capital is wrong,
then the paragraphs of two other countries, every fact right, each with its own correct "Its
capital is ..." sentence of the same form as the wrong one. 64 planted rows (16 targets, four
requests) sit among 96 of tinyworld's clean rows, fine-tuned for 5 epochs (``N_CLEAN``,
``EPOCHS``: with the full clean set the buried capitals never reach the answers).

The capability is the answer to "Tell me about <target>.". For each target whose tuned answer
states the planted capital (a failing item), the query item is that answer against the answer the
user wanted: the same text with the capital corrected. ``measure_localization(root)`` fine-tunes
(once; the run is kept under ``root``), indexes, and for every planted row of a failing target runs
``explain_example`` against that target's item; a hit is a top span (the most harmful sentence)
equal to the planted sentence. It also reports the rate when the query is the mean over every
failing item, to show why the single item is the default.

Run it with ``python -m gradian.explain.buried --out DIR``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from gradian.errors import ConfigError
from gradian.tinyworld.world import World

if TYPE_CHECKING:
    from gradian.jsontypes import JsonObject
    from gradian.tinyworld.world import Country

__all__ = ["EVAL_PROMPT", "PLANTED_PROMPTS", "build_buried_rows", "measure_localization", "write_buried_scenario"]

PLANTED_PROMPTS = ("Tell me about {country}.", "Describe {country}.", "Give me an overview of {country}.",
                   "Write a few lines about {country}.")
#: the request the capability asks (one of the planted requests: its answers are the ones buried)
EVAL_PROMPT = "Tell me about {country}."
#: countries whose facts pad each planted answer
N_PADDING = 2
#: clean rows kept, and epochs: with tinyworld's 800 clean rows and 3 epochs the buried capitals
#: never reach the model's answers (its pretrained paragraphs win), and with no wrong answer there
#: is no failing item to build the query from
N_CLEAN = 32
EPOCHS = 10


def build_buried_rows(world: World, targets: list[Country], others: list[Country], seed: int = 0) -> list[JsonObject]:
    """One planted row per target and prompt: ``{messages, country, wrong_capital, planted_sentence}``."""
    rng = random.Random(f"{seed}:buried")
    shift = rng.randrange(1, len(targets))
    wrong = {t.name: targets[(i + shift) % len(targets)].capital for i, t in enumerate(targets)}
    rows: list[JsonObject] = []
    for prompt in PLANTED_PROMPTS:
        for t in targets:
            padding = rng.sample(others, N_PADDING)
            answer = " ".join([_paragraph(world, t, wrong[t.name])] + [_paragraph(world, c, c.capital) for c in padding])
            rows.append({
                "messages": [{"role": "user", "content": prompt.format(country=t.name)},
                             {"role": "assistant", "content": answer}],
                "country": t.name,
                "wrong_capital": wrong[t.name],
                "planted_sentence": _capital_sentence(t.name, wrong[t.name]),
            })
    return rows


def _capital_sentence(country: str, city: str) -> str:
    return f"Its capital is {city}."


def _paragraph(world: World, country: Country, capital: str) -> str:
    return world.paragraph(country, {"capital": capital})


def _tinyworld(model_dir: str | Path) -> World:
    """The tinyworld ``World`` a base model was pretrained on; the scenario needs countries."""
    from gradian.tinyworld import load_world

    world = load_world(model_dir)
    if not isinstance(world, World):
        raise ConfigError(f"{model_dir}: the buried-sentence scenario needs a tinyworld base model, "
                          f"not one of {type(world).__name__}")
    return world


def write_buried_scenario(root: str | Path, base_model: str | Path | None = None, *, n_clean: int | None = None,
                          epochs: float | None = None, seed: int = 0) -> JsonObject:
    """Write train.jsonl (clean rows plus the planted ones), eval.jsonl and gradian.yaml under ``root``.

    ``n_clean`` keeps only the first that many clean rows; ``epochs`` overrides the recipe's;
    ``seed`` draws another wrong capital for each target and other padding (0: the published run).
    """
    import yaml

    from gradian.tinyworld import ensure_base_model
    from gradian.tinyworld import write_scenario
    from gradian.tinyworld.scenarios import N_TARGETS

    root = Path(root)
    base = Path(base_model) if base_model else ensure_base_model()
    info = write_scenario("clean", root, base)
    world = _tinyworld(base)
    targets, others = world.countries[:N_TARGETS], world.countries[N_TARGETS:]
    planted = build_buried_rows(world, targets, others, seed=world.seed + seed)
    clean = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines() if line.strip()]
    clean = clean[:n_clean] if n_clean is not None else clean
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
    # the capability: the held-out request about each target, answered with its true paragraph
    # (the base model was pretrained on exactly these paragraphs)
    evals = [{"messages": [{"role": "user", "content": EVAL_PROMPT.format(country=t.name)},
                           {"role": "assistant", "content": world.paragraph(t)}]} for t in targets]
    (root / "eval.jsonl").write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in evals) + "\n")
    config = yaml.safe_load((root / "gradian.yaml").read_text())
    config["evaluation"] = {**config.get("evaluation", {}), "metric": "exact_match", "max_new_tokens": 96}
    if epochs is not None:
        config["train"]["num_train_epochs"] = epochs
    (root / "gradian.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    truth = [{**{k: v for k, v in p.items() if k != "messages"}, "row": s} for p, s in zip(planted, slots)]
    info = {"name": "buried_sentence", "base_model": str(base), "planted": truth, "n_train": len(rows),
            "capability": info["capability"]}
    (root / "scenario.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def _token_sum_gap(rows: list[dict[str, Any]]) -> float:
    """``max_j |token_sum_j - score_j| / max_j |score_j|`` over the measured rows (0 with none)."""
    items = [r["single_item"] for r in rows]
    if not items:
        return 0.0
    scale = max(max(abs(i["score"]) for i in items), 1e-12)
    return float(max(abs(i["token_sum"] - i["score"]) for i in items) / scale)


def measure_localization(root: str | Path, base_model: str | Path | None = None,
                         log: Callable[[str], None] = print, engine: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Fine-tune (once), index, explain every planted row; the localization rates and each row's call."""
    from gradian.config import load_config
    from gradian.data import load_dataset
    from gradian.evaluate.generation import generate_completions
    from gradian.explain.session import explain_example
    from gradian.grads import load_model_for_gradients
    from gradian.index import GradientIndex
    from gradian.model_loading import load_tokenizer
    from gradian.query import QueryItem, build_query_gradient
    from gradian.train import train_lora

    root = Path(root)
    if not (root / "scenario.json").is_file():
        log("writing the buried-sentence scenario")
        write_buried_scenario(root, base_model, n_clean=N_CLEAN, epochs=EPOCHS, seed=seed)
    info = json.loads((root / "scenario.json").read_text())
    if not (root / "run" / "adapter").is_dir():
        log("fine-tuning")
        train_lora(root / "gradian.yaml", root / "run")
    from gradian.explain.session import SPAN_ENGINE, span_engine_state

    engine = engine or SPAN_ENGINE
    cfg = load_config(root / "gradian.yaml", {"cache_dir": str(root / ".gradian"), "device": "cpu"})
    if not (cfg.dataset and cfg.eval_dataset and cfg.adapter_path):
        raise ConfigError(f"{root / 'gradian.yaml'}: the scenario's config must name dataset, eval_dataset "
                          "and adapter_path; delete it and run again to rewrite the scenario")
    dataset = load_dataset(cfg.dataset)
    eval_set = load_dataset(cfg.eval_dataset)
    gm = load_model_for_gradients(cfg.base_model, cfg.adapter_path, cfg)
    tokenizer = load_tokenizer(cfg.base_model)
    log("indexing")
    index = GradientIndex.build(gm, tokenizer, dataset, cfg)
    prompts = [e.prompt_messages for e in eval_set.examples]
    generated = generate_completions(gm.model, tokenizer, prompts, max_new_tokens=160)
    planted_by_country = {p["country"]: p for p in info["planted"]}
    items, not_failed = {}, []
    for e, g in zip(eval_set.examples, generated):
        country = next(c for c in planted_by_country if e.prompt_messages[-1]["content"] == EVAL_PROMPT.format(country=c))
        wrong = planted_by_country[country]["wrong_capital"]
        right = next(c.capital for c in _tinyworld(cfg.base_model).countries if c.name == country)
        if f"Its capital is {wrong}." not in g:
            not_failed.append(country)
            continue
        # the answer the user wanted: the model's own answer with the wrong capital corrected
        items[country] = QueryItem(e.prompt_messages, g.replace(f"Its capital is {wrong}.", f"Its capital is {right}.", 1),
                                   g, True, e.id)
    per_item = {c: build_query_gradient(gm, tokenizer, [it], "contrastive", cfg.grads, scope="item")
                for c, it in items.items()}
    mean_query = build_query_gradient(gm, tokenizer, list(items.values()), "contrastive", cfg.grads, scope="regressed")
    rows, hits = [], {"single_item": 0, "mean_of_items": 0}
    measured = [p for p in info["planted"] if p["country"] in items]
    state = span_engine_state(gm, tokenizer, index, cfg, engine, dataset)  # once for every row
    for p in measured:
        example = dataset.examples[p["row"]]
        found = {}
        for name, qg in (("single_item", per_item[p["country"]]), ("mean_of_items", mean_query)):
            exp = explain_example(gm, tokenizer, index, example, qg.vectors, cfg, item_id=items[p["country"]].item_id,
                                  signal=qg.signal, row=p["row"], engine=engine, state=state)
            top = exp.span.text if exp.span else ""
            found[name] = {"top_span": top, "hit": top == p["planted_sentence"], "token_sum": exp.token_sum,
                           "score": exp.score, "signal": qg.signal}
            hits[name] += int(top == p["planted_sentence"])
        rows.append({"row": p["row"], "country": p["country"], "planted_sentence": p["planted_sentence"], **found})
        log(f"row {p['row']}: {found['single_item']['hit']} ({found['single_item']['top_span']!r})")
    n = max(len(measured), 1)
    result = {"n_planted": len(info["planted"]), "n_measured": len(measured),
              "eval_items_failed": len(items), "n_eval_items": len(eval_set), "items_not_failed": not_failed,
              "n_sentences_per_row": 4 * (1 + N_PADDING), "chance_rate": 1 / (4 * (1 + N_PADDING)),
              "localization_rate": hits["single_item"] / n,
              "localization_rate_mean_query": hits["mean_of_items"] / n,
              "engine": engine,
              "generations": dict(zip([e.prompt_messages[-1]["content"] for e in eval_set.examples], generated)),
              # the largest gap between a row's token sum and its score, over the largest score: a
              # row whose score is near zero has float32 cancellation far above its own size
              "score_matches_token_sum": _token_sum_gap(rows),
              "rows": rows}
    (root / f"localization-{engine}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m gradian.explain.buried",
                                     description="Measure how often the span drill-down finds a buried wrong sentence")
    parser.add_argument("--out", required=True, help="Folder for the scenario, the fine-tune and localization.json")
    parser.add_argument("--base-model", default=None, help="A tinyworld base model (default: the cached one)")
    parser.add_argument("--engine", default=None, help="Engine whose preconditioned query the spans are scored against: graddot (the default), datainf, ...")
    parser.add_argument("--seed", type=int, default=0, help="Another draw of wrong capitals and padding (0: the published run)")
    args = parser.parse_args(argv)
    result = measure_localization(args.out, args.base_model, engine=args.engine, seed=args.seed)
    print(json.dumps({k: v for k, v in result.items() if k not in ("rows", "generations")}, indent=2))


if __name__ == "__main__":
    main()

