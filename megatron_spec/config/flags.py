"""The run's configuration from the command line: one flag per field, a ``--config`` YAML file under the
flags and ``section.key=value`` overrides (NeMo-RL's and verl's form) over both.

Every field becomes a kebab-case flag (``micro_batch_size`` -> ``--micro-batch-size``) with its help text and
default, in one argument group per section. In the file and in overrides a key may drop its section's prefix
(``rollout: {max_batch_size: 16}``); the draft's fields, once part of the ``spec`` section, are still found
there (``spec: {draft_kind: eagle3}``). Values are read as their field's type
(:func:`megatron_spec.config_values.coerce`); an unknown section or key is a :class:`ConfigError` naming the
closest ones. It does not know what the values mean: the sections check them.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import typing
from typing import Any

import yaml

from megatron_spec.config.run import SECTIONS, RunConfig
from megatron_spec.config_values import ConfigError, coerce
from megatron_spec.rollout.settings import default_text

KEY_PREFIXES: dict[str, tuple[str, ...]] = {"draft": ("spec_draft_", "spec_")}
"""What a key in a section may leave out of its field's name (default: ``<section>_``)."""
MOVED_FROM: dict[str, str] = {"spec": "draft"}
"""A section whose keys are looked for in another where it has none (the draft's fields were ``spec``'s)."""
_METAVARS = {int: "N", float: "X"}


def _flag(f: dataclasses.Field) -> str:
    return "--" + f.name.replace("_", "-")


def _field_type(cls: type, f: dataclasses.Field) -> type:
    return typing.get_type_hints(cls)[f.name]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument group per section; defaults are None so the YAML file can fill in. Positional
    ``section.key=value`` overrides come last and win over flags and file."""
    parser.add_argument(
        "--config",
        default=None,
        help=f"YAML file with values for any of the flags below: sections ({', '.join(SECTIONS)}) of "
        "keys with or without their section's prefix (rollout: {max_batch_size: 16} or "
        "{rollout_max_batch_size: 16})",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="overrides after the flags, e.g. grpo.lr=1e-5 rollout.max_new_tokens=512 (values read "
        "as YAML, then as the key's type)",
    )
    for section, cls in SECTIONS.items():
        group = parser.add_argument_group(section)
        for f in dataclasses.fields(cls):
            kind = _field_type(cls, f)
            kw: dict[str, Any] = {
                "dest": f"{section}.{f.name}",
                "default": None,
                "help": f"{f.metadata['help']} (default: {default_text(f.name, f.default)})",
            }
            if kind is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = f.metadata.get("parse") or {int: int, float: float}.get(kind, str)
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
                else:
                    kw["metavar"] = _METAVARS.get(kind, "K" if f.metadata.get("parse") else "STR")
            group.add_argument(_flag(f), **kw)


def _find_key(section: str, key: str, prefixes: tuple[str, ...]) -> dataclasses.Field | None:
    fields = {f.name: f for f in dataclasses.fields(SECTIONS[section])}
    return next((fields[p + key] for p in ("", *prefixes) if p + key in fields), None)


def _resolve_key(section: str, key: str, where: str) -> tuple[str, dataclasses.Field]:
    """``(section, field)`` that ``key`` names in ``section``: its name, or its name without the section's
    prefix (``max_batch_size`` in ``rollout``), or a field moved out of ``section`` (:data:`MOVED_FROM`);
    an unknown key is a :class:`ConfigError` with the closest names."""
    prefixes = KEY_PREFIXES.get(section, (f"{section}_",))
    for where_now in (section, MOVED_FROM.get(section)):
        found = where_now and _find_key(where_now, key, prefixes)
        if found:
            return where_now, found
    names = [f.name for f in dataclasses.fields(SECTIONS[section])]
    short = {n.removeprefix(p): n for n in names for p in prefixes if n.startswith(p)}
    near = difflib.get_close_matches(key, names + list(short), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(dict.fromkeys(short.get(n, n) for n in near))}?" if near else ""
    raise ConfigError(f"{where}: unknown key {section}.{key}{hint}")


def _resolve_section(name: str, where: str) -> str:
    if name in SECTIONS:
        return name
    near = difflib.get_close_matches(name, list(SECTIONS), n=1)
    hint = f"; did you mean {near[0]}?" if near else f"; expected one of {', '.join(SECTIONS)}"
    raise ConfigError(f"{where}: unknown section {name!r}{hint}")


def _set(values: dict[str, dict[str, Any]], section: str, key: str, value: Any, where: str) -> None:
    section, f = _resolve_key(_resolve_section(section, where), key, where)
    values[section][f.name] = coerce(section, f, _field_type(SECTIONS[section], f), value, where)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` as ``(section, key, value)``, the value read as YAML (``1e-5`` stays text for
    :func:`megatron_spec.config_values.coerce`)."""
    path, sep, raw = text.partition("=")
    section, dot, key = path.strip().partition(".")
    if not sep or not dot or not section or not key:
        raise ConfigError(f"override {text!r}: expected section.key=value (e.g. grpo.lr=1e-5)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return section, key, value


def _read_file(path: str, values: dict[str, dict[str, Any]]) -> None:
    """The ``--config`` file's values into ``values`` (section -> field -> value)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected sections {sorted(SECTIONS)}, got {type(data).__name__}")
    for section, body in data.items():
        if body is not None and not isinstance(body, dict):
            raise ConfigError(f"{path}: section {section!r} must hold keys, got {body!r}")
        for key, value in (body or {}).items():
            _set(values, str(section), str(key), value, path)


def from_args(args: argparse.Namespace) -> RunConfig:
    """RunConfig from parsed flags, with ``--config`` YAML values under the flags and ``section.key=value``
    overrides over both."""
    values: dict[str, dict[str, Any]] = {s: {} for s in SECTIONS}
    if getattr(args, "config", None):
        _read_file(args.config, values)
    for key, value in vars(args).items():
        if "." in key and value is not None:
            section, name = key.split(".", 1)
            values[section][name] = value
    for text in getattr(args, "overrides", None) or ():
        _set(values, *parse_override(text), f"override {text}")
    return RunConfig(**{s: SECTIONS[s](**values[s]) for s in SECTIONS}).validate()
