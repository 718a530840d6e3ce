"""Weight streaming from the trainer to the rollout engine, and knowing that it arrived.

``streamer``: :class:`WeightStreamer` (Megatron shards -> HF names -> FP8 blocks -> double-buffered
buckets -> engine), the trainer-facing API. ``bucket_stream``: the double-buffered stream of one sync
(packing, the sender thread). ``bucket``: SGLang-compatible flattened buckets.
``transport``: ForkingPickler payloads with an allowlist on the receiving side. ``fp8``: which
tensors travel as block FP8 and how they are named. ``fingerprint`` / ``verify``: exact
layout-free checksums and the checks run after every sync. ``memory``: peak-memory measurement.
(The acceptance-collapse watchdog, which reads what the rollouts show, is ``megatron_spec.rl.watchdog``.)
"""

from megatron_spec.sync.streamer import SyncReport, WeightStreamer, WeightSyncError

__all__ = ["SyncReport", "WeightStreamer", "WeightSyncError"]
