"""Pure sampling math of verifier-exact speculative decoding.

* ``logits``: ``SamplingTensors`` and ``process_logits``, the single definition of the distribution
  that rollouts sample from (temperature / top-k / top-p / min-p / token masks; temperature 0 = argmax).
* ``verify``: ``verify_chain`` (rejection sampling of drafted chains, greedy verification, reduced draft
  vocabularies through ``d2t``), ``sample_from_logprobs`` and the analytic acceptance formulas.
* ``guard``: ``check_lossless``, which refuses engine settings that would break exactness.
* ``history``: ``HistoryIndex``, the suffix index over earlier responses to a prompt that the history
  drafter proposes from (the one stateful object here; its proposals are verified as point masses).

Functions here take tensors and explicit randomness (uniforms or a ``torch.Generator``) and return
tensors; they hold no state and know nothing about models, engines or process groups. The compiled
kernels behind ``verify_chain`` live in ``megatron_spec.ops``.
"""

from megatron_spec.speculative.guard import SGLANG_EXACT_ALGORITHMS, LossyConfigError, check_lossless
from megatron_spec.speculative.history import HistoryIndex
from megatron_spec.speculative.logits import SamplingTensors, process_logits
from megatron_spec.speculative.verify import (
    VerifyResult,
    acceptance_probability,
    expected_num_accepted,
    sample_from_logprobs,
    verify_chain,
)

__all__ = [
    "HistoryIndex",
    "LossyConfigError",
    "SGLANG_EXACT_ALGORITHMS",
    "SamplingTensors",
    "VerifyResult",
    "acceptance_probability",
    "check_lossless",
    "expected_num_accepted",
    "process_logits",
    "sample_from_logprobs",
    "verify_chain",
]
