"""What one weight sync moved and how long it took (:class:`SyncReport`, made by
:class:`~megatron_spec.sync.streamer.WeightStreamer`); it knows nothing of engines or buckets."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class SyncReport:
    """What one sync moved and how long it took (``bytes``/``seconds`` go to the step metrics)."""

    group: str
    version: str
    bytes: int = 0
    """Bucket bytes sent (once, however many engine TP ranks read them)."""
    seconds: float = 0.0
    """The whole sync: begin_weight_update .. verified."""
    num_buckets: int = 0
    num_tensors: int = 0
    checksums: dict[str, Any] = dataclasses.field(default_factory=dict)
    """``{"sent": fingerprint of what was sent (engine dtype), "engine": what the engine reported}``."""
    stream_seconds: float = 0.0
    """begin_weight_update .. last bucket acknowledged (the data movement)."""
    verify_seconds: float = 0.0
    """end_weight_update (engine-side checksum) + comparison."""
    bucket_capacity: int = 0
    peak_extra_bytes: int | None = None
    """Peak memory this process held for the sync (with ``measure_memory``): the rise during the
    sync plus bucket buffers kept from an earlier one."""
    skipped: bool = False
    """This rank took no part (another data-parallel replica)."""
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds per piece (:data:`SYNC_PIECES`; the engine's, where it reports them, from its
    ``sync_timings``). The trainer's pieces overlap: the sender thread fingerprints and calls the engine while
    the next bucket is packed."""

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.stream_seconds / 1e9 if self.stream_seconds > 0 else 0.0
