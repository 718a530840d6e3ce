"""Capture hooks on a real megatron-core GPTModel (TP=1) against transformers on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.capture import Capture, CaptureConfig
from megatron_spec.capture.config import default_aux_layer_ids
from megatron_spec.capture.hooks import response_mask_from_targets
from megatron_spec.draft.eagle3 import select_aux_hidden_states


def _batch(vocab: int, b: int = 3, s: int = 14, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[0, 5:] = True  # a response to the end
    mask[1, 3:7] = True  # two runs in one row: a hole at 7..8
    mask[1, 9:12] = True
    mask[2, 0:4] = True  # position 0 is never captured (nothing precedes x_0)
    return ids, torch.arange(s).expand(b, s), mask


def _rows(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m = mask.clone()
    m[:, 0] = False
    b, t = m.nonzero(as_tuple=True)
    return b, t


@pytest.fixture(scope="module")
def hf_outputs(capture_target):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(capture_target, dtype=torch.float32).eval()
    ids, _, _ = _batch(hf.config.vocab_size)
    with torch.no_grad():
        return hf(ids, output_hidden_states=True)


def test_aux_states_are_layer_outputs_modelopt_convention(policy, hf_outputs):
    cfg = policy.decoder_config
    ids, pos, mask = _batch(cfg.vocab_size)
    aux_ids = default_aux_layer_ids(cfg.num_layers)
    assert aux_ids == (1, 3, 4)
    cap = Capture(CaptureConfig(storage_dtype="float32", teacher_topk=5))  # aux ids: ModelOpt's default
    with torch.no_grad(), cap.record(policy, mask):
        policy(ids, pos, attention_mask=None)
    cache = cap.take()
    b, t = _rows(mask)
    hs = hf_outputs.hidden_states
    ref = select_aux_hidden_states(hs, aux_ids)[b, t - 1]  # hidden_states[i + 1] = output of layer i
    assert (cache.aux - ref).abs().max().item() < 1e-5
    # the same rows taken one layer too early ("input of layer i" = hidden_states[i]) are far off:
    off_by_one = torch.cat([hs[i][b, t - 1] for i in aux_ids], -1)
    assert (cache.aux - off_by_one).abs().max().item() > 1e-2
    # and one position too late (features at t instead of t-1) too
    late = select_aux_hidden_states(hs, aux_ids)[b, t]
    assert (cache.aux - late).abs().max().item() > 1e-2
    assert torch.equal(cache.embeds, hs[0][b, t])  # embedding of x_t
    assert torch.equal(cache.tokens, ids[b, t]) and torch.equal(cache.positions, t - 1)


def test_segments_next_tokens_teacher_and_logprobs(policy, hf_outputs):
    cfg = policy.decoder_config
    ids, pos, mask = _batch(cfg.vocab_size)
    cap = Capture(CaptureConfig(aux_layer_ids=(6, 0), storage_dtype="float32", teacher_topk=4))
    with torch.no_grad(), cap.record(policy, mask):
        policy(ids, pos, attention_mask=None)
    cache = cap.take()
    # rows: b0 t=5..13 (9), b1 t=3..6 (4) and 9..11 (3), b2 t=1..3 (3)
    assert cache.cu_seqlens.tolist() == [0, 9, 13, 16, 19]
    b, t = _rows(mask)
    hs = hf_outputs.hidden_states
    torch.testing.assert_close(
        cache.aux, torch.cat([hs[7][b, t - 1], hs[1][b, t - 1]], -1), atol=1e-5, rtol=0
    )
    # x_{t+1} where it is captured too, else -1 (ends of runs)
    want_next = [
        ids[0, 6:].tolist() + [-1],
        ids[1, 4:7].tolist() + [-1],
        ids[1, 10:12].tolist() + [-1],
        ids[2, 2:4].tolist() + [-1],
    ]
    assert cache.next_tokens.tolist() == [x for seg in want_next for x in seg]
    logp = torch.log_softmax(hf_outputs.logits[b, t], -1)  # teacher at position t, full vocabulary
    want_lp, want_ids = logp.topk(4, dim=-1)
    assert torch.equal(cache.teacher_ids, want_ids)
    torch.testing.assert_close(cache.teacher_logprobs, want_lp, atol=1e-5, rtol=0)
    has = cache.next_tokens >= 0
    nxt_lp = logp.gather(1, cache.next_tokens.clamp(min=0).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(cache.next_logprobs[has], nxt_lp[has], atol=1e-5, rtol=0)
    assert torch.all(cache.next_logprobs[~has] == 0)


def test_prompt_context_rows_are_captured_unscored(policy):
    """prompt_context: every position 1 .. last response token is a row (the prompt and holes as
    context, as the engine's draft attends to them); only response rows are scored, and their
    features are those of the response-only capture."""
    cfg = policy.decoder_config
    ids, pos, mask = _batch(cfg.vocab_size)
    caches = {}
    for ctx in (False, True):
        cap = Capture(CaptureConfig(storage_dtype="float32", teacher_topk=4, prompt_context=ctx))
        with torch.no_grad(), cap.record(policy, mask):
            policy(ids, pos, attention_mask=None)
        caches[ctx] = cap.take()
    plain, ctx = caches[False], caches[True]
    assert plain.scored is None
    # rows: b0 t=1..13 (13), b1 t=1..11 (11: the hole 7..8 is context), b2 t=1..3 (3)
    assert ctx.cu_seqlens.tolist() == [0, 13, 24, 27]
    m = mask.clone()
    m[:, 0] = False
    want = torch.cat([m[0, 1:14], m[1, 1:12], m[2, 1:4]])
    assert torch.equal(ctx.scored, want)
    assert ctx.num_scored == plain.num_rows == 19
    for name in ("aux", "embeds", "tokens", "positions", "teacher_logprobs", "teacher_ids"):
        assert torch.equal(getattr(ctx, name)[ctx.scored], getattr(plain, name)), name
    # x_{t+1} is known inside a whole sequence now: only the last row of each has none
    assert (ctx.next_tokens < 0).nonzero().squeeze(1).tolist() == [12, 23, 26]


def test_mtp_features_and_reduced_vocab_full_teacher(policy, hf_outputs):
    cfg = policy.decoder_config
    ids, pos, mask = _batch(cfg.vocab_size)
    target_ids = torch.tensor([5, 17, 3, 40, 22, 9])
    cap = Capture(CaptureConfig(draft_kind="mtp", storage_dtype="float32", teacher_topk=None))
    with torch.no_grad(), cap.record(policy, mask):
        policy(ids, pos, attention_mask=None)
    cache = cap.take()
    b, t = _rows(mask)
    assert cache.aux is None
    # MTP reads the final-normed decoder output: transformers' last hidden_states entry
    torch.testing.assert_close(cache.hidden, hf_outputs.hidden_states[-1][b, t - 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(
        cache.teacher_logprobs, torch.log_softmax(hf_outputs.logits[b, t], -1), atol=1e-5, rtol=0
    )
    assert cache.teacher_log_mass is None  # the full vocabulary: the teacher is the target's distribution
    cap = Capture(CaptureConfig(draft_target_ids=target_ids, teacher_topk=None))
    with torch.no_grad(), cap.record(policy, mask):
        policy(ids, pos, attention_mask=None)
    reduced = cap.take()
    torch.testing.assert_close(
        reduced.teacher_logprobs,
        torch.log_softmax(hf_outputs.logits[b, t][:, target_ids], -1),
        atol=1e-5,
        rtol=0,
    )
    # and the target's mass on those ids, which the renormalised teacher leaves out
    mass = torch.softmax(hf_outputs.logits[b, t].double(), -1)[:, target_ids].sum(-1)
    torch.testing.assert_close(reduced.teacher_log_mass.double(), mass.log(), atol=1e-5, rtol=0)


def test_capture_leaves_the_model_untouched(policy):
    cfg = policy.decoder_config
    ids, pos, mask = _batch(cfg.vocab_size)
    hooks = lambda: sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in policy.modules())
    assert hooks() == 0
    with torch.no_grad():
        plain = policy(ids, pos, attention_mask=None)
        cap = Capture(CaptureConfig(storage_dtype="bfloat16"))
        with cap.record(policy, mask):
            assert hooks() > 0
            recorded = policy(ids, pos, attention_mask=None)
    assert hooks() == 0
    assert torch.equal(plain, recorded)  # bit-identical outputs
    cache = cap.take()
    assert cache.aux.dtype == torch.bfloat16 and cache.teacher_logprobs.dtype == torch.float32
    assert not any(t.requires_grad for t in (cache.aux, cache.embeds, cache.teacher_logprobs))


def test_training_forward_capture_is_detached(policy):
    cfg = policy.decoder_config
    ids, pos, mask = _batch(cfg.vocab_size)
    cap = Capture(CaptureConfig(draft_kind="mtp", forward="train"))
    assert cap.wants("train") and not cap.wants("logprob")
    with cap.record(policy, mask):
        logits = policy(ids, pos, attention_mask=None)
    assert logits.requires_grad
    cache = cap.take()
    assert cache.hidden.grad_fn is None and cache.embeds.grad_fn is None


def test_micro_batches_in_one_block_and_budget(policy):
    cfg = policy.decoder_config
    ids, pos, mask = _batch(cfg.vocab_size)
    cap = Capture(CaptureConfig(teacher_topk=2))
    with torch.no_grad(), cap.record(policy, mask[:2]) as rec:
        policy(ids[:2], pos[:2], attention_mask=None)
        rec.set_mask(mask[2:])
        policy(ids[2:], pos[2:], attention_mask=None)
    assert cap.take().cu_seqlens.tolist() == [0, 9, 13, 16, 19]
    # a budget of ~12 rows keeps whole segments in order and counts what it turned away
    probe = Capture(CaptureConfig(teacher_topk=2))
    with torch.no_grad(), probe.record(policy, mask):
        policy(ids, pos, attention_mask=None)
    row_bytes = probe.take().nbytes // 19
    cap = Capture(CaptureConfig(teacher_topk=2, max_bytes=row_bytes * 12 + 8))
    with torch.no_grad(), cap.record(policy, mask):
        policy(ids, pos, attention_mask=None)
    m = cap.metrics()
    cache = cap.take()
    assert cache.cu_seqlens.tolist() == [0, 9, 12]  # 9 + 4 would not fit; 9 + 3 does; then 3 more would not
    assert m["capture/dropped_rows"] == 7 and m["capture/rows"] == 12 and m["capture/bytes"] > 0
    assert m["capture/seconds"] > 0


def test_errors_name_the_problem(policy):
    cfg = policy.decoder_config
    ids, pos, mask = _batch(cfg.vocab_size)
    cap = Capture(CaptureConfig())
    with pytest.raises(ValueError, match=r"response_mask has shape \(3, 13\), input_ids \(3, 14\)"):
        with torch.no_grad(), cap.record(policy, mask[:, 1:]):
            policy(ids, pos, attention_mask=None)
    with pytest.raises(RuntimeError, match="second forward in one block needs set_mask"):
        with torch.no_grad(), cap.record(policy, mask):
            policy(ids, pos, attention_mask=None)
            policy(ids, pos, attention_mask=None)
    with pytest.raises(RuntimeError, match="ran no forward"):
        with cap.record(policy, mask):
            pass
    with pytest.raises(ValueError, match=r"aux layer ids \[1, 8\] out of range for a policy with 8 layers"):
        with Capture(CaptureConfig(aux_layer_ids=(1, 8))).record(policy, mask):
            pass
    with pytest.raises(ValueError, match="shard_across_tp=True with draft_kind 'mtp'"):
        CaptureConfig(draft_kind="mtp", shard_across_tp=True)
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in policy.modules()) == 0


def test_response_mask_from_targets():
    tgt = torch.tensor(
        [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    )  # position p: is input_ids[:, p+1] a response token
    assert response_mask_from_targets(tgt).tolist() == [
        [False, False, True, True],
        [False, True, False, False],
    ]
