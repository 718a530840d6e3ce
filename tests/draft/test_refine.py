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


def test_refinement_from_cached_states_raises_acceptance(tmp_path):
    from megatron_spec.draft.modelopt_train import train_and_export_eagle3
    from megatron_spec.draft.refine import refine_eagle3
    from megatron_spec.parallel import destroy_parallel, init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices
    try:
        path, ckpt, target = peaked_target(tmp_path / "target", num_layers=4)
        cfg = ckpt.decoder_config
        other = _prompts(4, 44, 32, seed=0)
        samples, _ = _generate(target, None, other, seed=0)
        weak = tmp_path / "weak"
        train_and_export_eagle3(path, weak, [p + s.output_ids for p, s in zip(other, samples)], steps=30,
                                batch_size=8, max_len=40, ttt_steps=2, lr=3e-3, seed=0, progress=False,
                                draft_vocab_size=64, export_rope_scaling={})
        new = _prompts(44, 84, 320, seed=2)
        rollouts = [(p, s.output_ids) for p, s in zip(new, _generate(target, None, new, seed=3)[0])]
        held_prompts = _prompts(44, 84, 32, seed=1)
        held = [(p, s.output_ids) for p, s in zip(held_prompts, _generate(target, None, held_prompts, seed=4)[0])]

        init_parallel(tp_size=1, seed=0)
        try:
            out = tmp_path / "refined"
            res = refine_eagle3(path, weak, rollouts, held, steps=60, out_dir=out, lr=1e-2, rows_per_step=1024,
                                warmup_steps=2, eval_every=20, progress=False)
        finally:
            destroy_parallel()

        assert res["rows"] == len(rollouts) * NEW_TOKENS and res["held_out_rows"] == len(held) * NEW_TOKENS
        assert len(res["curve"]) == 4 and res["curve"][0] == (0, res["before"]["draft/eval_tau"])
        assert res["after"]["draft/eval_tau"] > res["before"]["draft/eval_tau"] + 0.3, res
        before_head, after_head = load_eagle3(weak, cfg), load_eagle3(out, cfg)
        assert after_head.cfg.aux_layer_ids == before_head.cfg.aux_layer_ids
        assert torch.equal(after_head.d2t, before_head.d2t)  # the draft vocabulary is kept
        assert not torch.equal(after_head.fc.weight, before_head.fc.weight)

        def engine_accept(head) -> float:  # the native engine serves the export: acceptance, T=1, held-out prompts
            return _generate(target, Eagle3Drafter(head.eval(), target.embed_tokens), held_prompts, seed=7)[1] \
                .mean_accept_length

        engine = {"before": engine_accept(before_head), "after": engine_accept(after_head)}
        print("refinement:", {"tau": [round(t, 3) for _, t in res["curve"]], "engine_accept_length": engine})
        assert engine["after"] > engine["before"] + 0.2, (engine, res)
    finally:
        torch.set_num_threads(threads)
