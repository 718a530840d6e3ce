"""Weight streaming from the trainer to the rollout engine.

``bucket``: SGLang-compatible flattened buckets. ``transport``: ForkingPickler payloads with
an allowlist on the receiving side.
"""
