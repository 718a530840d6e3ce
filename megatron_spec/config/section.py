"""What every section of the run's configuration is made of: :class:`Section`, the base that checks a
section's own fields, and the field helpers that give each field its flag's help, choices and parser.

It does not know any section's fields.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from megatron_spec.rollout.settings import SETTING


def json_object_text(value: Any, flag: str) -> str:
    """A JSON object flag's value as JSON text (a YAML file may give the mapping itself)."""
    import json

    if isinstance(value, dict):
        return json.dumps(value)
    try:
        parsed = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {value!r}")
    return value


def flag(default: Any, help: str, choices: tuple | None = None, parse: Any = None) -> Any:
    """A section's field with its flag's help text, choices and argparse type."""
    meta = {"help": help}
    if parse:
        meta["parse"] = parse  # the flag's argparse type where the field's type is a union (int | "auto")
    if choices:
        meta["choices"] = choices
    return field(default=default, metadata=meta)


def setting(name: str) -> Any:
    """A field declared by the engine settings' one source (``megatron_spec.rollout.settings.SETTINGS``)."""
    s = SETTING[name]
    return flag(s.default, s.help, s.choices, parse=s.parse)


@dataclass
class Section:
    """A section of the run's configuration: it checks its own fields when made and when the run is
    validated (:meth:`check`)."""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise :class:`ConfigError` naming the flag whose value is wrong; values a flag accepts in several
        spellings are made one here (``-1`` for off, ``"auto"`` or an int)."""
