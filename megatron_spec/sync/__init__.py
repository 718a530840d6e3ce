"""Weight streaming from the trainer to the rollout engine, and knowing that it arrived.

``streamer``: :class:`WeightStreamer` (Megatron shards -> HF names -> FP8 blocks -> double-buffered
buckets -> engine), the trainer-facing API. ``bucket``: SGLang-compatible flattened buckets.
``transport``: ForkingPickler payloads with an allowlist on the receiving side. ``fp8``: which
tensors travel as block FP8 and how they are named. ``fingerprint`` / ``verify``: exact
layout-free checksums and the checks run after every sync. ``watchdog``: acceptance-collapse
watchdog. ``memory``: peak-memory measurement.
"""

from megatron_spec.sync.streamer import SyncReport, WeightStreamer, WeightSyncError
from megatron_spec.sync.watchdog import AcceptanceWatchdog, Action

__all__ = ["AcceptanceWatchdog", "Action", "SyncReport", "WeightStreamer", "WeightSyncError"]
