"""megatron-core's fallback warnings silenced, and said once instead."""

from __future__ import annotations

import warnings

from megatron_spec.compat import fallbacks
from megatron_spec.compat.fallbacks import fallback_line, quiet_fallback_warnings


def _warn(text: str, module: str) -> None:
    warnings.warn_explicit(text, UserWarning, f"{module.replace('.', '/')}.py", 1, module=module)


def test_megatron_cores_fallback_warnings_are_silenced_and_nothing_else():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet_fallback_warnings()
        _warn("Apex is not installed. Falling back to Torch Norm", "megatron.core.models.backends")
        _warn("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
              "megatron.core.optimizer")
        _warn("When using async grad allreduce it is recommended to set the environment variable "
              "CUDA_DEVICE_MAX_CONNECTIONS to 1 for maximum speedup", "megatron.core.tensor_parallel.layers")
        _warn("Apex is not installed. Falling back to Torch Norm", "somebody.else")  # not megatron-core's
        _warn("the loss is NaN", "megatron.core.pipeline_parallel")  # megatron-core's, not a fallback
    assert [str(w.message) for w in seen] == [
        "Apex is not installed. Falling back to Torch Norm",
        "the loss is NaN",
    ]


def test_one_line_names_what_runs(monkeypatch):
    versions = {"transformer-engine": "2.9.0", "apex": "0.1"}

    def version(*names):
        return next((versions[n] for n in names if n in versions), None)

    monkeypatch.setattr(fallbacks, "installed_version", version)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    assert fallback_line(gpu=True) == "megatron-core: TransformerEngine 2.9.0 layers"
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    assert "CUDA_DEVICE_MAX_CONNECTIONS is not 1" in fallback_line(gpu=True)
    cpu = fallback_line(gpu=False)
    assert "its local layers (no GPU)" in cpu and "Apex 0.1 fused norms" in cpu and "on CPU" in cpu
    versions.clear()
    bare = fallback_line(gpu=True)
    assert "TransformerEngine not installed" in bare and "torch's norms (Apex not installed)" in bare
