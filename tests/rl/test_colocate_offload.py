"""--colocate-offload in the trainer's step (in-process, TP=1, the native engine): in each stage
the trainer holds on the device what docs/memory_plan.md says, and the run is bit for bit the
run without offload.

On CPU the trainer builds its offload inactive (there is nowhere else to move to); the test
switches it on, so the same moves run as on a GPU, and reads them off the storage sizes
(train/offload.py).
"""

from __future__ import annotations

import pytest
import torch

from megatron_spec.config import (
    CheckpointConfig,
    DataConfig,
    GRPOConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
)
from megatron_spec.models.gpt import unwrap
from megatron_spec.parallel import destroy_parallel
from megatron_spec.rl.trainer import GRPOTrainer
from megatron_spec.train.offload import KINDS, PLAN


@pytest.fixture
def make(setup, tmp_path):
    made = []

    def build(level: str, bf16: bool) -> GRPOTrainer:
        cfg = RunConfig(
            model=ModelConfig(hf_checkpoint=setup.target, make_vocab_size_divisible_by=8, bf16=bf16),
            data=DataConfig(prompt_data="synthetic:sum", num_synthetic_prompts=16,
                            reward="tests.rl.rewards_for_tests:digit_share"),
            rollout=RolloutConfig(rollout_dtype="float32", rollout_max_new_tokens=8, rollout_max_batch_size=8,
                                  rollout_num_threads=1, colocate_offload=level),
            grpo=GRPOConfig(prompts_per_step=2, grpo_group_size=2, micro_batch_size=4, lr=1e-3),
            checkpoint=CheckpointConfig(save=str(tmp_path / f"{level}-{bf16}")),
            logging=LoggingConfig(tensorboard_dir="none", quiet=True)).validate()
        trainer = GRPOTrainer(cfg)
        made.append(trainer)
        return trainer

    yield build
    for trainer in made:
        trainer.shutdown()
    destroy_parallel()


def spy(trainer: GRPOTrainer, seen: dict[str, list[dict[str, int]]]) -> None:
    """Record what the trainer holds on the device when each stage's work starts."""
    def wrap(obj, name: str, phase: str) -> None:
        inner = getattr(obj, name)

        def call(*args, **kwargs):
            seen.setdefault(phase, []).append(trainer.actor.offload.device_bytes())
            return inner(*args, **kwargs)

        setattr(obj, name, call)

    wrap(trainer.rollout.streamer, "sync_target", "prepare")
    wrap(trainer.rollout.engine, "generate", "gen")
    wrap(trainer.actor, "old_logprobs", "logprob")
    wrap(trainer.actor, "train", "train")


@pytest.mark.parametrize("level", ["optimizer", "all"])
def test_each_stage_runs_with_what_the_plan_holds(make, level):
    bf16 = level == "all"
    plain, moved = make("none", bf16), make(level, bf16)
    assert not moved.actor.offload.active  # CPU: built inactive
    moved.actor.offload.active = True
    seen: dict[str, list[dict[str, int]]] = {}
    spy(moved, seen)
    start = moved.actor._snapshot()
    for _ in range(2):
        plain.train_step()
        moved.train_step()
    full = moved.actor.offload.device_bytes()  # after the step: in the train phase, all of it
    assert all(full[k] > 0 for k in KINDS), full
    assert set(seen) == {"prepare", "gen", "logprob", "train"}
    for phase, records in seen.items():
        for i, held in enumerate(records[1:], 1):  # step 1's prepare precedes the first optimizer state
            for kind in KINDS:
                want = full[kind] if kind in PLAN[level][phase] else 0
                assert held[kind] == want, (
                    f"step {i + 1}, {phase}: {kind} holds {held[kind]} bytes, plan {want}"
                )
    for a, b in zip(unwrap(plain.actor.model).parameters(), unwrap(moved.actor.model).parameters()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(start, moved.actor._snapshot())), (
        "the policy must change here"
    )
