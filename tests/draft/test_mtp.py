"""MTP heads: megatron-core's layers on detached states, HF naming, native drafter exactness, streaming."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.capture import Capture, CaptureConfig
from megatron_spec.config import DraftConfig
from megatron_spec.draft.mtp import MtpTrainer, load_mtp_head, save_mtp
from megatron_spec.draft.mtp_draft import MtpDraft
from megatron_spec.draft.mtp_head import MtpHead
from megatron_spec.draft.trainer import DraftTrainerConfig
from megatron_spec.models import HFCheckpoint
from megatron_spec.models.tiny import make_hf_checkpoint
from megatron_spec.rollout.native.engine import EngineCore
from megatron_spec.rollout.native.model import CausalLM
from megatron_spec.rollout.native.mtp_drafter import MtpDrafter
from megatron_spec.rollout.types import GenerateRequest, SamplingParams

FAMILIES = {"qwen3": dict(family="qwen3"), "llama_tied": dict(family="llama", tie_word_embeddings=True)}


@pytest.fixture(scope="module")
def policies(tmp_path_factory):
    """One TP=1 Megatron policy per family, with its HF checkpoint directory and native twin."""
    from megatron_spec.models.gpt import build_gpt_model, load_hf_weights
    from megatron_spec.parallel import destroy_parallel, init_parallel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    init_parallel(tp_size=1, seed=0)
    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for i, (name, kw) in enumerate(FAMILIES.items()):
        path = make_hf_checkpoint(
            root / name,
            num_layers=3,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_kv_heads=2,
            seed=20 + i,
            init_std=0.05,
            **kw,
        )
        ck = HFCheckpoint(path)
        cfg = ck.decoder_config
        model = build_gpt_model(cfg, vocab_divisible_by=8)
        load_hf_weights(model, ck)
        native = CausalLM(cfg).eval()
        native.load_weights(
            (n, ck.get(n)) for n in ck.names() if not (cfg.tie_word_embeddings and n == "lm_head.weight")
        )
        out[name] = (model.eval(), path, native)
    yield out
    destroy_parallel()
    torch.set_num_threads(threads)


def _megatron_mtp_logits(policy, draft: MtpDraft, seq: torch.Tensor, depth: int) -> torch.Tensor:
    """megatron-core's own MTP path (the layers' public forward: roll + embedding lookup) on ``seq``:
    logits ``[S, V]`` of depth ``depth`` (1-based)."""
    store = {}
    h = policy.decoder.final_layernorm.register_forward_hook(lambda m, a, o: store.__setitem__("h", o))
    s = seq.shape[1]
    pos = torch.arange(s).unsqueeze(0)
    with torch.no_grad():
        policy(seq, pos, attention_mask=None)
        h.remove()
        hidden, ids, p = store["h"], seq, pos
        rope = policy.rotary_pos_emb(s)
        for layer in draft.block.layers[:depth]:
            hidden, ids, p = layer(
                input_ids=ids,
                position_ids=p,
                hidden_states=hidden,
                attention_mask=None,
                rotary_pos_emb=rope,
                embedding=policy.embedding,
            )[:3]  # megatron-core 0.19 also returns the rolled padding mask
        return policy.output_layer(
            hidden,
            weight=policy.shared_embedding_or_output_weight()
            if policy.share_embeddings_and_output_weights
            else None,
        )[0][:, 0]


def test_policy_with_builtin_mtp_is_refused(policies):
    from megatron_spec.models.gpt import build_gpt_model

    model, path, _ = policies["qwen3"]
    inside = build_gpt_model(HFCheckpoint(path).decoder_config, vocab_divisible_by=8, mtp_num_layers=1)
    with pytest.raises(ValueError, match="their loss would reach the policy"):
        MtpDraft(inside, 1)
    with pytest.raises(ValueError, match="tv_weight is for the EAGLE-3 draft"):  # vocabulary-parallel heads
        MtpTrainer(model, 1, DraftTrainerConfig(tv_weight=1.0))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_detached_forward_equals_megatron_mtp_layers(policies, family):
    policy, _, _ = policies[family]
    trainer = MtpTrainer(policy, 2)
    ids = torch.randint(
        4, policy.decoder_config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)
    )
    cap = Capture.for_trainer(trainer, CaptureConfig(storage_dtype="float32"))
    with torch.no_grad(), cap.record(policy, torch.ones_like(ids, dtype=torch.bool)):
        policy(ids, torch.arange(12).expand(2, 12), attention_mask=None)
    cache = cap.take()
    with torch.no_grad():
        outs = trainer.draft(
            cache.padded("hidden", [0, 1]).transpose(0, 1), cache.padded("embeds", [0, 1]).transpose(0, 1)
        )
    for b in range(2):
        for depth in (1, 2):
            ref = _megatron_mtp_logits(policy, trainer.draft, ids[b : b + 1], depth)  # [12, V]
            ours = trainer.draft.logits(outs[depth - 1])[b]  # cache row q = position q (t - 1 = q)
            n = 12 - depth  # megatron's last `depth` rows read rolled-in zeros
            torch.testing.assert_close(ours[:n], ref[:n], atol=1e-5, rtol=0)


def test_training_never_touches_the_policy_and_names_round_trip(policies, tmp_path):
    policy, _, _ = policies["qwen3"]
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    trainer = MtpTrainer(policy, 2, DraftTrainerConfig(lr=3e-3, loss_decay=1.0), export_dir=tmp_path / "mtp")
    ids = torch.randint(
        4, policy.decoder_config.vocab_size, (4, 20), generator=torch.Generator().manual_seed(2)
    )
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, 5:] = True
    cap = Capture.for_trainer(trainer, CaptureConfig(teacher_topk=8))
    with torch.no_grad(), cap.record(policy, mask):
        policy(ids, torch.arange(20).expand(4, 20), attention_mask=None)
    cache = cap.take()
    weights = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    held = trainer.evaluate(cache)  # no update: the draft that is about to train, on what it trains on
    assert all(torch.equal(p, weights[n]) for n, p in trainer.module.named_parameters())
    first = trainer.train_step(cache)
    for _ in range(5):
        last = trainer.train_step(cache)
    assert (
        last["draft/loss_mtp0"] < first["draft/loss_mtp0"]
        and last["draft/loss_mtp1"] < first["draft/loss_mtp1"]
    )
    # every segment, loss_decay 1: evaluate's per-depth loss is the first step's, before its update
    assert held["draft/eval_rows"] == first["draft/rows"]
    for k in range(2):
        assert held[f"draft/eval_ce{k}"] == pytest.approx(first[f"draft/loss_mtp{k}"], rel=1e-5)
        assert held[f"draft/eval_top1_{k}"] == pytest.approx(first[f"draft/acc_mtp{k}"], rel=1e-5)
    after = trainer.evaluate(cache)
    assert (
        after["draft/eval_ce0"] < held["draft/eval_ce0"] and after["draft/eval_ce1"] < held["draft/eval_ce1"]
    )
    assert all(p.grad is None for p in policy.parameters())
    for n, p in policy.named_parameters():
        assert torch.equal(p, before[n]), n
    # Megatron -> HF names -> native head (strict) and back into a fresh trainer (bit-exact)
    named = dict(trainer.named_update_tensors())
    head = MtpHead(policy.decoder_config, 2)
    assert head.load_weights(named.items()) == head.expected_hf_names()
    assert "model.layers.4.eh_proj.weight" in named and "model.layers.3.shared_head.norm.weight" in named
    fresh = MtpTrainer(policy, 2)
    fresh.load_hf(named)
    for (n, p), (_, q) in zip(trainer.draft.named_parameters(), fresh.draft.named_parameters()):
        assert torch.equal(p, q), n
    exported = load_mtp_head(tmp_path / "mtp", policy.decoder_config)  # written after the last update
    for (n, t), (_, u) in zip(exported.named_export_tensors(), head.named_export_tensors()):
        assert torch.equal(t, u), n
    with pytest.raises(KeyError, match="unknown MTP weight model.layers.9.enorm.weight"):
        head.load_weights([("model.layers.9.enorm.weight", torch.ones(32))])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_drafter_is_megatron_math_and_verifier_exact(policies, family):
    policy, path, native = policies[family]
    depth, k = 2, 3  # draft steps 1-2 use depths 1-2; step 3 reuses depth 2
    trainer = MtpTrainer(policy, depth)
    head = MtpHead(policy.decoder_config, depth).eval()
    head.load_weights(trainer.named_update_tensors())
    drafter = MtpDrafter(head, native, k)
    calls = []
    propose = drafter.propose

    def recording(tokens, k_, sampling, generator):
        d, q = propose(tokens, k_, sampling, generator)
        calls.append(([list(t) for t in tokens], d.clone(), q.clone()))
        return d, q

    drafter.propose = recording
    g = torch.Generator().manual_seed(3)
    vocab = policy.decoder_config.vocab_size
    prompts = [torch.randint(4, vocab, (n,), generator=g).tolist() for n in (1, 4, 7)]
    reqs = [
        GenerateRequest(
            f"p{i}",
            p,
            SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True),
            n=2 if i == 1 else 1,
        )
        for i, p in enumerate(prompts)
    ]
    core = EngineCore(native, drafter, num_draft_tokens=k, max_batch_size=4, context_length=32, seed=4)
    core.generate(reqs)
    checked = 0
    for tokens, drafts, q in calls[:6]:
        for b, toks in enumerate(tokens):
            last = len(toks) - 1
            for j in range(1, depth + 1):  # step j: depth j at row N-1, after drafts d_1..d_{j-1}
                seq = torch.tensor([toks + drafts[b, : j - 1].tolist()])
                ref = torch.softmax(
                    _megatron_mtp_logits(policy, trainer.draft, seq, j)[last - 1, :vocab].float(), -1
                )
                torch.testing.assert_close(q[b, j - 1], ref, atol=1e-5, rtol=0)
                checked += 1
    assert checked >= 12
    # whatever the heads propose, greedy output is the target's own (verifier-exact)
    greedy = [
        GenerateRequest(
            r.request_id,
            r.input_ids,
            SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True),
            n=r.n,
        )
        for r in reqs
    ]
    drafter.propose = propose
    spec, _ = EngineCore(native, drafter, num_draft_tokens=k, max_batch_size=4, context_length=32).generate(
        greedy
    )
    plain, _ = EngineCore(native, None, max_batch_size=4, context_length=32).generate(greedy)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    # one slot: p1's second sample starts later from its parked prefill (the heads' prompt state copied)
    split, _ = EngineCore(native, drafter, num_draft_tokens=k, max_batch_size=1, context_length=32).generate(
        greedy
    )
    assert [s.output_ids for s in split] == [s.output_ids for s in plain]


def test_engine_serves_mtp_from_export_and_from_a_weight_update(policies, tmp_path):
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.sync.bucket import pack_bucket
    from megatron_spec.sync.transport import make_bucket_payload

    policy, path, _ = policies["qwen3"]
    cfg = policy.decoder_config
    trainer = MtpTrainer(policy, 1)
    named = dict(trainer.named_update_tensors())
    save_mtp(tmp_path / "mtp", named, cfg, 1)
    req = [
        GenerateRequest("a", (5, 6, 7), SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    ]
    server = EngineServer(
        EngineConfig(
            model_path=path,
            draft_kind="mtp",
            draft_path=str(tmp_path / "mtp"),
            num_draft_tokens=2,
            mtp_num_layers=1,
            max_batch_size=2,
            context_length=32,
        )
    )
    samples, _ = server.generate(req)
    assert len(samples[0].output_ids) == 6
    for n, t in server.drafter.head.named_export_tensors():
        assert torch.equal(t, named[n]), n
    # no export: the heads arrive from the trainer; generation is refused until they do
    server = EngineServer(
        EngineConfig(
            model_path=path,
            draft_kind="mtp",
            num_draft_tokens=2,
            mtp_num_layers=1,
            max_batch_size=2,
            context_length=32,
        )
    )
    with pytest.raises(RuntimeError, match="no weights loaded for \\['draft'\\]"):
        server.generate(req)
    flat, meta = pack_bucket(list(trainer.named_update_tensors()))
    server.begin_weight_update()
    server.update_weights_from_tensor(
        [make_bucket_payload(flat, meta)], selector="draft", weight_version="d1"
    )
    health = server.end_weight_update()
    assert health["draft_weight_version"] == "d1"
    assert server.generate(req)[0][0].output_ids == samples[0].output_ids


def test_mtp_state_round_trip(policies, tmp_path):
    policy, _, _ = policies["qwen3"]
    ids = torch.randint(
        4, policy.decoder_config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(5)
    )
    a = MtpTrainer(policy, 1, DraftTrainerConfig(lr=1e-3, loss="hard"))
    cap = Capture.for_trainer(a)
    with torch.no_grad(), cap.record(policy, torch.ones_like(ids, dtype=torch.bool)):
        policy(ids, torch.arange(16).expand(3, 16), attention_mask=None)
    cache = cap.take()
    a.train_step(cache)
    a.save(tmp_path)
    m2 = a.train_step(cache)
    b = MtpTrainer(policy, 1, DraftTrainerConfig(lr=1e-3, loss="hard"))
    b.load(tmp_path)
    assert b.train_step(cache)["draft/loss"] == m2["draft/loss"]
    for (n, p), (_, q) in zip(a.draft.named_parameters(), b.draft.named_parameters()):
        assert torch.equal(p, q), n


def test_build_draft_trainer_for_mtp(policies, tmp_path):

    from megatron_spec.draft.trainer import build_draft_trainer

    policy, _, _ = policies["qwen3"]
    cfg = policy.decoder_config
    source = MtpTrainer(policy, 2)
    save_mtp(tmp_path / "init", dict(source.named_update_tensors()), cfg, 2)
    draft = DraftConfig(
        spec_draft_kind="mtp",
        spec_draft_path=str(tmp_path / "init"),
        spec_draft_ttt_steps=3,
        spec_draft_lr=2e-4,
        spec_mtp_num_layers=2,
    )
    trainer = build_draft_trainer(draft, policy, cfg, export_dir=tmp_path / "export")
    assert isinstance(trainer, MtpTrainer) and trainer.config.lr == 2e-4
    assert trainer.capture_config().draft_kind == "mtp"
    for (n, t), (_, u) in zip(source.named_update_tensors(), trainer.named_update_tensors()):
        assert torch.equal(t, u), n
    assert torch.is_grad_enabled()  # iterating (and abandoning) the stream leaves grad mode alone
    assert load_mtp_head(tmp_path / "export", cfg).num_layers == 2  # exported before any update
    draft.spec_mtp_num_layers = 1
    with pytest.raises(ValueError, match="does not have 1 layers"):
        build_draft_trainer(draft, policy, cfg)
