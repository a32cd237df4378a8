"""Load, merge, validate, hash and write configs.

YAML is read with line numbers so an unknown key is reported as ``file:line``, with the closest
valid key; a key written twice in one mapping is refused (YAML would silently keep the last), and
so is a file that is not UTF-8 or nests too deeply to parse. OmegaConf merges the YAML over the
dataclass defaults, then command-line overrides over that (flags win), and converts the result
back to typed dataclasses. Values are checked after the merge: every float finite, seeds in
``[0, 2**32)``, counts and rates in range, each error naming the key's ``file:line``.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Mapping

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gradian.config.engines import engine_names
from gradian.config.schema import CHOICE_ALIASES, CHOICES, GradianConfig
from gradian.errors import ConfigError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = [
    "load_config",
    "validate_config",
    "validate_for_dataset",
    "config_to_dict",
    "config_hash",
    "render_starter_config",
]


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, object] | None = None,
) -> GradianConfig:
    """Defaults, then the YAML file at ``path``, then ``overrides`` (dotted keys; ``None`` skipped).

    Raises ``ConfigError`` naming the file, line and key for unknown keys, wrong types and bad
    values.
    """
    base = OmegaConf.structured(GradianConfig)
    layers = [base]
    where = "defaults"
    key_lines: dict[str, int] = {}
    if path is not None:
        path = Path(path)
        where = str(path)
        data = _apply_key_aliases(_read_yaml(path), path)
        _reject_unknown_keys(data, GradianConfig, path)
        layers.append(OmegaConf.create(data))
        key_lines = dict(_line_numbers)
    if overrides:
        flat = {k: v for k, v in overrides.items() if v is not None}
        nested: dict[str, object] = {}
        for key, value in flat.items():
            _check_dotted_key(key)
            _set_dotted(nested, key, value)
            key_lines.pop(key, None)  # a flag set it: the file's line is not where the value came from
        layers.append(OmegaConf.create(nested))
        where = f"{where} + command-line flags" if path else "command-line flags"
    try:
        merged = OmegaConf.merge(*layers)
        config = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "?"
        reason = str(err).splitlines()[0]
        raise ConfigError(f"{where}: bad value for '{key}': {reason}") from None
    except ConfigError as err:  # raised by a section's __post_init__
        raise ConfigError(f"{where}: {err}") from None
    assert isinstance(config, GradianConfig)  # internal invariant, not user input
    validate_config(config, where=where, key_lines={k: f"{path}:{n}" for k, n in key_lines.items()})
    return config


class _DuplicateKey(Exception):
    def __init__(self, key: object, first: int, again: int) -> None:
        super().__init__(key)
        self.key, self.first, self.again = key, first, again


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key that appears twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[object, object]:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: the base class reports it
                continue
            if first is not None:
                raise _DuplicateKey(key, first, key_node.start_mark.line + 1)
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path) -> dict[str, object]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}. Write a starter one with `gradian init-config`.")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); "
            "save the file as UTF-8"
        ) from None
    _line_numbers.clear()
    try:
        _line_numbers.update(_key_lines(text))
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        at_line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{at_line}: not valid YAML ({problem})") from None
    except _DuplicateKey as dup:
        dotted = next((k for k, n in _line_numbers.items()
                       if n == dup.again and k.rsplit(".", 1)[-1] == str(dup.key)), str(dup.key))
        raise ConfigError(
            f"{path}:{dup.again}: key '{dotted}' is set twice (first at line {dup.first}); YAML would keep only "
            "the last value, so delete one of them"
        ) from None
    except RecursionError:
        raise ConfigError(
            f"{path}: nested too deeply to read; a config holds a few levels of sections and keys"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    return data


_line_numbers: dict[str, int] = {}

#: other spellings a config file may use -> the canonical key (top level). The documentation's
#: worked examples write ``adapter:``; ``init-config`` and the dataclasses keep ``adapter_path``.
#: ``run_dir`` is the earlier name of ``run``.
_KEY_ALIASES: dict[str, str] = {"adapter": "adapter_path", "run_dir": "run"}


def _apply_key_aliases(data: dict[str, object], path: Path) -> dict[str, object]:
    """Rename alias keys to their canonical name; an alias beside its canonical key is an error."""
    out = dict(data)
    for alias, canonical in _KEY_ALIASES.items():
        if alias not in out:
            continue
        if canonical in out:
            lines = [_line_numbers.get(k) for k in (alias, canonical)]
            where = ", ".join(f"{path}:{n}" for n in lines if n) or str(path)
            raise ConfigError(
                f"{where}: both '{alias}' and '{canonical}' are set; '{alias}' is another name for "
                f"'{canonical}', keep one of them"
            )
        out[canonical] = out.pop(alias)
        if alias in _line_numbers:
            _line_numbers[canonical] = _line_numbers.pop(alias)
    return out


def _key_lines(text: str) -> dict[str, int]:
    """Dotted key -> 1-based line number, from the YAML node tree."""
    out: dict[str, int] = {}

    def walk(node: yaml.Node | None, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                out[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    try:
        walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    except yaml.YAMLError:
        pass
    return out


def _section_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _reject_unknown_keys(data: Mapping[str, object], cls: type, path: Path, prefix: str = "") -> None:
    known = _section_fields(cls)
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in known:
            if prefix == "train." and key == "backend":
                continue
            line = _line_numbers.get(dotted)
            loc = f"{path}:{line}" if line else str(path)
            raise ConfigError(f"{loc}: unknown key '{dotted}'{_suggest(str(key), known, prefix)}")
        sub = known[key].type
        section = _dataclass_type(sub)
        if section is not None:
            if value is None:
                continue
            if not isinstance(value, Mapping):
                line = _line_numbers.get(dotted)
                loc = f"{path}:{line}" if line else str(path)
                raise ConfigError(f"{loc}: '{dotted}' must be a mapping of settings, got {value!r}")
            _reject_unknown_keys(value, section, path, prefix=dotted + ".")


def _dataclass_type(annotation: object) -> type | None:
    resolved = _SECTION_TYPES.get(annotation) if isinstance(annotation, str) else annotation
    return resolved if isinstance(resolved, type) and dataclasses.is_dataclass(resolved) else None


def _suggest(key: str, known: Mapping[str, object], prefix: str) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.5)
    if close:
        return f"; did you mean '{prefix}{close[0]}'?"
    where = f"'{prefix.rstrip('.')}'" if prefix else "the top level"
    return f"; valid keys of {where}: {', '.join(sorted(known))}"


def _check_dotted_key(key: str) -> None:
    cls: type = GradianConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        known = _section_fields(cls)
        prefix = ".".join(parts[:i]) + ("." if i else "")
        if part not in known:
            raise ConfigError(f"unknown config key '{key}'{_suggest(part, known, prefix)}")
        sub = _dataclass_type(known[part].type)
        if sub is None:
            # a mapping field (engine.options, train.extra) takes keys of its own below it
            if i != len(parts) - 1 and not str(known[part].type).replace("typing.", "").startswith(("Dict[", "dict[")):
                raise ConfigError(f"unknown config key '{key}': '{prefix}{part}' is not a section")
            return
        cls = sub


def _set_dotted(target: dict[str, Any], key: str, value: object) -> None:
    parts = key.split(".")
    for part in parts[:-1]:
        target = target.setdefault(part, {})
    target[parts[-1]] = value


def _build_section_types() -> dict[str, type]:
    from gradian.config import schema

    return {
        name: obj
        for name, obj in vars(schema).items()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj)
    }


_SECTION_TYPES = _build_section_types()

# -- value validation ------------------------------------------------------------------------

_POSITIVE_INT = (
    "grads.batch_size",
    "grads.max_seq_length",
    "grads.chunk_size",
    "evaluation.max_new_tokens",
    "evaluation.batch_size",
    "evaluation.n_bootstrap",
    "evaluation.min_items",
    "clustering.n_clusters",
    "clustering.max_features",
    "clustering.svd_dim",
    "clustering.label_top_terms",
    "train.r",
    "train.per_device_train_batch_size",
    "train.gradient_accumulation_steps",
    "train.max_seq_length",
    "train.logging_steps",
)
_NON_NEGATIVE = (
    "clustering.top_examples_per_cluster",
    "train.save_steps",
    "train.max_grad_norm",
    "train.weight_decay",
    "train.lora_dropout",
)
_POSITIVE = ("engine.lambda_scale", "train.learning_rate", "train.num_train_epochs", "train.lora_alpha")


def _get(config: object, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


#: seeds reach numpy's legacy ``np.random.seed`` (and ``random``/``torch``): 32 bits, not negative
_SEEDS = ("seed", "grads.projection_seed", "engine.fisher_seed")
SEED_LIMIT = 2**32


def _float_fields(section: DataclassInstance | type[DataclassInstance] | Mapping[str, object],
                 prefix: str = "") -> Iterator[tuple[str, float]]:
    """Every float value in the config (dataclass fields and free-form dicts), by dotted key."""
    items = (((f.name, getattr(section, f.name)) for f in dataclasses.fields(section))
             if dataclasses.is_dataclass(section) else section.items())
    for name, value in items:
        key = f"{prefix}{name}"
        if dataclasses.is_dataclass(value) or isinstance(value, Mapping):
            yield from _float_fields(value, key + ".")
        elif isinstance(value, float):
            yield key, value
        elif isinstance(value, (list, tuple)):
            yield from ((f"{key}[{i}]", v) for i, v in enumerate(value) if isinstance(v, float))


def validate_config(config: GradianConfig, where: str = "config",
                    key_lines: Mapping[str, str] | None = None) -> None:
    """Raise ``ConfigError`` naming the first field whose value is out of range.

    ``key_lines`` maps a dotted key to the ``file:line`` it was read from, to name in the message.
    """
    key_lines = key_lines or {}

    def bad(key: str, value: object, rule: str) -> ConfigError:
        return ConfigError(f"{key_lines.get(key, where)}: '{key}' is {value!r}; it must be {rule}")

    for key, number in _float_fields(config):
        if not math.isfinite(number):
            raise bad(key, number, "a finite number (.inf and .nan are not values here)")
    for key in _SEEDS:
        value = _get(config, key)
        if not 0 <= value < SEED_LIMIT:
            raise bad(key, value, f"a whole number from 0 to {SEED_LIMIT - 1} (what numpy and torch accept as a seed)")

    for key, aliases in CHOICE_ALIASES.items():
        # an earlier name of a choice, or YAML's boolean for one (`fisher: true` reads as "True")
        value = str(_get(config, key))
        if value in aliases or value.lower() in aliases:
            section, _, name = key.rpartition(".")
            setattr(_get(config, section) if section else config, name, aliases.get(value, aliases.get(value.lower())))
    for key, choices in {**CHOICES, "engine.name": tuple(engine_names())}.items():
        value = _get(config, key)
        if key == "device" and re.fullmatch(r"cuda:\d+", str(value)):
            continue
        if value in ("True", "False") and value.lower() in choices:
            # YAML reads a bare `true` as a boolean, which the string field holds as "True": the
            # user wrote the choice itself
            section, _, name = key.rpartition(".")
            setattr(_get(config, section) if section else config, name, value.lower())
            continue
        if value not in choices:
            close = difflib.get_close_matches(str(value), choices, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise bad(key, value, f"one of {', '.join(choices)}{hint}")
    for key in _POSITIVE_INT:
        value = _get(config, key)
        if value < 1:
            raise bad(key, value, "a whole number of at least 1")
    for key in _NON_NEGATIVE:
        value = _get(config, key)
        if value < 0:
            raise bad(key, value, "zero or more")
    for key in _POSITIVE:
        value = _get(config, key)
        if not value > 0:
            raise bad(key, value, "greater than zero")
    if config.engine.lambda_override is not None and not config.engine.lambda_override > 0:
        raise bad("engine.lambda_override", config.engine.lambda_override, "greater than zero, or null")
    known = set(engine_names())
    for name, values in config.engine.options.items():
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise bad(f"engine.options.{name}", values, f"the options of an engine, under its name: one of "
                      f"{', '.join(sorted(known))}{hint}")
        if not isinstance(values, Mapping):
            raise bad(f"engine.options.{name}", values, "a mapping of that engine's option names to values")
    if config.engine.factor_rows is not None and config.engine.factor_rows < 1:
        raise bad("engine.factor_rows", config.engine.factor_rows, "at least 1 (rows), or null for every row")
    if config.engine.correction_rows is not None and config.engine.correction_rows < 1:
        raise bad("engine.correction_rows", config.engine.correction_rows, "at least 1 (rows), or null for every row")
    if config.engine.replay_horizon is not None and config.engine.replay_horizon < 1:
        raise bad("engine.replay_horizon", config.engine.replay_horizon, "at least 1 (optimizer steps), or null")
    if not config.evaluation.query_lost_nats > 0:
        raise bad("evaluation.query_lost_nats", config.evaluation.query_lost_nats, "greater than zero (nats)")
    if config.engine.replay_checkpoint_every is not None and config.engine.replay_checkpoint_every < 1:
        raise bad("engine.replay_checkpoint_every", config.engine.replay_checkpoint_every,
                  "at least 1 (optimizer steps), or null")
    if config.quantization != "none":
        if config.dtype == "float64":
            raise bad("quantization", config.quantization, "none under dtype: float64 (bitsandbytes computes in "
                      "float32, float16 or bfloat16); set dtype: auto or float32")
        if str(config.device).startswith("mps"):
            raise bad("quantization", config.quantization, "none on mps (bitsandbytes runs on CUDA and the CPU)")
        if config.engine.name == "replay":
            raise bad("quantization", config.quantization, "none under engine.name: replay (its metagradients are "
                      "checked against finite differences on a base in dtype only); use engine.name: ekfac, or "
                      "quantization: none")
    if config.grads.projection_dim is not None and config.grads.projection_dim < 1:
        raise bad("grads.projection_dim", config.grads.projection_dim, "at least 1, or null")
    if config.grads.max_index_gb is not None and not config.grads.max_index_gb > 0:
        raise bad("grads.max_index_gb", config.grads.max_index_gb, "greater than zero, or null")
    from gradian.sizes import check_fits_memory

    n_boot = config.evaluation.n_bootstrap
    # the resampled means (float64) and the copy the percentile takes of them
    check_fits_memory(16 * n_boot, f"{key_lines.get('evaluation.n_bootstrap', where)}: 'evaluation.n_bootstrap' "
                      f"is {n_boot:,}, whose resampled means need",
                      "2000 resamples give a steady 95% interval, 10000 a steadier one")
    if not 0 < config.evaluation.ci_level < 1:
        raise bad("evaluation.ci_level", config.evaluation.ci_level, "strictly between 0 and 1 (e.g. 0.95)")
    if not 0 <= config.train.warmup_ratio < 1:
        raise bad("train.warmup_ratio", config.train.warmup_ratio, "in [0, 1)")
    if not config.train.lora_dropout < 1:
        raise bad("train.lora_dropout", config.train.lora_dropout, "below 1")
    if config.clustering.min_cluster_size < 2:
        raise bad("clustering.min_cluster_size", config.clustering.min_cluster_size, "at least 2")
    if not 0 <= config.clustering.accused_sibling_cosine <= 1:
        raise bad("clustering.accused_sibling_cosine", config.clustering.accused_sibling_cosine,
                  "between 0 (add no rows) and 1")
    if not 0 <= config.clustering.accused_sibling_anchor <= 1:
        raise bad("clustering.accused_sibling_anchor", config.clustering.accused_sibling_anchor,
                  "a probability between 0 (every accused row brings its siblings) and 1")
    if not 0 <= config.clustering.accused_known_nats <= 10:
        raise bad("clustering.accused_known_nats", config.clustering.accused_known_nats,
                  "between 0 (keep every accused row) and 10 nats (0.1: the base gave the row with probability 0.9)")
    if config.grads.module_filter is not None:
        try:
            re.compile(config.grads.module_filter)
        except re.error as err:
            raise bad("grads.module_filter", config.grads.module_filter, f"a valid regex ({err})") from None


def validate_for_dataset(config: GradianConfig, n_examples: int, dataset: str = "the dataset") -> None:
    """Settings that must fit the training data, checked once its size is known (before any model).

    ``clustering.min_cluster_size`` above the number of rows leaves HDBSCAN nothing to form. Under
    ``method: auto`` with the default size the documented fallback (KMeans) applies; a size the
    user chose, or ``method: hdbscan``, is an error rather than a silent change of method.
    """
    clustering = config.clustering
    default = next(f.default for f in dataclasses.fields(clustering) if f.name == "min_cluster_size")
    chosen = clustering.method == "hdbscan" or clustering.min_cluster_size != default
    if clustering.method in ("auto", "hdbscan") and chosen and clustering.min_cluster_size > n_examples:
        raise ConfigError(
            f"'clustering.min_cluster_size' is {clustering.min_cluster_size} but {dataset} has only "
            f"{n_examples} rows, so HDBSCAN cannot form a single cluster; set it to at most {max(2, n_examples // 2)}, "
            "or use clustering.method: kmeans"
        )


# -- serialization -----------------------------------------------------------------------------


def config_to_dict(config: GradianConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_hash(config: GradianConfig | Mapping[str, object]) -> str:
    """sha256 of the canonical JSON (sorted keys, no whitespace) of the config."""
    data = config if isinstance(config, Mapping) else config_to_dict(config)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def render_starter_config(base_model: str = "") -> str:
    """A commented ``gradian.yaml`` holding every field at its default (``base_model`` filled)."""
    config = GradianConfig(base_model=base_model)
    lines = [
        "# Gradian configuration. Every field is shown at its default; delete what you do not change.",
        "# Command-line flags override these values. Unknown keys are rejected.",
        "",
    ]
    _render_section(config, lines, indent="")
    return "\n".join(lines) + "\n"


def _render_section(section: DataclassInstance | type[DataclassInstance], lines: list[str], indent: str) -> None:
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        help_text = f.metadata.get("help", "")
        if dataclasses.is_dataclass(value):
            lines.append("")
            lines.append(f"{indent}# {help_text}")
            if not dataclasses.fields(value):
                lines.append(f"{indent}{f.name}: {{}}")
                continue
            lines.append(f"{indent}{f.name}:")
            _render_section(value, lines, indent + "  ")
            continue
        rendered = yaml.safe_dump({f.name: value}, default_flow_style=True, width=1000).strip()
        if rendered.startswith("{") and rendered.endswith("}"):
            rendered = rendered[1:-1]
        lines.append(f"{indent}{rendered}  # {help_text}" if help_text else f"{indent}{rendered}")
