"""Loads the compiled extension ``megatron_spec._C`` if it was built.

Every op in ``megatron_spec.ops`` has a pure-PyTorch reference; this module only decides
which one runs. ``MEGATRON_SPEC_FORCE_REFERENCE=1`` forces the references (tests use it to
exercise the fallback path). Which implementation is active is logged once at DEBUG level.

It does not know what the ops compute.
"""

from __future__ import annotations

import functools
import logging
import os

logger = logging.getLogger("megatron_spec")


@functools.lru_cache(maxsize=1)
def compiled_ops_available() -> bool:
    """True when ``megatron_spec._C`` is importable and not disabled by the environment."""
    if os.environ.get("MEGATRON_SPEC_FORCE_REFERENCE", "0") == "1":
        logger.debug("megatron-spec ops: pure-PyTorch references (MEGATRON_SPEC_FORCE_REFERENCE=1)")
        return False
    try:
        import torch  # noqa: F401  (the extension registers into torch.ops)

        from megatron_spec import _C  # noqa: F401
    except ImportError as exc:
        logger.debug("megatron-spec ops: pure-PyTorch references (_C not importable: %s)", exc)
        return False
    logger.debug("megatron-spec ops: compiled kernels from %s", _C.__file__)
    return True
