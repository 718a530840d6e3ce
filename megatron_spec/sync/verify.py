"""After a weight sync: does the engine hold what was sent? Fail loudly, naming the group.

The engine's ``health()`` reports, per group (``target``, ``draft``), a version and a
checksum. Two kinds of checksum exist:

* **value fingerprints** (``{"numel", "bits"}``, ``megatron_spec.sync.fingerprint``): the
  native engine computes them over the parameters it holds; they must equal the fingerprint
  of what the trainer sent, cast to the engine's dtype. Exact.
* **layout digests** (``{"digest": str}``): SGLang hashes its own sharded, fused (maybe
  re-packed) parameters, which the trainer cannot recompute. :class:`DigestLedger` checks them
  by consistency instead: the same content sent twice must give the same digest, new content
  must give a digest different from the one before the sync and from every digest seen for
  other content. A dropped or partial update fails one of these. The first sync of content
  identical to the engine's start-up weights leaves the digest unchanged; that case is
  resolved by asking the engine for the fingerprint of its start-up weights.

Either way the version each group reports must be the version sent, and the group that was
*not* updated must still hold what it held (updates never cross).

This module compares records; it does not talk to engines or know about models.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from typing import Any

from megatron_spec.sync.fingerprint import Fingerprint

GROUPS = ("target", "draft")
_VERSION_KEY = {"target": "weight_version", "draft": "draft_weight_version"}


class WeightSyncError(RuntimeError):
    """The engine does not hold the weights that were sent (the message names the group)."""

    def __init__(self, group: str, message: str):
        super().__init__(f"{group} weight sync failed: {message}")
        self.group = group


def reported_version(health: Mapping[str, Any], group: str) -> str | None:
    return health.get(_VERSION_KEY[group])


def reported_checksum(health: Mapping[str, Any], group: str) -> Mapping[str, Any] | None:
    return (health.get("checksums") or {}).get(group)


def check_version(group: str, sent: str, health: Mapping[str, Any]) -> None:
    got = reported_version(health, group)
    if got != sent:
        raise WeightSyncError(group, f"engine reports version {got!r}, sent {sent!r}")


def check_fingerprint(group: str, sent: Fingerprint, health: Mapping[str, Any]) -> None:
    """Exact comparison of a value fingerprint with what the engine reports."""
    got = reported_checksum(health, group)
    if got is None:
        raise WeightSyncError(group, "engine reports no checksum for the group")
    held = Fingerprint.from_dict(got)
    if held != sent:
        raise WeightSyncError(
            group, f"engine holds different values than were sent (engine {held.numel} elements "
                   f"{held.parts}, sent {sent.numel} elements {sent.parts}): an update was dropped, "
                   f"partly loaded or overwritten")


def _key(fp: Fingerprint) -> tuple:
    return tuple(sorted((k, tuple(v)) for k, v in fp.parts.items() if v[0]))


class DigestLedger:
    """Consistency checks for engines that report layout digests (see the module docstring).

    Args:
        capacity: contents remembered per group (older ones are forgotten).
    """

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._seen: dict[str, collections.OrderedDict[tuple, str]] = {
            g: collections.OrderedDict() for g in GROUPS
        }

    def record(self, group: str, sent: Fingerprint, digest: str) -> None:
        book = self._seen[group]
        book[_key(sent)] = digest
        book.move_to_end(_key(sent))
        while len(book) > self.capacity:
            book.popitem(last=False)

    def check(self, group: str, sent: Fingerprint, before: str | None, after: str,
              startup_fingerprint: Callable[[], Fingerprint | None] | None = None) -> None:
        """Raise :class:`WeightSyncError` unless ``after`` is consistent with having loaded ``sent``.

        Args:
            before: the group's digest just before the sync (None if unknown).
            after: the digest after ``end_weight_update``.
            startup_fingerprint: returns the fingerprint of the engine's start-up weights (or
                None if unknown); called only when the digest did not change.
        """
        book = self._seen[group]
        key = _key(sent)
        if key in book:
            if book[key] != after:
                raise WeightSyncError(
                    group,
                    "engine digest differs from the last time these exact weights were "
                    "loaded: the update was dropped or only partly loaded",
                )
        else:
            stale = [d for k, d in book.items() if d == after]
            if stale:
                raise WeightSyncError(
                    group,
                    "engine digest equals that of weights sent earlier: it still holds "
                    "an older version (update dropped)",
                )
            if before is not None and after == before:
                start = startup_fingerprint() if startup_fingerprint is not None else None
                if start is None or _key(start) != key:
                    raise WeightSyncError(
                        group, "engine digest did not change although new weights were sent (update dropped)"
                    )
        self.record(group, sent, after)


def check_untouched(
    group: str, recorded: tuple[str, Mapping[str, Any]] | None, health: Mapping[str, Any]
) -> None:
    """The group that was *not* updated must still hold what it held after its own last sync.

    Args:
        recorded: ``(version, checksum)`` of the group's last verified sync (None: never synced).
    """
    if recorded is None:
        return
    version, checksum = recorded
    if reported_version(health, group) != version:
        return  # released, restarted or re-pushed elsewhere: nothing to compare against
    got = reported_checksum(health, group)
    if got is not None and dict(got) != dict(checksum):
        raise WeightSyncError(group, f"changed while the other group was updated (version {version} still "
                                     f"reported): updates crossed")
