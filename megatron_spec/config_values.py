"""A value from a ``--config`` YAML file or a ``section.key=value`` override as its field's type
(``megatron_spec.config``): what PyYAML reads as text (``1e-5``, a quoted ``"512"``) becomes the number it
says; what is not one is a ``ConfigError`` naming the key."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any


class ConfigError(ValueError):
    """A user error in the run's flags, its ``--config`` file or the files the flags name (a missing
    checkpoint, a draft for another model). The launcher prints it as one ``error:`` line and exits 2."""


def coerce(group: str, f: dataclasses.Field, kind: Any, value: Any, where: str) -> Any:
    """A value from a YAML file or an override as the field's type: what PyYAML reads as text (``1e-5``, a
    quoted ``"512"``) becomes the number it says, and what is not one is a :class:`ConfigError` naming the
    key. (OmegaConf's structured configs would do this if every field that defaults to None were declared
    Optional; this is the part of it these fields need.)"""

    name = f"{group}.{f.name}"
    if value is None:
        return None
    parse = f.metadata.get("parse")
    try:
        if parse is not None and not isinstance(value, bool):
            value = parse(value)
        elif kind is bool:
            if isinstance(value, str) and value.strip().lower() in (
                "true",
                "false",
                "yes",
                "no",
                "on",
                "off",
                "1",
                "0",
            ):
                value = value.strip().lower() in ("true", "yes", "on", "1")
            elif not isinstance(value, bool):
                raise ValueError
        elif kind is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            value = int(value) if not isinstance(value, str) else int(value.strip())
        elif kind is float:
            if isinstance(value, bool):
                raise ValueError
            value = float(value)
        elif not isinstance(value, str):
            if isinstance(value, (dict, list)):
                raise ValueError
            value = str(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        what = getattr(kind, "__name__", str(kind))
        raise ConfigError(
            f"{where}: {name} must be {'a' if what != 'int' else 'an'} {what}, got {value!r}"
        ) from None
    choices = f.metadata.get("choices")
    if choices and value not in choices:
        raise ConfigError(f"{where}: {name} must be one of {', '.join(map(str, choices))}; got {value!r}")
    return value


def json_object(flag: str, value) -> dict:
    """A flag whose value is a JSON object (a YAML ``--config`` may give the mapping itself): ``{}`` when
    unset; ``ValueError`` naming the flag for text that is not JSON or not an object."""
    from collections.abc import Mapping

    if value is None or value == "":
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"{flag} {value[:80]!r} is not JSON ({exc.msg} at character {exc.pos})"
            ) from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{flag} must be a JSON object, got {str(value)[:80]!r}")
    return dict(value)


def parse_stop_strings(value: str | Sequence[str] | None) -> tuple[str, ...]:
    """``--stop``: one string, or a JSON list of strings (a YAML ``--config`` may give a list)."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(
                    f"--stop {value!r} starts with '[' but is not a JSON list of strings: {exc}"
                ) from exc
        else:
            return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"--stop must be a string or a list of non-empty strings, got {value!r}")
    return tuple(value)
