"""The EAGLE-3 head against ModelOpt's own EAGLE module, the KV-cache path and the aux convention.

ModelOpt runs the draft in ``HFEagleModel.forward``: row t pairs ``fc(aux at t)`` with the
embedding of token t+1 at position t; in eval mode one TTT step, in train mode ``eagle_ttt_steps``.
We capture its ``eagle_module`` output (post-norm, pre-norm, cache) and the draft ``lm_head`` output
with forward hooks and recompute both from the exported checkpoint.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_spec.draft import load_eagle3, select_aux_hidden_states, ttt_attention_mask
from megatron_spec.draft.eagle3 import Eagle3Head

pytestmark = pytest.mark.modelopt

ATOL = 1e-5


@pytest.fixture(scope="module")
def hf_target(drafts):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(drafts.target_dir, dtype=torch.float32).eval()


def _draft_lm_head(model):
    return model.eagle_module.lm_head if hasattr(model.eagle_module, "lm_head") else model.lm_head


def modelopt_forward(
    model, ids: torch.Tensor, *, train: bool = False
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(draft logits, pre-norm hidden) of each TTT step of ModelOpt's own forward."""
    hidden, logits = [], []
    handles = [
        model.eagle_module.register_forward_hook(lambda m, a, out: hidden.append(out[1])),
        _draft_lm_head(model).register_forward_hook(lambda m, a, out: logits.append(out)),
    ]
    model._cached_attn_blk_masks = {}  # ModelOpt caches TTT masks per step for one sequence length
    model.train(train)
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        model.eval()
        model._cached_attn_blk_masks = {}
        for h in handles:
            h.remove()
    logits = logits[-len(hidden):]  # with the target's lm_head, its own call comes first
    return list(zip(logits, hidden))


def modelopt_draft_tensors(model):
    """ModelOpt's in-memory draft weights under export names (what the exporter writes)."""
    named = [(n, t) for n, t in model.eagle_module.state_dict().items()]
    if not hasattr(model.eagle_module, "lm_head"):
        named.append(("lm_head.weight", model.lm_head.weight))
    return named


@contextlib.contextmanager
def perturbed_norms(model, seed: int = 0):
    """Move every draft RMSNorm weight away from 1 (training keeps input_layernorm at ones)."""
    params = {n: p for n, p in model.eagle_module.named_parameters() if "norm" in n}
    saved = {n: p.detach().clone() for n, p in params.items()}
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params.values():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    try:
        yield
    finally:
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])


def head_inputs(hf_target, head: Eagle3Head, ids: torch.Tensor, *, shift: int = 1):
    """(embeds of tokens t+1, fc(aux at t)) with aux = transformers' hidden_states[i + shift]."""
    with torch.no_grad():
        out = hf_target(input_ids=ids, output_hidden_states=True)
        if shift == 1:
            aux = select_aux_hidden_states(out.hidden_states, head.cfg.aux_layer_ids)
        else:
            aux = torch.cat([out.hidden_states[i + shift] for i in head.cfg.aux_layer_ids], dim=-1)
        embeds = hf_target.model.embed_tokens(ids.roll(-1, 1))
        return embeds, head.fuse(aux)


@pytest.mark.parametrize("which", ["reduced", "full"])
def test_first_step_equals_modelopt(drafts, hf_target, which):
    res = getattr(drafts, which)
    ids = torch.randint(4, drafts.target_cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(5))
    # ModelOpt trains with plain RoPE (the YaRN in the export is for serving) and
    # hidden_norm(input_layernorm(h)).
    head = load_eagle3(res.path, drafts.target_cfg, rope_scaling=None, double_hidden_norm=True)
    assert head.cfg.aux_layer_ids == res.aux_layer_ids
    (ref_logits, ref_hidden), = modelopt_forward(res.model, ids)
    with torch.no_grad():
        out = head.forward_full(*head_inputs(hf_target, head, ids))
    assert out.logits.shape == (2, 19, res.draft_vocab_size)
    torch.testing.assert_close(out.logits, ref_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.hidden, ref_hidden, atol=ATOL, rtol=0)

    # With norms away from 1 (the head takes ModelOpt's in-memory weights by export name).
    with perturbed_norms(res.model):
        head.load_weights(modelopt_draft_tensors(res.model))
        (ref_logits, ref_hidden), = modelopt_forward(res.model, ids)
        with torch.no_grad():
            inputs = head_inputs(hf_target, head, ids)
            out = head.forward_full(*inputs)
            torch.testing.assert_close(out.logits, ref_logits, atol=ATOL, rtol=0)
            torch.testing.assert_close(out.hidden, ref_hidden, atol=ATOL, rtol=0)
            # SGLang's hidden_norm(h) is a different function once input_layernorm is not all ones.
            serving = load_eagle3(res.path, drafts.target_cfg, rope_scaling=None)
            serving.load_weights(modelopt_draft_tensors(res.model))
            assert (serving.forward_full(*inputs).hidden - ref_hidden).abs().max() > 1e-2


def test_serving_semantics_close_to_modelopt_with_frozen_input_layernorm(drafts, hf_target):
    # Trained with input_layernorm frozen at ones: hidden_norm(h) and hidden_norm(input_layernorm(h))
    # differ only through RMSNorm's eps (relative eps / mean(h^2), ~1e-3 for this tiny fc).
    res = drafts.reduced
    head = load_eagle3(res.path, drafts.target_cfg, rope_scaling=None)
    assert torch.equal(head.input_layernorm.weight, torch.ones(64))
    ids = torch.randint(4, drafts.target_cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    (ref_logits, _), = modelopt_forward(res.model, ids)
    with torch.no_grad():
        out = head.forward_full(*head_inputs(hf_target, head, ids))
    torch.testing.assert_close(out.logits, ref_logits, atol=2e-2, rtol=0)
    assert (out.logits.argmax(-1) == ref_logits.argmax(-1)).float().mean() > 0.9


def test_aux_layer_ids_index_layer_outputs(drafts, hf_target):
    # Aux id i is the OUTPUT of layer i == transformers' hidden_states[i + 1] (ModelOpt's forward hooks on
    # model.layers[i]); hidden_states[i] (the input of layer i) must give a different draft.
    res = drafts.full  # ids [0, 1, 2]
    head = load_eagle3(res.path, drafts.target_cfg, rope_scaling=None, double_hidden_norm=True)
    ids = torch.randint(4, drafts.target_cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(7))
    (ref_logits, _), = modelopt_forward(res.model, ids)
    with torch.no_grad():
        right = head.forward_full(*head_inputs(hf_target, head, ids, shift=1)).logits
        wrong = head.forward_full(*head_inputs(hf_target, head, ids, shift=0)).logits
    torch.testing.assert_close(right, ref_logits, atol=ATOL, rtol=0)
    assert (wrong - ref_logits).abs().max() > 1e-2


def test_select_aux_refuses_post_norm_last_entry():
    states = [torch.zeros(1, 2, 4) for _ in range(5)]  # embeddings + 4 layers
    with pytest.raises(ValueError, match="post-final-norm"):
        select_aux_hidden_states(states, [1, 3])


def test_second_ttt_step_equals_modelopt_training(drafts, hf_target):
    # Train mode unrolls eagle_ttt_steps=2: step 1 feeds step 0's pre-norm hidden shifted one row and
    # attends over [step-0 keys ; step-1 keys] with ModelOpt's TTT mask.
    res = drafts.reduced
    head = load_eagle3(res.path, drafts.target_cfg, rope_scaling=None, double_hidden_norm=True)
    ids = torch.randint(4, drafts.target_cfg.vocab_size, (2, 14), generator=torch.Generator().manual_seed(8))
    steps = modelopt_forward(res.model, ids, train=True)
    assert len(steps) == 2
    with torch.no_grad():
        embeds, h0 = head_inputs(hf_target, head, ids)
        out0 = head.forward_full(embeds, h0)
        out1 = head.forward_full(embeds, out0.hidden.roll(1, 1), attn_mask=ttt_attention_mask(14, 1),
                                 past_kv=out0.kv)
    for ours, (ref_logits, ref_hidden) in zip((out0, out1), steps):
        torch.testing.assert_close(ours.logits, ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(ours.hidden, ref_hidden, atol=ATOL, rtol=0)


def test_ttt_mask_hand_computed():
    # T=3, step 1: row q sees step-0 keys <= q-1 and its own step-1 key (q + 3 - 0)
    expected = torch.tensor([[0, 0, 0, 1, 0, 0],
                             [1, 0, 0, 0, 1, 0],
                             [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    assert torch.equal(ttt_attention_mask(3, 1), expected)
    assert torch.equal(ttt_attention_mask(3, 0), torch.ones(3, 3, dtype=torch.bool).tril())


@pytest.mark.parametrize("which", ["reduced", "full"])
def test_engine_mode_equals_full_sequence(drafts, which):
    # As served (YaRN from the export for "reduced"), fp32: a 6-row extend then 1-row steps over the
    # KV cache, each row fed its own hidden input, equals one full-sequence forward.
    res = getattr(drafts, which)
    head = load_eagle3(res.path, drafts.target_cfg)
    if which == "reduced":
        assert head.cfg.rope_scaling == {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 2048,
        }
        assert head.rotary.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
    g = torch.Generator().manual_seed(9)
    b, t, h = 2, 11, head.cfg.hidden_size
    embeds = torch.randn(b, t, h, generator=g)
    hidden = torch.randn(b, t, h, generator=g) * 0.5
    with torch.no_grad():
        full = head.forward_full(embeds, hidden)
        cache = head.new_cache(num_slots=3, max_len=32)
        pos = torch.arange(t).expand(b, t)
        logits, hid = head(embeds[:, :6], hidden[:, :6], pos[:, :6], cache, torch.full((b,), 6))
        chunks_l, chunks_h = [logits], [hid]
        for i in range(6, t):
            logits, hid = head(
                embeds[:, i : i + 1], hidden[:, i : i + 1], pos[:, i : i + 1], cache, torch.full((b,), i + 1)
            )
            chunks_l.append(logits)
            chunks_h.append(hid)
        last, _ = head(embeds[:, -1:], hidden[:, -1:], pos[:, -1:], cache, torch.full((b,), t),
                       logits_index=torch.zeros(b, 1, dtype=torch.long))
    torch.testing.assert_close(torch.cat(chunks_l, 1), full.logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(chunks_h, 1), full.hidden, atol=ATOL, rtol=0)
    torch.testing.assert_close(last, full.logits[:, -1:], atol=ATOL, rtol=0)


def test_extend_of_selected_rows_keeps_every_key(drafts):
    # The engine's draft extend asks for one row per sequence (logits_index): the other rows
    # skip attention output and MLP but their keys/values must still enter the cache, so the
    # selected rows and every later step equal the full-sequence forward.
    head = load_eagle3(drafts.reduced.path, drafts.target_cfg)
    g = torch.Generator().manual_seed(11)
    b, t, h = 3, 9, head.cfg.hidden_size
    embeds = torch.randn(b, t, h, generator=g)
    hidden = torch.randn(b, t, h, generator=g) * 0.5
    lens = torch.tensor([6, 4, 5])  # rows of different lengths, padded to 6 (the engine's pending pairs)
    with torch.no_grad():
        full = head.forward_full(embeds, hidden)
        cache = head.new_cache(num_slots=b, max_len=32)
        pos = torch.arange(6).expand(b, 6)
        last = (lens - 1).unsqueeze(1)  # [B, 1]
        logits, hid = head(embeds[:, :6], hidden[:, :6], pos, cache, lens, logits_index=last)
        assert logits.shape == (b, 1, head.cfg.draft_vocab_size) and hid.shape == (b, 1, h)
        for i in range(b):
            n = int(lens[i])
            torch.testing.assert_close(logits[i, 0], full.logits[i, n - 1], atol=ATOL, rtol=0)
            torch.testing.assert_close(hid[i, 0], full.hidden[i, n - 1], atol=ATOL, rtol=0)
            torch.testing.assert_close(cache.k[0][i, :, :n], full.kv[0][i, :, :n], atol=ATOL, rtol=0)
        # the next row of each sequence attends to all keys the extend wrote
        nxt = lens.view(b, 1)
        step_logits, _ = head(embeds.gather(1, nxt.unsqueeze(-1).expand(-1, -1, h)),
                              hidden.gather(1, nxt.unsqueeze(-1).expand(-1, -1, h)), nxt, cache, lens + 1)
    for i in range(b):
        torch.testing.assert_close(step_logits[i, 0], full.logits[i, int(lens[i])], atol=ATOL, rtol=0)


def test_yarn_tables_match_sglang(drafts):
    yarn = pytest.importorskip("sglang.srt.layers.rotary_embedding.yarn")
    from megatron_spec.draft.rope import ScaledRotary

    cfg = load_eagle3(drafts.reduced.path, drafts.target_cfg).cfg
    scaling = cfg.rope_scaling
    # SGLang's YaRNScalingRotaryEmbedding math on a bare instance (its __init__ wants CUDA/vLLM kernels).
    ref = yarn.YaRNScalingRotaryEmbedding.__new__(yarn.YaRNScalingRotaryEmbedding)
    torch.nn.Module.__init__(ref)
    ref.rotary_dim, ref.base = cfg.head_dim, cfg.rope_theta
    ref.max_position_embeddings = scaling["original_max_position_embeddings"]
    ref.scaling_factor, ref.extrapolation_factor, ref.beta_fast, ref.beta_slow, ref.truncate = (
        32.0,
        1,
        32,
        1,
        True,
    )
    ref.mscale = yarn.yarn_get_mscale_simple(32.0)
    cache = ref._compute_cos_sin_cache()[:cfg.max_position_embeddings]  # [P, d] = cat(cos, sin) halves
    ours = ScaledRotary(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, scaling)
    half = cfg.head_dim // 2
    torch.testing.assert_close(ours.cos[:, :half], cache[:, :half], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin[:, :half], cache[:, half:], atol=1e-6, rtol=0)


def test_d2t_is_modelopt_calibration(drafts):
    res = drafts.reduced
    head = load_eagle3(res.path, drafts.target_cfg)
    torch.testing.assert_close(head.d2t, res.model.eagle_module.d2t, atol=0, rtol=0)
    counts = torch.bincount(torch.tensor([t for s in drafts.sequences for t in s]), minlength=84)
    in_draft = torch.zeros(84, dtype=torch.bool)
    in_draft[head.target_ids] = True
    assert counts[in_draft].min() >= counts[~in_draft].max()  # the 32 most frequent training tokens
    assert torch.equal(head.draft_to_target(torch.arange(32)), head.target_ids)


def test_native_target_aux_feeds_head_like_modelopt(drafts):
    # The engine's path end to end: the native CausalLM's aux output (outputs of aux_layer_ids) -> fuse ->
    # the head over its KV cache, with next-token embeddings at the same positions, equals ModelOpt's forward.
    from megatron_spec.models.checkpoint import HFCheckpoint
    from megatron_spec.rollout.native.model import CausalLM

    res = drafts.full
    head = load_eagle3(res.path, drafts.target_cfg, rope_scaling=None, double_hidden_norm=True)
    target = CausalLM(drafts.target_cfg, max_positions=64)
    ckpt = HFCheckpoint(drafts.target_dir)
    target.load_weights((n, ckpt.get(n)) for n in sorted(ckpt.names()))
    b, t = 2, 13
    ids = torch.randint(4, drafts.target_cfg.vocab_size, (b, t), generator=torch.Generator().manual_seed(10))
    (ref_logits, ref_hidden), = modelopt_forward(res.model, ids)
    pos, lens = torch.arange(t).expand(b, t), torch.full((b,), t)
    with torch.no_grad():
        _, aux = target(ids, pos, target.new_cache(b, 32), lens, aux_layers=head.cfg.aux_layer_ids)
        embeds = target.embed_tokens(ids.roll(-1, 1))
        logits, hidden = head(embeds, head.fuse(aux), pos, head.new_cache(b, 32), lens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(hidden, ref_hidden, atol=ATOL, rtol=0)
