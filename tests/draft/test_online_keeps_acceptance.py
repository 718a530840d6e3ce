"""Online updates from a strong draft must not lower its expected acceptance on held-out states.

The failure this guards against (docs/draft_training.md, "Why online training lowered
acceptance"): the GRPO loop captured response rows only, so the online trainer taught the draft
to predict without the prompt in its attention, while the engine's draft always attends to the
prompt (its prefill). The loss on the training rows fell while the acceptance the engine sees fell.

Set-up (fixed seeds): a tiny Qwen3 target with damped decoder layers and a sharpened ``lm_head``
(locally predictable continuations, as in test_online_acceptance.py); prompts of 24 random tokens
and 12 sampled response tokens (T=1, the native engine); a *strong* EAGLE-3 draft, trained
offline on whole sequences as ModelOpt trains. Then the online loop exactly as GRPO runs it:
``Capture.for_trainer(trainer, CaptureConfig())`` around the policy's forward with the *response*
mask, one ``train_step`` per batch, 3 TTT steps, lr 1e-3 (the ``--spec-draft-lr`` default when
the failure was found; today's 3e-4 with warm-up is gentler). Held out: other rollouts, scored as the engine
drafts (prompt in context, response
rows scored), by ``Eagle3Trainer.acceptance``: the expected tokens per verify step of k=3 chains
(from ``sum_x min(p, q)`` per step).

Tolerance from the sample: per held-out sequence, the mean change of its chains' expected length;
the mean over sequences must not fall more than 3 standard errors below 0. Measured with this
set-up (128 held-out sequences): the response-only capture of before the fix lowers it by 0.054
(SE 0.014: -3.8 SE, fails; tau 2.371 -> 2.316, alpha at step 0 0.658 -> 0.644); the capture with
the prompt as context raises it by 0.030 (SE 0.013; tau 2.371 -> 2.401).
"""

from __future__ import annotations

import pytest
import torch

from megatron_spec.capture import Capture, CaptureConfig
from megatron_spec.draft.eagle3 import Eagle3Head
from megatron_spec.draft.eagle3_config import Eagle3Config
from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer
from megatron_spec.rollout.native.engine import EngineCore
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from tests.draft.conftest import peaked_target

PROMPT, RESPONSE, K = 24, 12, 3
BATCH, PRETRAIN_STEPS, ONLINE_STEPS, HELD_OUT = 64, 100, 40, 128


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
    from megatron_spec.parallel import destroy_parallel, init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster, and far faster on a loaded machine
    path, ckpt, target = peaked_target(tmp_path_factory.mktemp("keep") / "target", num_layers=2)
    cfg = ckpt.decoder_config
    g = torch.Generator().manual_seed(0)
    n = 10 * BATCH + HELD_OUT
    prompts = [torch.randint(4, cfg.vocab_size, (PROMPT,), generator=g).tolist() for _ in range(n)]
    core = EngineCore(
        target, None, num_draft_tokens=K, max_batch_size=128, context_length=PROMPT + RESPONSE + 2, seed=0
    )
    sp = SamplingParams(temperature=1.0, max_new_tokens=RESPONSE, ignore_eos=True)
    samples, _ = core.generate([GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)])
    seqs = torch.tensor([p + s.output_ids for p, s in zip(prompts, samples)])  # [n, 36]
    init_parallel(tp_size=1, seed=0)
    policy = build_gpt_model(cfg, vocab_divisible_by=8)
    load_hf_weights(policy, ckpt)
    yield dict(cfg=cfg, policy=policy.eval(), seqs=seqs)
    destroy_parallel()
    torch.set_num_threads(threads)


def _capture(trainer, policy, ids, base: CaptureConfig, response_only: bool = True):
    """The GRPO old-log-prob forward under ``capture.record``: mask = the response (or everything)."""
    capture = Capture.for_trainer(trainer, base)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, PROMPT if response_only else 1:] = True
    with torch.no_grad(), capture.record(policy, mask):
        policy(ids, torch.arange(ids.shape[1]).expand_as(ids), attention_mask=None)
    return capture.take()


def _strong_draft(world) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head trained offline on whole sequences (ModelOpt's recipe: every row scored)."""
    cfg = world["cfg"]
    torch.manual_seed(0)
    head = Eagle3Head(
        Eagle3Config(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=16,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=cfg.vocab_size,
            aux_layer_ids=(0, 1),
            torch_dtype="float32",
        )
    )
    for p in head.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
    trainer = Eagle3Trainer(head, DraftTrainerConfig(lr=3e-3, ttt_steps=K))
    for i in range(PRETRAIN_STEPS):
        ids = world["seqs"][(i % 8) * BATCH:(i % 8 + 1) * BATCH]
        trainer.train_step(_capture(trainer, world["policy"], ids, CaptureConfig(), response_only=False))
    return {k: v.detach().clone() for k, v in head.state_dict().items()}


def _tau_per_sequence(trainer: Eagle3Trainer, held) -> torch.Tensor:
    """Mean expected chain length of each held-out sequence (one segment each)."""
    _, _, tau = trainer.acceptance(held, K)
    seg = torch.repeat_interleave(torch.arange(held.num_segments), held.seqlens)
    ok = ~tau.isnan()
    sums = torch.zeros(held.num_segments, dtype=torch.float64).index_add_(0, seg[ok], tau[ok])
    counts = torch.zeros(held.num_segments, dtype=torch.float64).index_add_(
        0, seg[ok], torch.ones_like(tau[ok])
    )
    return sums / counts


def online_change(world, strong, base: CaptureConfig) -> tuple[float, float, dict, dict]:
    """(mean per-sequence change of the held-out expected chain length, its standard error,
    evaluation before, after) for ONLINE_STEPS GRPO-style updates captured with ``base``."""
    cfg = world["cfg"]
    head = Eagle3Head(
        Eagle3Config(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_kv_heads=2,
            head_dim=16,
            vocab_size=cfg.vocab_size,
            draft_vocab_size=cfg.vocab_size,
            aux_layer_ids=(0, 1),
            torch_dtype="float32",
        )
    )
    head.load_state_dict(strong)
    # lr 1e-3: the --spec-draft-lr default when issue 20 was found, harsher than today's 3e-4 + warm-up
    trainer = Eagle3Trainer(head, DraftTrainerConfig(lr=1e-3, ttt_steps=K))
    served = CaptureConfig(prompt_context=True)  # held-out rows as the engine drafts them: prompt in context
    held = _capture(trainer, world["policy"], world["seqs"][-HELD_OUT:], served)
    before, ev_before = _tau_per_sequence(trainer, held), trainer.evaluate(held, K)
    for i in range(ONLINE_STEPS):
        ids = world["seqs"][(8 + i % 2) * BATCH:(9 + i % 2) * BATCH]
        trainer.train_step(_capture(trainer, world["policy"], ids, base))
    d = _tau_per_sequence(trainer, held) - before
    return float(d.mean()), float(d.std() / d.numel() ** 0.5), ev_before, trainer.evaluate(held, K)


@pytest.mark.slow
def test_online_updates_keep_held_out_acceptance(world):
    strong = _strong_draft(world)
    mean, se, before, after = online_change(world, strong, CaptureConfig())  # what GRPO captures
    report = {"change": round(mean, 4), "se": round(se, 4), "tau_before": round(before["draft/eval_tau"], 4),
              "tau_after": round(after["draft/eval_tau"], 4),
              "accept0": (round(before["draft/eval_accept0"], 4), round(after["draft/eval_accept0"], 4))}
    print("online keeps acceptance:", report)
    assert before["draft/eval_tau"] > 2.0, report  # the draft is strong: most drafts are accepted
    assert mean > -3 * se, report
