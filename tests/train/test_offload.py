"""The colocated memory plan's trainer side (train/offload.py) on megatron-core DDP and the
policy's optimizer, in-process (TP=1): what leaves the device in each phase, what comes back,
and that training after a round trip is bit for bit training without one.

On CPU there is nowhere else to move to, so the test reads the mechanics off the storages:
a tensor moved away keeps its object but its storage holds 0 bytes until it comes back
(``untyped_storage().nbytes()``), which is what frees GPU memory on a GPU.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel
from megatron_spec.train.ddp import finalize_grads, wrap_ddp, zero_grads
from megatron_spec.train.offload import KINDS, PHASES, PLAN, ColocateOffload
from megatron_spec.train.optimizer import MixedPrecisionAdamW

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def parallel():
    info = init_parallel(tp_size=1, seed=0)
    yield info
    destroy_parallel()


class Policy:
    """A GPTModel in megatron-core DDP with the trainer's optimizer, and the offload the trainer builds."""

    def __init__(self, path: str, dtype: torch.dtype, level: str):
        ckpt = HFCheckpoint(path)
        self.model = build_gpt_model(ckpt.decoder_config, params_dtype=dtype)
        load_hf_weights(self.model, ckpt)
        self.ddp = wrap_ddp(self.model)
        self.params = [p for p in self.ddp.parameters() if p.requires_grad]
        self.optimizer = MixedPrecisionAdamW(self.params, lr=1e-3)
        self.vocab = ckpt.decoder_config.vocab_size
        self.offload = ColocateOffload(level, {
            "params": lambda: list(self.model.parameters()),
            "grads": lambda: [buf.grad_data for buf in self.ddp.buffers],
            "optimizer": self.optimizer.state_tensors})

    def step(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.vocab, (2, 12), generator=g)
        zero_grads(self.ddp)
        logits = self.ddp(ids, torch.arange(12).expand(2, 12), attention_mask=None)
        torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten()
        ).backward()
        finalize_grads(self.ddp)
        self.optimizer.grads()
        self.optimizer.step()

    def state(self) -> list[torch.Tensor]:
        return [t.detach().clone() for t in list(self.model.parameters()) + self.optimizer.state_tensors()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("level", ["optimizer", "all"])
def test_each_phase_holds_what_the_plan_says_and_training_is_unchanged(
    parallel, hf_checkpoints, dtype, level
):
    path = hf_checkpoints["qwen3"]
    torch.manual_seed(0)
    plain = Policy(path, dtype, "none")
    torch.manual_seed(0)
    moved = Policy(path, dtype, level)
    plain.step(0)
    moved.step(0)  # the optimizer has its moments now
    full = moved.offload.device_bytes()
    assert all(full[k] > 0 for k in KINDS), full
    for phase in PHASES:
        moved.offload.enter(phase)
        held = moved.offload.device_bytes()
        for kind in KINDS:
            if kind in PLAN[level][phase]:
                assert held[kind] == full[kind], f"{phase}: {kind} should be on the device"
            else:
                assert held[kind] == 0, f"{phase}: {kind} still holds {held[kind]} bytes on the device"
    # the train phase of the round trip: the next step is bit for bit the step without one
    plain.step(1)
    moved.step(1)
    for a, b in zip(plain.state(), moved.state()):
        assert torch.equal(a, b)


def test_nothing_moves_when_inactive(parallel, hf_checkpoints):
    policy = Policy(hf_checkpoints["qwen3"], torch.float32, "all")
    policy.offload.active = False  # what the trainer builds on CPU
    policy.step(0)
    full = policy.offload.device_bytes()
    policy.offload.enter("gen")
    assert policy.offload.device_bytes() == full


def test_the_docs_table_is_the_plan():
    """docs/memory_plan.md's trainer columns say what PLAN does, phase by phase."""
    text = (ROOT / "docs" / "memory_plan.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5 and cells[0].strip("`* ") in PHASES:
            rows[cells[0].strip("`* ")] = cells
    assert set(rows) == set(PHASES), f"docs/memory_plan.md lacks rows for {set(PHASES) - set(rows)}"
    names = {"params": "weights", "grads": "grads", "optimizer": "optimizer"}
    for phase, cells in rows.items():
        for column, level in ((2, "none"), (3, "optimizer"), (4, "all")):
            said = {k for k in KINDS if re.search(rf"\b{names[k]}\b", cells[column])}
            assert said == set(PLAN[level][phase]), f"{phase} / {level}: docs say {sorted(said)}, " \
                                                    f"the code holds {sorted(PLAN[level][phase])}"
