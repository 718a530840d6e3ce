"""Under torchrun: the policy is bit-identical with capture + online draft training on or off.

Runs the same three policy steps twice in one process (draft machinery off, then on), with a
GRPO-like loss: a no-grad "old log-prob" forward (EAGLE-3 capture records it) and a training
forward (MTP capture records it), Megatron DDP, AdamW. With it on, an EAGLE-3 trainer (group:
the world, segments sharded over TP ranks) and an MTP trainer (DP group, TP-sharded layers)
step after every policy step. Asserts per rank:

* policy gradients (every step) and parameters (at the end) are bit-identical on vs off;
* no draft parameter is a leaf of the policy loss graph, and no tensor saved for the policy's
  backward shares storage with a draft parameter or a cached tensor; the draft steps leave the
  policy's gradients and parameters untouched;
* (TP > 1) the sequence-parallel gather of the capture rebuilds the full-sequence rows.

Rank 0 saves the trained draft weights and every rank its step-0 EAGLE-3 cache, so the test can
compare TP/DP layouts. Usage: draft_isolation.py CKPT_DIR TP OUT_PREFIX
"""

import contextlib
import sys

import torch

from megatron_spec.capture import Capture, CaptureConfig
from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.capture.recorder import Recorder
from megatron_spec.draft.eagle3 import Eagle3Config, Eagle3Head
from megatron_spec.draft.mtp import MtpTrainer
from megatron_spec.draft.mtp_head import MtpHead
from megatron_spec.draft.trainer import DraftTrainerConfig, Eagle3Trainer
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
from megatron_spec.parallel import destroy_parallel, init_parallel
from megatron_spec.train.ddp import finalize_grads, wrap_ddp, zero_grads

STEPS = 3
DRAFT_VOCAB = 40


def seeded_(tensors, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in tensors:
            if name.endswith("norm.weight"):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
            else:
                t.copy_(0.05 * torch.randn(t.shape, generator=g))


def make_eagle(cfg) -> Eagle3Trainer:
    ecfg = Eagle3Config.for_target(cfg, DRAFT_VOCAB, max_position_embeddings=64)
    head = Eagle3Head(ecfg)
    seeded_(
        [
            (n, t)
            for n, t in head.named_export_tensors()
            if n not in ("d2t", "layers.0.input_layernorm.weight")
        ],
        7,
    )
    with torch.no_grad():
        head.input_layernorm.weight.fill_(1.0)
        target_ids = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(8))[:DRAFT_VOCAB]
        head.d2t.copy_(target_ids - torch.arange(DRAFT_VOCAB))
    return Eagle3Trainer(head, DraftTrainerConfig(lr=1e-3, ttt_steps=2, micro_batch_rows=16))


def make_mtp(model, cfg) -> MtpTrainer:
    mtp = MtpTrainer(model, 1, DraftTrainerConfig(lr=1e-3, micro_batch_rows=16))
    init = dict(MtpHead(cfg, 1).named_export_tensors())
    init = {n: t.detach().clone() for n, t in init.items()}
    seeded_(init.items(), 9)
    mtp.load_hf(init)
    return mtp


def leaf_ids(loss: torch.Tensor) -> set[int]:
    seen, stack, out = set(), [loss.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        v = getattr(fn, "variable", None)
        if v is not None:
            out.add(id(v))
        stack.extend(f for f, _ in fn.next_functions)
    return out


def storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors if t is not None and t.numel()}


def run(info, ckpt, cfg, on: bool):
    model = build_gpt_model(cfg, vocab_divisible_by=8)
    load_hf_weights(model, ckpt)
    ddp = wrap_ddp(model)
    opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], lr=1e-3, eps=1e-6)
    eagle = make_eagle(cfg) if on else None
    mtp = make_mtp(model, cfg) if on else None
    cap_e = Capture.for_trainer(eagle, CaptureConfig(storage_dtype="float32", teacher_topk=4)) if on else None
    cap_m = (
        Capture.for_trainer(mtp, CaptureConfig(storage_dtype="float32", teacher_topk=4, forward="train"))
        if on
        else None
    )
    draft_params = list(eagle.head.parameters()) + list(mtp.draft.parameters()) if on else []
    grads, eagle_cache0 = [], None
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        batch = torch.randint(4, cfg.vocab_size, (4, 16), generator=g)
        adv = torch.randn(4, generator=g)
        per = batch.shape[0] // info.dp_size
        ids = batch[info.dp_rank * per : (info.dp_rank + 1) * per]
        a = adv[info.dp_rank * per : (info.dp_rank + 1) * per]
        pos = torch.arange(16).expand_as(ids)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[:, 6:] = True
        tmask = mask[:, 1:].float()
        with torch.no_grad(), cap_e.record(ddp, mask) if on else contextlib.nullcontext():
            logits = ddp(ids, pos, attention_mask=None)
        old = vocab_parallel_token_logprobs(
            logits[:, :-1], ids[:, 1:], vocab_size=cfg.vocab_size, tp_group=info.tp_group
        )
        zero_grads(ddp)
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: (saved.append(t), t)[1], lambda t: t
        ):
            with cap_m.record(ddp, mask) if on else contextlib.nullcontext():
                logits = ddp(ids, pos, attention_mask=None)
            lp = vocab_parallel_token_logprobs(
                logits[:, :-1], ids[:, 1:], vocab_size=cfg.vocab_size, tp_group=info.tp_group
            )
            loss = -((lp - old).exp() * a.unsqueeze(1) * tmask).sum() / tmask.sum()
        if on:
            cache_e, cache_m = cap_e.take(), cap_m.take()
            leaves = leaf_ids(loss)
            assert {id(p) for p in model.parameters()} <= leaves, "graph walk missed policy parameters"
            assert not leaves & {id(p) for p in draft_params}, (
                "a draft parameter is a leaf of the policy loss"
            )
            cached = storages(cache_e._tensors() + cache_m._tensors())
            assert not storages(saved) & (storages(draft_params) | cached), (
                "policy backward saves a draft tensor"
            )
            assert all(t.grad_fn is None for t in cache_m._tensors())
            if step == 0:
                eagle_cache0 = cache_e
        loss.backward()
        finalize_grads(ddp)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        if on:
            before = {
                n: (p.detach().clone(), p.main_grad.detach().clone()) for n, p in model.named_parameters()
            }
            me = eagle.train_step(cache_e)
            mm = mtp.train_step(cache_m)
            assert me["draft/rows"] > 0 and mm["draft/rows"] > 0
            for n, p in model.named_parameters():
                assert torch.equal(p, before[n][0]) and torch.equal(p.main_grad, before[n][1]), n
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    drafts = None
    if on:
        drafts = {"eagle": dict(eagle.named_update_tensors()), "mtp": dict(mtp.named_update_tensors())}
    return grads, params, drafts, eagle_cache0


def check_sp_gather(info, model) -> None:
    rec = Recorder(Capture(CaptureConfig()), model, torch.ones(2, 8, dtype=torch.bool))
    full = torch.randn(8, 2, 5, generator=torch.Generator().manual_seed(3))  # [S, B, H], same on every rank
    index = (torch.tensor([0, 3, 7, 5]), torch.tensor([1, 0, 1, 0]))
    rec.sp = False
    want = rec._rows(full, index)
    rec.sp = True
    got = rec._rows(full.chunk(info.tp_size)[info.tp_rank], index)  # this rank's sequence shard
    assert torch.equal(got, want)


def main() -> None:
    ckpt_dir, tp, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    info = init_parallel(tp_size=tp, seed=1)
    ckpt = HFCheckpoint(ckpt_dir)
    cfg = ckpt.decoder_config
    g_off, p_off, _, _ = run(info, ckpt, cfg, on=False)
    g_on, p_on, drafts, cache0 = run(info, ckpt, cfg, on=True)
    for step, (a, b) in enumerate(zip(g_off, g_on)):
        for n in a:
            assert torch.equal(a[n], b[n]), f"step {step}: gradient of {n} differs with draft training on"
    for n in p_off:
        assert torch.equal(p_off[n], p_on[n]), f"parameter {n} differs with draft training on"
    if tp > 1:
        check_sp_gather(info, build_gpt_model(cfg, vocab_divisible_by=8))
    torch.save(
        {
            "cache": {
                k: getattr(cache0, k)
                for k in (
                    "tokens",
                    "aux",
                    "teacher_ids",
                    "teacher_logprobs",
                    "teacher_log_mass",
                    "next_logprobs",
                    "cu_seqlens",
                )
            },
            "tp_rank": info.tp_rank,
            "dp_rank": info.dp_rank,
        },
        f"{out}.rank{info.rank}.pt",
    )
    if info.rank == 0:
        torch.save(drafts, f"{out}.drafts.pt")
    print(f"OK tp={tp} dp={info.dp_size}: policy bit-identical with draft training on/off")
    destroy_parallel()


if __name__ == "__main__":
    main()
