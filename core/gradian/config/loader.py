"""Load, merge, validate, hash and write configs.

YAML is read with line numbers so an unknown key is reported as ``file:line``, with the closest
valid key. OmegaConf merges the YAML over the dataclass defaults, then command-line overrides over
that (flags win), and converts the result back to typed dataclasses.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Mapping

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from gradian.config.schema import CHOICES, GradianConfig
from gradian.errors import ConfigError

__all__ = [
    "load_config",
    "validate_config",
    "config_to_dict",
    "config_hash",
    "render_starter_config",
]


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> GradianConfig:
    """Defaults, then the YAML file at ``path``, then ``overrides`` (dotted keys; ``None`` skipped).

    Raises ``ConfigError`` naming the file, line and key for unknown keys, wrong types and bad
    values.
    """
    base = OmegaConf.structured(GradianConfig)
    layers = [base]
    where = "defaults"
    if path is not None:
        path = Path(path)
        where = str(path)
        data = _apply_key_aliases(_read_yaml(path), path)
        _reject_unknown_keys(data, GradianConfig, path)
        layers.append(OmegaConf.create(data))
    if overrides:
        flat = {k: v for k, v in overrides.items() if v is not None}
        nested: dict[str, Any] = {}
        for key, value in flat.items():
            _check_dotted_key(key)
            _set_dotted(nested, key, value)
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
    validate_config(config, where=where)
    return config


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}. Write a starter one with `gradian init-config`.")
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{path}{line}: not valid YAML ({problem})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys, got {type(data).__name__}")
    _line_numbers.clear()
    _line_numbers.update(_key_lines(text))
    return data


_line_numbers: dict[str, int] = {}

#: other spellings a config file may use -> the canonical key (top level). The documentation's
#: worked examples write ``adapter:``; ``init-config`` and the dataclasses keep ``adapter_path``.
_KEY_ALIASES: dict[str, str] = {"adapter": "adapter_path"}


def _apply_key_aliases(data: dict[str, Any], path: Path) -> dict[str, Any]:
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

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                out[key] = key_node.start_mark.line + 1
                walk(value_node, key + ".")

    try:
        walk(yaml.compose(text), "")
    except yaml.YAMLError:
        pass
    return out


def _section_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def _reject_unknown_keys(data: Mapping[str, Any], cls: type, path: Path, prefix: str = "") -> None:
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
        elif dotted == "train.backend" and value == "trl":
            line = _line_numbers.get(dotted)
            loc = f"{path}:{line}" if line else str(path)
            raise ConfigError(
                f"{loc}: 'train.backend: trl' is accepted only as a flag; "
                "remove it from the file and run `gradian train --backend trl`"
            )


def _dataclass_type(annotation: Any) -> type | None:
    resolved = _SECTION_TYPES.get(annotation) if isinstance(annotation, str) else annotation
    return resolved if dataclasses.is_dataclass(resolved) else None


def _suggest(key: str, known: Mapping[str, Any], prefix: str) -> str:
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
            if i != len(parts) - 1:
                raise ConfigError(f"unknown config key '{key}': '{prefix}{part}' is not a section")
            return
        cls = sub


def _set_dotted(target: dict[str, Any], key: str, value: Any) -> None:
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


def _get(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def validate_config(config: GradianConfig, where: str = "config") -> None:
    """Raise ``ConfigError`` naming the first field whose value is out of range."""

    def bad(key: str, value: Any, rule: str) -> ConfigError:
        return ConfigError(f"{where}: '{key}' is {value!r}; it must be {rule}")

    for key, choices in CHOICES.items():
        value = _get(config, key)
        if key == "device" and re.fullmatch(r"cuda:\d+", str(value)):
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
    if config.grads.projection_dim is not None and config.grads.projection_dim < 1:
        raise bad("grads.projection_dim", config.grads.projection_dim, "at least 1, or null")
    if not 0 < config.evaluation.ci_level < 1:
        raise bad("evaluation.ci_level", config.evaluation.ci_level, "strictly between 0 and 1 (e.g. 0.95)")
    if not 0 <= config.train.warmup_ratio < 1:
        raise bad("train.warmup_ratio", config.train.warmup_ratio, "in [0, 1)")
    if not config.train.lora_dropout < 1:
        raise bad("train.lora_dropout", config.train.lora_dropout, "below 1")
    if config.clustering.min_cluster_size < 2:
        raise bad("clustering.min_cluster_size", config.clustering.min_cluster_size, "at least 2")
    if config.grads.module_filter is not None:
        try:
            re.compile(config.grads.module_filter)
        except re.error as err:
            raise bad("grads.module_filter", config.grads.module_filter, f"a valid regex ({err})") from None


# -- serialization -----------------------------------------------------------------------------


def config_to_dict(config: GradianConfig) -> dict[str, Any]:
    return dataclasses.asdict(config)


def config_hash(config: GradianConfig | Mapping[str, Any]) -> str:
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


def _render_section(section: Any, lines: list[str], indent: str) -> None:
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
