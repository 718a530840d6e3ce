"""What the verifier's forward yields besides its loss.

- :mod:`.logprobs`: token log-probs from vocab-parallel logits (no vocabulary gather).
- :mod:`.support`: top-k / top-p / min-p supports of vocab-parallel logits.
- :mod:`.teacher`: the draft's teacher (target distribution on the draft vocabulary, top-k or
  full) from vocab-parallel logits, and differentiable log-probs at chosen ids.
- :mod:`.cache`: :class:`DraftCache`, the packed, detached rows the draft trains on.
- :mod:`.config`: :class:`CaptureConfig`, what the forward records for the draft and how much.
- :mod:`.hooks`: :class:`Capture`: forward hooks on a megatron-core GPTModel that fill the cache
  around one forward (``with capture.record(model, mask): ...``); :mod:`.recorder` holds the hooks.
"""

from megatron_spec.capture.cache import DraftCache
from megatron_spec.capture.config import CaptureConfig
from megatron_spec.capture.hooks import Capture

__all__ = ["Capture", "CaptureConfig", "DraftCache"]
