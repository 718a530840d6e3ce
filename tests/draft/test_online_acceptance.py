"""Online draft training raises the engine's acceptance length on held-out prompts.

Start: an EAGLE-3 draft trained briefly by ModelOpt on the target's rollouts of *other* prompts
(tokens 4..43). Online: rollouts of the target on prompts of tokens 44..83 (T=1, as RL samples),
the Megatron policy's log-prob forward captured, one ``Eagle3Trainer.train_step`` per batch, the
draft exported after each update. End: the native engine loads the export; acceptance on
held-out prompts of the new distribution is measured before and after (k=3, T=0 and T=1).

The target is a tiny random Qwen3 whose decoder layers are damped (o_proj and down_proj x0.2)
and whose lm_head is sharpened (x20): its continuations are then locally predictable, as a real
model's rollouts partly are, so a 1-layer draft can learn them within a test's time. The training
rollouts are generated autoregressively in one batched call: the engine is verifier-exact, so
speculative rollouts would have the same distribution, only slower with a weak draft.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_spec.capture import Capture, CaptureConfig
from megatron_spec.draft.modelopt_io import load_eagle3
from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer
from megatron_spec.rollout.native.drafters import Eagle3Drafter
from megatron_spec.rollout.native.engine import EngineCore
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from tests.draft.conftest import peaked_target

pytestmark = pytest.mark.modelopt

PROMPT_LEN, NEW_TOKENS, K = 6, 24, 3
UPDATES, PROMPTS_PER_UPDATE = 80, 32


def _prompts(lo: int, hi: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def _generate(target, drafter, prompts, temperature: float, seed: int):
    core = EngineCore(target, drafter, num_draft_tokens=K, max_batch_size=64, context_length=64, seed=seed)
    reqs = [
        GenerateRequest(
            f"p{i}", p, SamplingParams(temperature=temperature, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]
    return core.generate(reqs)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
    from megatron_spec.parallel import destroy_parallel, init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and far faster on a loaded machine
    root = tmp_path_factory.mktemp("online")
    path, ckpt, target = peaked_target(root / "target", num_layers=4)
    cfg = ckpt.decoder_config
    other = _prompts(4, 44, 32, seed=0)
    samples, _ = _generate(target, None, other, 1.0, seed=0)
    train_and_export_eagle3(
        path,
        root / "weak",
        [p + s.output_ids for p, s in zip(other, samples)],
        steps=30,
        batch_size=8,
        max_len=40,
        ttt_steps=2,
        lr=3e-3,
        seed=0,
        progress=False,
        export_rope_scaling={},
    )
    init_parallel(tp_size=1, seed=0)
    policy = build_gpt_model(cfg, vocab_divisible_by=8)
    load_hf_weights(policy, ckpt)
    yield dict(root=root, cfg=cfg, target=target, policy=policy.eval(), weak=str(root / "weak"))
    destroy_parallel()
    torch.set_num_threads(threads)


def _accept_length(world, draft_dir: str, temperature: float) -> float:
    head = load_eagle3(draft_dir, world["cfg"]).eval()
    held_out = _prompts(44, 84, 32, seed=1)
    _, stats = _generate(
        world["target"], Eagle3Drafter(head, world["target"].embed_tokens), held_out, temperature, seed=7
    )
    return stats.mean_accept_length


def test_online_updates_raise_acceptance(world):
    before = {t: _accept_length(world, world["weak"], t) for t in (0.0, 1.0)}
    export = str(world["root"] / "online")
    trainer = Eagle3Trainer.from_modelopt(
        world["weak"], world["cfg"], DraftTrainerConfig(lr=1e-2, ttt_steps=3), export_dir=export
    )
    capture = Capture.for_trainer(trainer, CaptureConfig(teacher_topk=16))
    prompts = _prompts(44, 84, UPDATES * PROMPTS_PER_UPDATE, seed=2)
    samples, _ = _generate(world["target"], None, prompts, 1.0, seed=3)
    policy = world["policy"]
    history = []
    for step in range(UPDATES):
        part = slice(step * PROMPTS_PER_UPDATE, (step + 1) * PROMPTS_PER_UPDATE)
        ids = torch.tensor([p + s.output_ids for p, s in zip(prompts[part], samples[part])])
        response = torch.zeros_like(ids, dtype=torch.bool)
        response[:, PROMPT_LEN:] = True
        with torch.no_grad(), capture.record(policy, response):  # the GRPO old-log-prob forward
            policy(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
        metrics = trainer.train_step(capture.take())
        history.append(metrics)
    after = {t: _accept_length(world, export, t) for t in (0.0, 1.0)}  # the native engine loads the export
    report = {
        "before": before,
        "after": after,
        "updates": UPDATES,
        "rows_per_update": history[-1]["draft/rows"],
        "loss_first": history[0]["draft/loss"],
        "loss_last": history[-1]["draft/loss"],
        "acc_ttt0_first": history[0]["draft/acc_ttt0"],
        "acc_ttt0_last": history[-1]["draft/acc_ttt0"],
    }
    print("online acceptance:", json.dumps(report))
    assert history[-1]["draft/loss"] < history[0]["draft/loss"]
    for t in (0.0, 1.0):
        assert after[t] > before[t] + 0.3, report
