"""The megatron-core CPU shim: complete on CPU, inert where CUDA exists.

Patching is process-global, so the "CUDA exists" case runs in a fresh interpreter.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_spec.compat import compat_active, ensure_megatron_compat, patched_modules

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shim is for CUDA-less machines")


def test_inert_when_cuda_is_available():
    code = textwrap.dedent("""
        import sys, torch
        from unittest import mock
        with mock.patch.object(torch.cuda, "is_available", return_value=True):
            from megatron_spec.compat import ensure_megatron_compat, patched_modules
            assert ensure_megatron_compat() is False
            assert patched_modules() == []
            import megatron.core.transformer.utils as tu
            import megatron.core.models.common.embeddings.rotary_pos_embedding as rope
            assert rope.torch is torch
            assert "cuda" in tu.get_default_causal_mask.__code__.co_consts
        print("INERT")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "INERT" in out.stdout, out.stderr[-3000:]


def test_every_megatron_module_using_torch_cuda_is_shimmed():
    assert compat_active()
    ensure_megatron_compat()
    missed = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("megatron.core") or module is None:
            continue
        try:
            src = inspect.getsource(module)
        except (OSError, TypeError):
            continue
        if re.search(r"\btorch\.cuda\.", src) and getattr(module, "torch", None) is torch:
            missed.append(name)
    assert not missed, f"megatron-core modules still calling the real torch.cuda: {missed}"
    assert "megatron.core.models.common.embeddings.rotary_pos_embedding" in patched_modules()


def test_shim_answers_like_cuda_on_cpu():
    ensure_megatron_compat()
    import megatron.core.tensor_parallel.random as tpr
    import megatron.core.transformer.utils as tu

    shim = tpr.torch.cuda
    assert shim.current_device() == "cpu" and not shim.is_available()
    start, end = shim.Event(enable_timing=True), shim.Event(enable_timing=True)
    start.record()
    end.record()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    assert tu.get_default_causal_mask(3).device.type == "cpu"
    # the "CUDA" RNG is the CPU default generator, so a tracker fork really switches it
    state = tpr._get_cuda_rng_state()
    a = torch.rand(3)
    tpr._set_cuda_rng_state(state)
    assert torch.equal(torch.rand(3), a)
    # torch itself is untouched
    assert torch.cuda.current_device is not shim.current_device
