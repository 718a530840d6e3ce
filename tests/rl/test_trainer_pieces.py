"""The trainer's logprob and train stages in-process (TP=1, gloo): device placement and --bf16.

The trainer is built as the launcher builds it, without a rollout engine (these stages never
call it): the rollouts are made up here, so the same batch goes through every configuration.

Device placement (issue 15, defect 7). On a GPU the model is on ``cuda`` while a tensor made
without ``device=`` lands on the CPU, and the first op mixing the two fails. Here the model is
on the CPU, so :class:`OtherDefaultDevice` sends every tensor that the package's own code makes
without a device to ``meta`` instead: torch's own device checks then fail exactly where a GPU
run would (model input, the gradient-norm accumulator, the token counts' all-reduce, ...).
Tensors that torch or megatron-core make for themselves are left alone (AdamW keeps its step
count on the CPU on purpose). The check runs again with online draft training (EAGLE-3 and MTP):
capture hooks on the logprob forward, the teacher, the DraftCache, the draft's held-out
evaluation and its update. Host tensors the package keeps on purpose (row selection from the
mask, ``cu_seqlens``, metric sums) say ``device="cpu"``, so every factory names its device.

bf16 training (defect 6): a --bf16 trainer must move the weights as the fp32 trainer does.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from megatron_spec.config import (
    CheckpointConfig,
    DataConfig,
    DraftConfig,
    GRPOConfig,
    LoggingConfig,
    ModelConfig,
    RolloutConfig,
    RunConfig,
    SpecConfig,
)
from megatron_spec.models.gpt import unwrap
from megatron_spec.parallel import destroy_parallel
from megatron_spec.rl.rollout_manager import RolloutManager
from megatron_spec.rl.rollouts import Rollout
from megatron_spec.rl.trainer import GRPOTrainer
from tests.device_utils import PACKAGE, OtherDefaultDevice


@pytest.fixture(scope="module")
def make_trainer(setup, tmp_path_factory):
    made = []
    mp = pytest.MonkeyPatch()
    mp.setattr(RolloutManager, "_start_engine", lambda self: None)  # no rollouts are generated here

    def make(*, bf16: bool = False, lr: float = 1e-3, draft: DraftConfig | None = None,
             spec: SpecConfig | None = None, rollout: RolloutConfig | None = None, **grpo) -> GRPOTrainer:
        cfg = RunConfig(
            model=ModelConfig(hf_checkpoint=setup.target, make_vocab_size_divisible_by=8, bf16=bf16),
            data=DataConfig(prompt_data="synthetic:sum", num_synthetic_prompts=8),
            draft=draft or DraftConfig(),
            spec=spec or SpecConfig(),
            rollout=rollout or RolloutConfig(),
            grpo=GRPOConfig(
                **{"prompts_per_step": 2, "grpo_group_size": 2, "micro_batch_size": 2, "lr": lr, **grpo}
            ),
            checkpoint=CheckpointConfig(save=str(tmp_path_factory.mktemp("run"))),
            logging=LoggingConfig(tensorboard_dir="none", quiet=True),
        ).validate()
        trainer = GRPOTrainer(cfg)
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.shutdown()
    mp.undo()
    destroy_parallel()


def made_up_rollouts(vocab: int, n: int = 4, seed: int = 0) -> list[Rollout]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(4, vocab, (5 + i,), generator=g).tolist()
        response = torch.randint(4, vocab, (6 - i % 2,), generator=g).tolist()
        out.append(Rollout(i // 2, i % 2, prompt, response, [-1.0] * len(response), "length", 0,
                           advantage=1.0 if i % 2 == 0 else -1.0))
    return out


def one_step(trainer: GRPOTrainer, rollouts: list[Rollout]) -> dict[str, float]:
    microbatches, _ = trainer.actor.old_logprobs(rollouts, trainer.task.pad_id)
    return trainer.actor.train(microbatches, trainer.step)


def weights(trainer: GRPOTrainer) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in unwrap(trainer.actor.model).parameters()])


def test_every_tensor_the_trainer_makes_is_on_the_models_device(make_trainer, setup):
    trainer = make_trainer()
    rollouts = made_up_rollouts(setup.cfg.vocab_size)
    mode = OtherDefaultDevice()
    with mode:  # raises (meta vs cpu, or .item() of a meta tensor) at the first tensor off the model's device
        stats = one_step(trainer, rollouts)
    assert stats["train/grad_norm"] > 0
    assert mode.redirected == [], f"tensors made without a device at {mode.redirected}"


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_online_draft_training_makes_every_tensor_on_the_models_device(make_trainer, setup, kind):
    """The same check with online draft training on: the capture hooks on the logprob forward,
    the teacher, the DraftCache, the draft's held-out evaluation and its update (EAGLE-3: the
    head's training-time-test unroll, hard and soft losses; MTP: its layers beside the policy)."""
    draft = DraftConfig(spec_draft_kind=kind, spec_online_draft_training=True, spec_draft_ttt_steps=2,
                        spec_draft_path=setup.eagle3 if kind == "eagle3" else None)
    trainer = make_trainer(draft=draft)
    device = trainer.actor.device
    draft = trainer.actor.draft.module
    assert {p.device for p in draft.parameters()} == {device}, "the draft is not on the policy's device"
    rollouts = made_up_rollouts(setup.cfg.vocab_size)
    mode = OtherDefaultDevice()
    with mode:
        one_step(trainer, rollouts)  # captures on the logprob forward
        stats = trainer.actor.train_draft(trainer.step)
        if kind == "eagle3":  # the hard loss looks its labels up in the draft vocabulary
            trainer.actor.draft.config = dataclasses.replace(trainer.actor.draft.config, loss="hard")
            one_step(trainer, rollouts)
            hard = trainer.actor.train_draft(trainer.step)
    assert stats["capture/rows"] > 0 and stats["draft/rows"] > 0 and stats["draft/grad_norm"] > 0
    if kind == "eagle3":
        assert stats["draft/heldout_rows"] > 0 and hard["draft/grad_norm"] > 0
    assert mode.redirected == [], f"tensors made without a device at {sorted(set(mode.redirected))}"


def test_the_check_catches_a_tensor_made_without_a_device():
    # what _grad_norm did before issue 15: a zero made on the default device, plus the model's values
    code = compile(
        "torch.zeros(()) + torch.ones((), device=device)", os.path.join(PACKAGE, "rl", "trainer.py"), "eval"
    )
    mode = OtherDefaultDevice()
    with mode, pytest.raises((RuntimeError, NotImplementedError)):
        float(eval(code, {"torch": torch, "device": torch.device("cpu")}))
    assert mode.redirected == ["rl/trainer.py:1"]


def updates(make_trainer, setup, *, lr: float, steps: int) -> dict[str, torch.Tensor]:
    """The weight updates of an fp32 and a --bf16 trainer over the same batches (and the bf16
    trainer's fp32 main weights' update, and the check that its weights are those rounded)."""
    out = {}
    rollouts = made_up_rollouts(setup.cfg.vocab_size)
    for bf16 in (False, True):
        torch.manual_seed(0)
        trainer = make_trainer(bf16=bf16, lr=lr, clip_grad=0.0)
        before = weights(trainer)
        for _ in range(steps):
            one_step(trainer, rollouts)
        out["bf16" if bf16 else "fp32"] = weights(trainer) - before
        if bf16:
            main = getattr(trainer.actor.optimizer, "main_params", None)
            out["main"] = torch.cat([m.detach().flatten() for m in main]) - before if main else None
            out["rounded"] = main is not None and all(torch.equal(p, m.to(p.dtype)) for p, m in
                                                      zip(unwrap(trainer.actor.model).parameters(), main))
    return out


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(cosine, |a - b| / |b|) of two update vectors."""
    return (torch.nn.functional.cosine_similarity(a, b, dim=0).item(), ((a - b).norm() / b.norm()).item())


def test_bf16_training_keeps_the_small_updates_fp32_makes(make_trainer, setup):
    # issue 15's measurement: lr 1e-6 for 10 steps. AdamW's first steps move every weight by ~lr,
    # far below half a bf16 ulp (2^-13 / 2 at |w| = 0.02..0.03): bf16 weights stepped in place keep
    # almost all of them (here 1.2% of the weights changed, the ones near 0; cosine to the fp32
    # update 0.10). The fp32 main weights follow the fp32 run (measured: cosine 0.994, relative
    # difference 0.11, the rest from bf16 arithmetic in forward and backward), and the bf16 weights
    # are them rounded: 6.5% change, and more as the updates add up.
    upd = updates(make_trainer, setup, lr=1e-6, steps=10)
    moved = (upd["bf16"] != 0).float().mean().item()
    assert moved > 0.04, f"only {moved:.1%} of the bf16 weights changed"
    assert upd["main"] is not None, "the --bf16 trainer keeps no fp32 main weights"
    cos, rel = compare(upd["main"], upd["fp32"])
    assert cos > 0.98 and rel < 0.2, (
        f"fp32 main weights' update vs fp32 run: cosine {cos:.3f}, relative {rel:.3f}"
    )
    assert upd["rounded"], "the bf16 weights are not the fp32 main weights rounded"


def test_bf16_weights_move_as_fp32_weights_do(make_trainer, setup):
    # updates of a few bf16 ulps: measured cosine 0.946, relative difference 0.35 (bf16 AdamW in
    # place: 0.68 and 0.74)
    upd = updates(make_trainer, setup, lr=1e-4, steps=3)
    cos, rel = compare(upd["bf16"], upd["fp32"])
    assert cos > 0.9 and rel < 0.5, f"bf16 update vs fp32: cosine {cos:.3f}, relative difference {rel:.3f}"


def test_mem_fraction_static_reaches_sglangs_server_args(monkeypatch, setup):
    """--rollout-mem-fraction-static is SGLang's own ServerArgs.mem_fraction_static (checked by
    SGLang's class before its engine would start)."""
    pytest.importorskip("sglang")
    from megatron_spec.rollout import make_engine, sglang_backend
    from megatron_spec.rollout.config import EngineConfig

    class Launched(Exception):
        pass

    def launch(**kwargs):
        raise Launched(kwargs)

    monkeypatch.setattr(sglang_backend, "_launch_sglang", launch)
    with pytest.raises(Launched) as got:
        make_engine(
            EngineConfig(model_path=setup.target, dtype="bfloat16"), "sglang", mem_fraction_static=0.4
        )
    assert got.value.args[0]["mem_fraction_static"] == 0.4
    from sglang.srt.server_args import ServerArgs

    assert ServerArgs(**got.value.args[0]).mem_fraction_static == 0.4


def test_every_rollout_trains_once_in_minibatches(make_trainer, setup):
    """Issue 17, defect 1: 12 rollouts, micro-batch 8, 4 minibatches. Before, the list of 2
    micro-batches was cut into 4 parts of 2 // 4 = 0: four optimizer steps on zero gradients."""
    trainer = make_trainer(grpo_num_minibatches=4, micro_batch_size=8)
    rollouts = made_up_rollouts(setup.cfg.vocab_size, n=12)
    minibatches, mism = trainer.actor.old_logprobs(rollouts, trainer.task.pad_id)
    assert [sum(b.input_ids.shape[0] for b, _, _ in mb) for mb in minibatches] == [3, 3, 3, 3]
    stats = trainer.actor.train(minibatches, trainer.step)
    assert stats["train/samples_trained"] == 12 and stats["train/optimizer_steps"] == 4
    assert (
        0 < stats["train/entropy"] <= math.log(setup.cfg.vocab_size)
        and mism["mismatch/out_of_support_frac"] == 0
    )


def test_top_k_tokens_outside_the_support_are_left_out(make_trainer, setup):
    """Defect 2: made-up responses are random tokens, most of them outside a top-3 support: they
    leave the loss (no NaN), the rest train; entropy is of the 3-token distribution."""
    trainer = make_trainer(
        rollout=RolloutConfig(rollout_top_k=3, rollout_temperature=1.0), kl_coef=0.01, tis_cap=2.0
    )
    rollouts = made_up_rollouts(setup.cfg.vocab_size, n=4)
    minibatches, mism = trainer.actor.old_logprobs(rollouts, trainer.task.pad_id)
    assert 0.5 < mism["mismatch/out_of_support_frac"] < 1.0  # a random token is in a top-3 of ~100 rarely
    assert all(math.isfinite(v) for v in mism.values())
    stats = trainer.actor.train(minibatches, trainer.step)
    assert all(math.isfinite(v) for v in stats.values()), stats
    assert 0 < stats["train/entropy"] <= math.log(3) + 1e-6 and stats["train/samples_trained"] >= 1


def test_dynamic_sampling_drops_groups_of_equal_rewards(make_trainer, setup):
    trainer = make_trainer(dynamic_sampling=True)
    rollouts = made_up_rollouts(setup.cfg.vocab_size, n=4)
    for r, reward in zip(rollouts, [1.0, 1.0, 0.0, 1.0]):  # group 0 all equal, group 1 not
        r.reward = reward
    minibatches, mism = trainer.actor.old_logprobs(rollouts, trainer.task.pad_id)
    assert mism["train/groups_filtered"] == 1
    assert trainer.actor.train(minibatches, trainer.step)["train/samples_trained"] == 2
    for r in rollouts:
        r.reward = 0.0
    # nothing left: no optimizer step
    minibatches, mism = trainer.actor.old_logprobs(rollouts, trainer.task.pad_id)
    before = weights(trainer)
    stats = trainer.actor.train(minibatches, trainer.step)
    assert stats["train/samples_trained"] == 0 and stats["train/optimizer_steps"] == 0
    assert torch.equal(weights(trainer), before)


def test_sglang_logprobs_are_renormalised_to_the_support(make_trainer, setup):
    """SGLang reports log softmax(logits / T) of the sampled token, not renormalised to the top-k
    set: log p(t) + log Z. Given exactly those, the trainer's renormalisation brings the mismatch
    to rounding; without it (a native engine's numbers are already renormalised) it is |log Z|."""
    from megatron_spec.rl.rollouts import pack

    trainer = make_trainer(rollout=RolloutConfig(rollout_top_k=3, rollout_temperature=1.0))
    rollouts = made_up_rollouts(setup.cfg.vocab_size, n=4)
    batch = pack(rollouts, trainer.task.pad_id, device=trainer.actor.device)
    with torch.no_grad():
        logits = trainer.actor.model(batch.input_ids, batch.position_ids, attention_mask=None)[:, :-1]
        full = torch.log_softmax(logits[..., :setup.cfg.vocab_size].float(), dim=-1)  # [B, L-1, V]
        top = logits[..., :setup.cfg.vocab_size].topk(3, dim=-1).indices  # [B, L-1, 3]
    for i, r in enumerate(rollouts):  # one response token (the prompt alone decides its logits), from the
        start = len(r.prompt_ids) - 1  # top-3 set, with the log-prob SGLang would report
        token = int(top[i, start, i % 3])
        r.response_ids, r.engine_logprobs = [token], [float(full[i, start, token])]
    trainer.actor.renormalise = False  # a native engine (the trainer decides it from the backend)
    _, native = trainer.actor.old_logprobs(rollouts, trainer.task.pad_id)
    trainer.actor.renormalise = True  # SGLang with a truncating sampler
    _, sglang = trainer.actor.old_logprobs(rollouts, trainer.task.pad_id)
    assert native["mismatch/out_of_support_frac"] == 0 and sglang["mismatch/out_of_support_frac"] == 0
    assert native["mismatch/logprob_abs_diff_mean"] > 0.1  # |log Z|: the top 3 of ~100 near-equal logits
    assert sglang["mismatch/logprob_abs_diff_max"] < 1e-5


def test_a_cpu_trainer_keeps_its_heap_once_its_policy_is_built(make_trainer, monkeypatch):
    # megatron_spec.host_memory.keep_heap (its effect is tested in tests/test_host_memory.py) is called once
    # the actor's policy, reference and optimizer exist, so they keep their own mappings and what the steps
    # allocate stays on the heap
    import megatron_spec.rl.actor as actor_module

    calls = []
    plan = actor_module.PolicyActor._colocate_offload

    def offload_plan(self):  # the actor's last piece before the call
        calls.append(("built", self.optimizer is not None and self.model is not None))
        return plan(self)

    monkeypatch.setattr(actor_module.PolicyActor, "_colocate_offload", offload_plan)
    monkeypatch.setattr(actor_module, "keep_heap", lambda: calls.append("keep_heap") or "kept")
    trainer = make_trainer()
    assert trainer.actor.device.type == "cpu" and calls == [("built", True), "keep_heap"]
