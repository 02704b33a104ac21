"""Reading a run's config: YAML files, then dotted `key=value` overrides, then validation.

`load_config(["examples/arith.yaml", "algorithm.lr=1e-5", "rollout.max_staleness=2"])` merges in
order. Every error names the bad key, the bad value and what is allowed.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from streamrl.config.renamed import new_key, translate, warn_renamed
from streamrl.config.schema import Config


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message says how to fix it."""


def load_config(args: Sequence[str] = ()) -> Config:
    """Build a Config from YAML paths and `dotted.key=value` overrides, applied left to right."""
    data: dict[str, Any] = {}
    for arg in args:
        if "=" in arg:
            key, _, raw = arg.partition("=")
            key, value = key.strip(), parse_value(raw)
            moved = new_key(key, value)
            if moved is not None:
                warn_renamed(key, moved)
                key = moved
            _check_key(key)
            _set_dotted(data, key, value)
        else:
            _deep_merge(data, translate(_read_yaml(Path(arg))))
    return validate(data)


def parse_value(raw: str) -> Any:
    """An override's value: YAML (numbers, true/false, an empty value for None, flow-style
    `[lists]` and `{mappings}`), except that text YAML cannot read, or would read as a mapping
    without braces (`Q: {prompt} A:`), is the text itself."""
    if not raw.strip():
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, dict) and not raw.lstrip().startswith("{"):
        return raw
    return value


def validate(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(translate(data))
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"config file {str(path)!r} does not exist (overrides look like key=value)"
        )
    try:
        loaded = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping, got {type(loaded).__name__}"
        )
    return loaded


def _check_key(dotted: str) -> None:
    """Reject an override whose key does not exist, listing the keys that do."""
    model: type[BaseModel] = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(
                f"unknown config key {dotted!r}: {part!r} is not a field of {where}; "
                f"allowed: {', '.join(sorted(fields))}{_did_you_mean(dotted)}"
            )
        annotation = fields[part].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        elif i < len(parts) - 1:
            raise ConfigError(
                f"config key {dotted!r}: {'.'.join(parts[: i + 1])!r} is not a section"
            )


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        if node.get(part) is None:  # absent, or a section left empty in a YAML file
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"cannot set {dotted!r}: {where!r} holds {node!r}, not a section")
    node[parts[-1]] = value


def _deep_merge(into: dict[str, Any], new: dict[str, Any]) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _explain(error: ValidationError) -> str:
    lines = ["invalid config:"]
    for item in error.errors():
        key = ".".join(str(p) for p in item["loc"]) or "(top level)"
        value = item.get("input")
        msg = item["msg"]
        if item["type"] == "extra_forbidden":
            section = _section_for(item["loc"][:-1])
            allowed = ", ".join(sorted(section.model_fields)) if section else "?"
            msg = f"unknown key; allowed here: {allowed}{_did_you_mean(key)}"
        lines.append(f"  {key} = {value!r}: {msg}")
    return "\n".join(lines)


def _did_you_mean(dotted: str) -> str:
    """The existing keys a mistyped or misplaced `dotted` key most likely meant, as the end of an
    error message: keys of the same name in other sections (`trainer.lr` -> `algorithm.lr`),
    keys of the same section that start with it (`algorithm.kl` -> `algorithm.kl.coef`), then
    near spellings of the whole key (`rollout.groupsize` -> `rollout.group_size`)."""
    keys = _leaf_keys(Config)
    section, _, name = dotted.rpartition(".")
    same_name = [k for k in keys if k.rpartition(".")[2] == name]
    longer = [k for k in keys if k.startswith(f"{section}.{name}" if section else name)]
    close = difflib.get_close_matches(dotted, keys, n=3, cutoff=0.75)
    found = list(dict.fromkeys([*same_name, *longer, *close]))[:4]
    return f"; did you mean {' or '.join(found)}?" if found else ""


def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The dotted key of every field of `model` that holds a value (not a section)."""
    keys = []
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys.extend(_leaf_keys(field.annotation, f"{prefix}{name}."))
        else:
            keys.append(prefix + name)
    return keys


def _section_for(loc: Sequence[Any]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not (
            isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
        ):
            return None
        model = field.annotation
    return model


def dump_yaml(config: Config) -> str:
    """The resolved config as YAML, with each field's docstring as a comment above it. A field
    marked secret (`json_schema_extra={"secret": True}`) is written as null: it parses back as
    unset, and the secret itself never reaches a file."""
    out: list[str] = []
    for section_name, section_field in Config.model_fields.items():
        out.append(f"# {section_field.description or ''}".rstrip())
        out.append(f"{section_name}:")
        _dump_section(getattr(config, section_name), "  ", out)
        out.append("")
    return "\n".join(out)


def _dump_section(section: BaseModel, indent: str, out: list[str]) -> None:
    for name, field in type(section).model_fields.items():
        if field.description:
            for doc_line in field.description.split("\n"):
                out.append(f"{indent}# {doc_line.strip()}")
        value = getattr(section, name)
        if _is_secret(field) and value is not None:
            out.append(f"{indent}# (set, but a secret is not written here)")
            value = None
        if isinstance(value, BaseModel):
            out.append(f"{indent}{name}:")
            _dump_section(value, indent + "  ", out)
            continue
        text = yaml.safe_dump(value, default_flow_style=True, width=float("inf")).strip()
        text = text.removesuffix("\n...").removesuffix("...").strip()
        out.append(f"{indent}{name}: {text}")


def _is_secret(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("secret") is True
