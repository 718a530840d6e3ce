"""Offline refinement of a ModelOpt EAGLE-3 export from cached target states (``megatron_spec.draft.refine``).

A tiny peaked target (tests/draft/conftest.py) and a weak ModelOpt draft of it trained on rollouts of
*other* prompts; :func:`refine_eagle3` captures the target's states over rollouts of the new prompts once
and trains the head on them. The expected acceptance on held-out rollouts must rise, the export must keep
the draft's layout (feature layers, ``d2t``), and the native engine, loading the export, must accept more.
"""

from __future__ import annotations

import pytest
import torch

from megatron_spec.draft.modelopt_io import load_eagle3
from megatron_spec.rollout.native.drafters import Eagle3Drafter
from megatron_spec.rollout.native.engine import EngineCore
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from tests.draft.conftest import peaked_target

pytestmark = pytest.mark.modelopt

PROMPT_LEN, NEW_TOKENS = 6, 24


def _prompts(lo: int, hi: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(lo, hi, (PROMPT_LEN,), generator=g).tolist() for _ in range(n)]


def _generate(target, drafter, prompts, seed: int):
    core = EngineCore(target, drafter, num_draft_tokens=3, max_batch_size=64, context_length=64, seed=seed)
    sp = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return core.generate([GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)])


def _target_and_draft(tmp_path, steps: int):
    """The peaked target and a ModelOpt EAGLE-3 draft (64-token vocabulary) trained ``steps`` steps on its
    rollouts of *other* prompts than the tests': (path, checkpoint, target, draft export)."""
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3

    path, ckpt, target = peaked_target(tmp_path / "target", num_layers=4)
    other = _prompts(4, 44, 32, seed=0)
    samples, _ = _generate(target, None, other, seed=0)
    draft = tmp_path / f"draft{steps}"
    train_and_export_eagle3(path, draft, [p + s.output_ids for p, s in zip(other, samples)], steps=steps,
                            batch_size=8, max_len=40, ttt_steps=2, lr=3e-3, seed=0, progress=False,
                            draft_vocab_size=64, export_rope_scaling={})
    return path, ckpt, target, draft


def test_refinement_from_cached_states_raises_acceptance(tmp_path):
    from megatron_spec.draft.refine import refine_eagle3
    from megatron_spec.parallel import destroy_parallel, init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices
    try:
        path, ckpt, target, weak = _target_and_draft(tmp_path, steps=30)
        cfg = ckpt.decoder_config
        new = _prompts(44, 84, 320, seed=2)
        rollouts = [(p, s.output_ids) for p, s in zip(new, _generate(target, None, new, seed=3)[0])]
        held_prompts = _prompts(44, 84, 32, seed=1)
        held = [
            (p, s.output_ids) for p, s in zip(held_prompts, _generate(target, None, held_prompts, seed=4)[0])
        ]

        init_parallel(tp_size=1, seed=0)
        try:
            out = tmp_path / "refined"
            res = refine_eagle3(
                path,
                weak,
                rollouts,
                held,
                steps=60,
                out_dir=out,
                lr=1e-2,
                rows_per_step=1024,
                warmup_steps=2,
                eval_every=20,
                progress=False,
            )
            exact, bound = (
                _held_out_tau(path, out, held, teacher_topk=None),
                _held_out_tau(path, out, held, 4),
            )
        finally:
            destroy_parallel()
        # the held-out figure is exact (a whole-vocabulary teacher), not the top-k teacher's upper bound
        assert res["after"]["draft/eval_tau"] == pytest.approx(exact, abs=1e-3), (res["after"], exact)
        assert bound > exact + 1e-3, (bound, exact)

        assert res["rows"] == len(rollouts) * NEW_TOKENS and res["held_out_rows"] == len(held) * NEW_TOKENS
        assert len(res["curve"]) == 4 and res["curve"][0] == (0, res["before"]["draft/eval_tau"])
        assert res["after"]["draft/eval_tau"] > res["before"]["draft/eval_tau"] + 0.3, res
        # scored on as many of its training rollouts (every 10th of 320) as are held out
        assert res["train_after"]["draft/eval_rows"] == res["held_out_rows"], res
        before_head, after_head = load_eagle3(weak, cfg), load_eagle3(out, cfg)
        assert after_head.cfg.aux_layer_ids == before_head.cfg.aux_layer_ids
        assert torch.equal(after_head.d2t, before_head.d2t)  # the draft vocabulary is kept
        assert not torch.equal(after_head.fc.weight, before_head.fc.weight)

        # the native engine serves the export: acceptance, T=1, held-out prompts
        def engine_accept(head) -> float:
            return _generate(target, Eagle3Drafter(head.eval(), target.embed_tokens), held_prompts, seed=7)[
                1
            ].mean_accept_length

        engine = {"before": engine_accept(before_head), "after": engine_accept(after_head)}
        print("refinement:", {"tau": [round(t, 3) for _, t in res["curve"]], "engine_accept_length": engine})
        assert engine["after"] > engine["before"] + 0.2, (engine, res)
    finally:
        torch.set_num_threads(threads)


def _held_out_tau(target_dir, draft_dir, held, teacher_topk):
    """``draft/eval_tau`` of the export in ``draft_dir`` on ``held``, captured with ``teacher_topk``."""
    from megatron_spec.capture import Capture, CaptureConfig
    from megatron_spec.draft.refine import capture_rollouts
    from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights

    ckpt = HFCheckpoint(str(target_dir))
    model = build_gpt_model(ckpt.decoder_config)
    load_hf_weights(model, ckpt)
    trainer = Eagle3Trainer.from_modelopt(draft_dir, ckpt.decoder_config, DraftTrainerConfig())
    cap = Capture.for_trainer(trainer, CaptureConfig(teacher_topk=teacher_topk, storage_dtype="bfloat16"))
    return trainer.evaluate(capture_rollouts(model, cap, held))["draft/eval_tau"]


def _target_rollouts(tmp_path, n_train: int = 320, n_held: int = 32):
    path, ckpt, target = peaked_target(tmp_path / "target", num_layers=4)
    new = _prompts(44, 84, n_train, seed=2)
    rollouts = [(p, s.output_ids) for p, s in zip(new, _generate(target, None, new, seed=3)[0])]
    held_prompts = _prompts(44, 84, n_held, seed=1)
    held = [(p, s.output_ids) for p, s in zip(held_prompts, _generate(target, None, held_prompts, seed=4)[0])]
    return path, ckpt, target, rollouts, held, held_prompts


def test_mtp_from_cached_states_learns_and_the_engine_serves_it(tmp_path):
    """``train_mtp``: an MTP depth trained from cached target states predicts the target's next-but-one
    token on held-out rollouts, and the native engine, loading the export, accepts its drafts."""
    from megatron_spec.draft.mtp_io import load_mtp_head
    from megatron_spec.draft.refine import train_mtp
    from megatron_spec.parallel import destroy_parallel, init_parallel
    from megatron_spec.rollout.native.mtp_drafter import MtpDrafter

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path, ckpt, target, rollouts, held, held_prompts = _target_rollouts(tmp_path)
        init_parallel(tp_size=1, seed=0)
        try:
            res = train_mtp(
                path,
                rollouts,
                held,
                steps=60,
                out_dir=tmp_path / "mtp",
                lr=1e-2,
                rows_per_step=1024,
                warmup_steps=2,
                eval_every=30,
                progress=False,
            )
        finally:
            destroy_parallel()
        assert res["rows"] == len(rollouts) * NEW_TOKENS and len(res["curve"]) == 3
        assert res["after"]["draft/eval_top1_0"] > res["before"]["draft/eval_top1_0"] + 0.2, res
        assert res["after"]["draft/eval_ce0"] < res["before"]["draft/eval_ce0"], res
        head = load_mtp_head(tmp_path / "mtp", ckpt.decoder_config).eval()
        stats = _generate(target, MtpDrafter(head, target, 3), held_prompts, seed=7)[1]
        print(
            "mtp:", {k: round(v, 3) for k, v in res["after"].items()}, res["before"], stats.mean_accept_length
        )
        assert stats.mean_accept_length > 1.5, stats
    finally:
        torch.set_num_threads(threads)


def test_distilled_draft_model_accepts_more_and_stays_exact(tmp_path):
    """``distill_draft_model``: the target's first layer, distilled on its own rollouts, agrees with it
    more on held-out rollouts (expected T=1 acceptance and greedy agreement); the engine serves it as
    a draft model with greedy output equal to plain decoding."""
    from megatron_spec.draft.distill import distill_draft_model
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.rollout.native.drafters import ModelDrafter
    from megatron_spec.rollout.native.model import CausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path, _, target, rollouts, held, held_prompts = _target_rollouts(tmp_path, n_train=128)
        res = distill_draft_model(
            path,
            tmp_path / "draft_model",
            rollouts,
            held,
            num_layers=1,
            steps=60,
            lr=3e-3,
            batch_size=16,
            warmup_steps=2,
            progress=False,
        )
        assert res["rows"] == len(rollouts) * NEW_TOKENS
        print("distill:", res["before"], res["after"])
        assert res["after"]["accept_t1"] > res["before"]["accept_t1"] + 0.05, res
        assert res["after"]["top1"] > res["before"]["top1"], res
        dck = HFCheckpoint(str(tmp_path / "draft_model"))
        assert dck.decoder_config.num_layers == 1
        draft = CausalLM(dck.decoder_config).eval()
        draft.load_weights((n, dck.get(n)) for n in dck.weight_names())
        core = EngineCore(
            target, ModelDrafter(draft), num_draft_tokens=3, max_batch_size=64, context_length=64, seed=0
        )
        sp = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        spec = core.generate([GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(held_prompts[:8])])[0]
        plain = EngineCore(
            target, None, num_draft_tokens=3, max_batch_size=64, context_length=64, seed=0
        ).generate([GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(held_prompts[:8])])[0]
        assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    finally:
        torch.set_num_threads(threads)


def test_engine_accepts_as_often_as_the_evaluation_predicts(tmp_path):
    """The held-out evaluation and the engine agree on the same sequences: at k=1 and T=1 the engine
    accepts each draft with probability ``sum_{v in Vd} min(p(tid(v)), q(v))`` at that position
    (rejection sampling against the target's whole distribution), which ``Eagle3Trainer.acceptance``
    computes from the target states captured over the engine's own outputs. The engine's acceptance
    frequency over its verify steps must equal the mean predicted probability over the same positions
    within 4 standard errors; the teacher renormalised over the draft vocabulary (without its
    ``teacher_log_mass``) predicts more than the engine accepts."""
    import math

    from megatron_spec.capture import Capture, CaptureConfig
    from megatron_spec.draft.refine import capture_rollouts
    from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
    from megatron_spec.parallel import destroy_parallel, init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path, ckpt, target, draft = _target_and_draft(tmp_path, steps=120)
        cfg = ckpt.decoder_config
        head = load_eagle3(draft, cfg).eval()
        prompts = _prompts(44, 84, 96, seed=5)
        core = EngineCore(
            target,
            Eagle3Drafter(head, target.embed_tokens),
            num_draft_tokens=1,
            max_batch_size=64,
            context_length=64,
            seed=11,
        )
        sp = SamplingParams(temperature=1.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
        outs, _ = core.generate([GenerateRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)])
        outs = sorted(outs, key=lambda s: int(s.request_id[1:]))

        init_parallel(tp_size=1, seed=0)
        try:
            model = build_gpt_model(cfg)
            load_hf_weights(model, ckpt)
            trainer = Eagle3Trainer.from_modelopt(draft, cfg, DraftTrainerConfig(ttt_steps=1))
            capture = Capture.for_trainer(trainer, CaptureConfig(teacher_topk=None, storage_dtype="float32"))
            cache = capture_rollouts(
                model, capture, [(prompts[int(s.request_id[1:])], s.output_ids) for s in outs]
            )
            alpha = trainer.acceptance(cache, 1)[0][0]
            log_mass, cache.teacher_log_mass = cache.teacher_log_mass, None
            renormalised = trainer.acceptance(cache, 1)[0][0]
        finally:
            destroy_parallel()
        # the draft vocabulary leaves mass out
        assert log_mass is not None and float(log_mass.exp().mean()) < 0.995

        scored = cache.scored_mask()
        accepted, predicted, upper = [], [], []
        for si, s in enumerate(outs):
            rows = [
                r for r in range(int(cache.cu_seqlens[si]), int(cache.cu_seqlens[si + 1])) if bool(scored[r])
            ]
            # row j: the pair of response token j, predicting token j + 1
            assert len(rows) == len(s.output_ids)
            for i, a in s.draft_starts():  # the draft proposing token i is scored at row i - 1
                accepted.append(a)
                predicted.append(float(alpha[rows[i - 1]]))
                upper.append(float(renormalised[rows[i - 1]]))
        n = len(accepted)
        got, want = sum(accepted) / n, sum(predicted) / n
        se = math.sqrt(sum((x - p) ** 2 for x, p in zip(accepted, predicted))) / n
        print("engine vs evaluation:", {"steps": n, "engine": round(got, 4), "predicted": round(want, 4),
                                        "se": round(se, 4), "renormalised": round(sum(upper) / n, 4)})
        assert n > 1000
        assert abs(got - want) < 4 * se, (got, want, se)
        assert sum(upper) / n > want
    finally:
        torch.set_num_threads(threads)


def test_draft_starts_follow_the_accepted_drafts():
    """``SampleOutput.draft_starts``: token 0 from the prefill, each step's first draft at the token after the
    previous step's emitted ones (its accepted drafts + 1), steps past the output left out; a plain step
    (draft length 0) is refused."""
    from megatron_spec.rollout.types import SampleOutput

    s = SampleOutput("r", 0, list(range(7)), [0.0] * 7, "length", 5, accepted_per_step=[1, 0, 2, 0],
                     draft_lengths=[3, 3, 3, 3])
    # a fourth step would propose token 7: past the output
    assert s.draft_starts() == [(1, 1), (3, 0), (4, 2)]
    s.draft_lengths = [3, 0, 3, 3]
    with pytest.raises(ValueError, match="drafted nothing"):
        s.draft_starts()
