"""GRPO on megatron-core with speculative rollouts.

Pure pieces: ``tasks`` (synthetic verifiable tasks), ``rewards`` (reward functions by name),
``advantages`` and ``loss`` (GRPO math). Stateful pieces: ``data`` (prompt sets with a
resumable position), ``rollouts`` (batches of samples and their tensors), ``checkpoint``
(atomic, resumable), ``trainer`` (the five timed stages of a step, sync and async).
"""
