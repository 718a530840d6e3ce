"""The generator states a checkpoint saves: a resumed step draws what the uninterrupted one drew
(issue 27, defect 4: the CUDA default generator was not saved, so a GPU resume was not exact)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megatron_spec.compat import ensure_megatron_compat
from megatron_spec.rl.checkpoint import CheckpointLoadError, rng_state, set_rng_state


def _draws() -> list:
    out = [torch.rand(3).tolist(), random.random(), float(np.random.rand())]
    if torch.cuda.is_available():
        out.append(torch.rand(3, device="cuda").tolist())
    return out


def test_state_holds_every_generator_and_restores_it():
    ensure_megatron_compat()
    torch.manual_seed(1)
    state = rng_state()
    assert set(state) >= {"torch", "cuda", "python", "numpy", "tracker"}
    assert len(state["cuda"]) == torch.cuda.device_count()  # one state per visible GPU (none here)
    first = _draws()
    set_rng_state(state)
    assert _draws() == first


def test_other_gpu_count_is_refused():
    ensure_megatron_compat()
    state = rng_state()
    state["cuda"] = [torch.zeros(8, dtype=torch.uint8)] * (torch.cuda.device_count() + 1)
    with pytest.raises(CheckpointLoadError, match="CUDA generator states for"):
        set_rng_state(state)


def test_checkpoints_without_cuda_states_still_resume():
    ensure_megatron_compat()
    state = rng_state()
    del state["cuda"]
    first = _draws()[:3]
    set_rng_state(state)
    assert _draws()[:3] == first


@pytest.mark.gpu
def test_cuda_draws_resume_exactly():
    ensure_megatron_compat()
    torch.cuda.manual_seed_all(5)
    state = rng_state()
    first = torch.rand(1000, device="cuda")
    torch.rand(7, device="cuda")  # the run went on before it stopped
    set_rng_state(state)
    assert torch.equal(torch.rand(1000, device="cuda"), first)
