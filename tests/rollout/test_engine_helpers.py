"""Engine helpers: the drafters' draw (argmax without a distribution for all-greedy batches, a
sample and its distribution otherwise) and the target model's mixed-segment forward."""

from __future__ import annotations

import pytest
import torch

from megatron_spec.rollout.native.drafters import draw
from megatron_spec.speculative import SamplingTensors, process_logits


def test_all_greedy_batch_is_argmax_without_distribution():
    logits = torch.tensor([[0.1, 2.0, -1.0, 2.0], [3.0, 0.0, 0.5, -2.0]])
    tok, q = draw(logits, SamplingTensors.from_values(0.0, batch_size=2), torch.Generator().manual_seed(0))
    assert tok.tolist() == [1, 0]  # ties go to the first maximum, as process_logits' one-hot does
    assert q is None
    lp = process_logits(logits, SamplingTensors.from_values(0.0, batch_size=2))
    assert lp.argmax(-1).tolist() == [1, 0]


def test_mixed_batch_samples_and_returns_the_processed_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, generator=g)
    sampling = SamplingTensors.from_values([0.0, 1.0, 0.7], [0, 0, 3], [1.0, 0.9, 1.0], [0.0, 0.0, 0.0])
    tok, q = draw(logits, sampling, torch.Generator().manual_seed(2))
    torch.testing.assert_close(q, process_logits(logits, sampling).exp())
    assert int(tok[0]) == int(logits[0].argmax())
    assert all(float(q[i, int(tok[i])]) > 0 for i in range(3))  # drawn inside the processed support


def test_segments_in_one_forward_equal_separate_forwards(setup):
    """``forward_segments``: a verify-shaped segment and a padded prefill segment share one pass
    over the weights; logits, aux states and every cache entry equal two separate forwards."""
    from megatron_spec.rollout.native.model import Segment
    from tests.conftest import load_native

    model = load_native(setup.target)
    g = torch.Generator().manual_seed(5)
    vocab = setup.cfg.vocab_size
    prompt = torch.randint(4, vocab, (2, 7), generator=g)
    caches = [model.new_cache(4, 32) for _ in range(2)]
    with torch.no_grad():
        for c in caches:  # slots 0-1 hold 7 tokens of context
            model(prompt, torch.arange(7).expand(2, 7), c, torch.tensor([7, 7]))
        step = Segment(torch.randint(4, vocab, (2, 3), generator=g), 7 + torch.arange(3).expand(2, 3),
                       torch.tensor([10, 10]))
        lens = torch.tensor([5, 3])
        pre = Segment(torch.randint(4, vocab, (2, 5), generator=g), torch.arange(5).expand(2, 5), lens, 2,
                      (lens - 1).unsqueeze(1))
        aux = (1, 3)
        mixed = model.forward_segments([step, pre], caches[0], aux_layers=aux)
        apart = [model.forward_segments([s], caches[1], aux_layers=aux)[0] for s in (step, pre)]
    for (lg, ax), (lg2, ax2) in zip(mixed, apart):
        torch.testing.assert_close(lg, lg2, atol=1e-5, rtol=0)
        torch.testing.assert_close(ax, ax2, atol=1e-5, rtol=0)
    assert mixed[0][0].shape == (2, 3, vocab) and mixed[1][0].shape == (2, 1, vocab)
    for layer in range(setup.cfg.num_layers):
        for slot, n in ((0, 10), (1, 10), (2, 5), (3, 3)):
            torch.testing.assert_close(caches[0].k[layer][slot, :, :n], caches[1].k[layer][slot, :, :n],
                                       atol=1e-5, rtol=0)
            torch.testing.assert_close(caches[0].v[layer][slot, :, :n], caches[1].v[layer][slot, :, :n],
                                       atol=1e-5, rtol=0)


def test_tree_segment_equals_each_branch_alone(setup):
    """A tree segment ``[last, a_1..a_k, b_1..b_m]`` (b at the RoPE positions of a, written after it)
    gives each branch the logits and K/V of a chain forward of that branch alone; after
    ``KVCache.shift`` the b branch's entries sit where a chain forward of b would have put them."""
    from megatron_spec.rollout.native.spec_step import tree_segment
    from tests.conftest import load_native

    model = load_native(setup.target)
    g = torch.Generator().manual_seed(6)
    vocab = setup.cfg.vocab_size
    prompt = torch.randint(4, vocab, (2, 7), generator=g)
    k, m = 3, 4
    last = torch.randint(4, vocab, (2, 1), generator=g)
    a = torch.randint(4, vocab, (2, k), generator=g)
    b = torch.randint(4, vocab, (2, m), generator=g)
    caches = [model.new_cache(2, 32) for _ in range(3)]
    with torch.no_grad():
        for c in caches:
            model(prompt, torch.arange(7).expand(2, 7), c, torch.tensor([7, 7]))
        base = torch.tensor([7, 7])
        seg = tree_segment(torch.cat([last, a, b], 1), base, k, m)
        tree_logits, _ = model.forward_segments([seg], caches[0])[0]
        chain_a, _ = model(torch.cat([last, a], 1), 7 + torch.arange(k + 1).expand(2, -1), caches[1],
                           torch.tensor([11, 11]))
        chain_b, _ = model(torch.cat([last, b], 1), 7 + torch.arange(m + 1).expand(2, -1), caches[2],
                           torch.tensor([12, 12]))
    torch.testing.assert_close(tree_logits[:, :k + 1], chain_a, atol=1e-4, rtol=0)
    torch.testing.assert_close(tree_logits[:, k + 1:], chain_b[:, 1:], atol=1e-4, rtol=0)
    for slot in range(2):
        caches[0].shift(slot, 7 + k + 1, 7 + 1, m)
    for layer in range(setup.cfg.num_layers):
        for t in ("k", "v"):
            torch.testing.assert_close(getattr(caches[0], t)[layer][:, :, :7 + m + 1],
                                       getattr(caches[2], t)[layer][:, :, :7 + m + 1], atol=1e-4, rtol=0)


def test_packed_segment_equals_padded_segment(setup):
    """A packed verify (rows of different draft lengths; only their real tokens run through the
    projections and the MLP) gives the padded forward's logits, aux states and K/V at every real
    position, and zeros elsewhere; it also rides along with a prefill segment."""
    from megatron_spec.rollout.native.model import Segment
    from tests.conftest import load_native

    model = load_native(setup.target)
    g = torch.Generator().manual_seed(8)
    vocab = setup.cfg.vocab_size
    b, t = 3, 5
    prompt = torch.randint(4, vocab, (b, 6), generator=g)
    ids = torch.randint(4, vocab, (b, t), generator=g)
    lens = torch.tensor([5, 1, 3])  # tokens each row really runs
    pack = torch.arange(t).unsqueeze(0) < lens.unsqueeze(1)
    caches = [model.new_cache(b + 1, 32) for _ in range(2)]
    aux_layers = (0, setup.cfg.num_layers - 1)
    extra = torch.randint(4, vocab, (1, 4), generator=g)
    outs = []
    with torch.no_grad():
        for c, pk in zip(caches, (None, pack)):
            model(prompt, torch.arange(6).expand(b, 6), c, torch.full((b,), 6))
            seg = Segment(ids, 6 + torch.arange(t).expand(b, t), 6 + lens, pack=pk)
            pre = Segment(extra, torch.arange(4).unsqueeze(0), torch.tensor([4]), slot_offset=b,
                          logits_index=torch.tensor([[3]]))
            outs.append(model.forward_segments([seg, pre], c, aux_layers=aux_layers))
    (lg_pad, aux_pad), pre_pad = outs[0]
    (lg_pack, aux_pack), pre_pack = outs[1]
    torch.testing.assert_close(lg_pack[pack], lg_pad[pack], atol=1e-4, rtol=0)
    torch.testing.assert_close(aux_pack[pack], aux_pad[pack], atol=1e-4, rtol=0)
    assert not lg_pack[~pack].any() and not aux_pack[~pack].any()
    torch.testing.assert_close(pre_pack[0], pre_pad[0], atol=1e-4, rtol=0)
    for layer in range(setup.cfg.num_layers):
        for name in ("k", "v"):
            a, c = getattr(caches[0], name)[layer], getattr(caches[1], name)[layer]
            for row in range(b):
                n = 6 + int(lens[row])
                torch.testing.assert_close(c[row, :, :n], a[row, :, :n], atol=1e-4, rtol=0)
            torch.testing.assert_close(c[b, :, :4], a[b, :, :4], atol=1e-4, rtol=0)
    # with logits_index, a packed segment gives the logits of those positions alone (a packed prefill's last
    # prompt tokens), as the padded one does; a position it does not run is refused
    with torch.no_grad():
        last = (lens - 1).unsqueeze(1)
        got = [
            model.forward_segments(
                [Segment(ids, 6 + torch.arange(t).expand(b, t), 6 + lens, logits_index=last, pack=pk)],
                c,
                aux_layers=aux_layers,
            )[0]
            for c, pk in zip(caches, (None, pack))
        ]
    assert got[1][0].shape == got[0][0].shape == (b, 1, vocab)
    torch.testing.assert_close(got[1][0], got[0][0], atol=1e-4, rtol=0)
    torch.testing.assert_close(got[1][1][pack], got[0][1][pack], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="logits_index asks for a position"):
        model.forward_segments([Segment(ids, 6 + torch.arange(t).expand(b, t), 6 + lens,
                                        logits_index=torch.full((b, 1), t - 1), pack=pack)], caches[1])


def test_draft_extend_padding_stays_inside_the_cache(setup):
    """A row near the end of the context beside a row with many pending tokens (steps where the drafter
    sat out): the draft extend's padding must not write past the cache, and the rows' results must not
    change (row 0 alone gives the same drafts)."""
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.speculative import SamplingTensors

    server = EngineServer(EngineConfig(model_path=setup.target, draft_kind="eagle3", draft_path=setup.eagle3,
                                       context_length=16, max_batch_size=2))
    drafter = server.core.drafter
    max_len = drafter.cache.max_len
    aux_dim = len(drafter.aux_layers) * setup.cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    outs = []
    for rows in (2, 1):
        drafter.cache.lens[:2] = torch.tensor([max_len - 4, 0])
        drafter.pending_tokens[:2] = [[5], list(range(4, 4 + max_len - 2))]
        gen = torch.Generator().manual_seed(0)
        aux = torch.randn(max_len, aux_dim, generator=g.manual_seed(3))
        drafter.pending_aux[:2] = [[aux[:1]], [aux[:2], aux[2:max_len - 2]]]  # (per slot, chunks in order)
        drafts, _ = drafter.propose(
            [[1]] * rows, 2, SamplingTensors.from_values(0.0, 0, 1.0, 0.0, batch_size=rows), gen
        )
        outs.append(drafts[0])
    assert outs[0].tolist() == outs[1].tolist()


@pytest.mark.parametrize("draft", ["none", "eagle3"])
def test_packed_prefill_gives_the_padded_prefills_tokens(setup, monkeypatch, draft):
    """Prompts of different lengths prefilled together run packed (their tokens, not the padding) where the
    forward runs its layers in Python anyway: the same greedy tokens, log-probs and drafts as padded."""
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native import rows as rows_mod
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, setup.cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 9, 14, 6, 11)]
    # the first two finish early: the last two prompts are prefilled together beside the third's decoding
    sps = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (4, 4, 12, 8, 8)]
    runs = []
    for limit in (10**6, 0):  # the first prefill padded / packed (beside running rows, both pack)
        monkeypatch.setattr(rows_mod, "SMALL_MAX_ROWS", limit)
        server = EngineServer(EngineConfig(model_path=setup.target, draft_kind=draft,
                                           draft_path=setup.eagle3 if draft == "eagle3" else None,
                                           num_draft_tokens=2, context_length=64, max_batch_size=3))
        packs = []
        take = server.core._take

        def spy(waiting, rows, take=take, packs=packs):
            adm = take(waiting, rows)
            if adm is not None:
                packs.append(adm.segment.pack is not None)
            return adm

        server.core._take = spy
        out, _ = server.core.generate(
            [GenerateRequest(str(i), p, sp) for i, (p, sp) in enumerate(zip(prompts, sps))], seed=0
        )
        runs.append(([s.output_ids for s in out], [s.logprobs for s in out], packs))
    if draft == "none":  # (with drafts, the first two may finish in different steps: then admissions of one)
        # (42 and 22 rows: C++ layers first)
        assert runs[0][2] == [False, True] and runs[1][2] == [True, True]
    assert runs[1][2][0]
    assert runs[0][0] == runs[1][0]
    for got, want in zip(runs[1][1], runs[0][1]):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-4, rtol=0)


def test_load_weights_names_what_it_cannot_place(setup):
    """A bucket's tensors are placed by looking up only the parameters it names: a name this model does not
    have is still a KeyError that says which, a wrong shape a ValueError, and pieces of a fused parameter
    land where the whole load put them."""
    from megatron_spec.models import HFCheckpoint
    from tests.conftest import load_native

    model = load_native(setup.target)
    ck = HFCheckpoint(setup.target)
    with pytest.raises(KeyError, match="model.layers.99.mlp.up_proj.weight"):
        model.load_weights([("model.layers.99.mlp.up_proj.weight", torch.zeros(1))], strict_complete=False)
    with pytest.raises(KeyError, match="model.layers.0.mlp.nope.weight"):
        model.load_weights([("model.layers.0.mlp.nope.weight", torch.zeros(1))], strict_complete=False)
    name = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match="k_proj"):
        model.load_weights([(name, torch.zeros(3, 3))], strict_complete=False)
    before = {n: p.clone() for n, p in model.named_parameters()}
    new = ck.get(name) + 1
    assert model.load_weights([(name, new)], strict_complete=False) == {name}
    qkv = dict(model.named_parameters())["layers.1.self_attn.qkv_proj.weight"]
    q = model.cfg.q_size
    assert torch.equal(qkv[q:q + model.cfg.kv_size], new)
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed == {"layers.1.self_attn.qkv_proj.weight"}


def test_generate_steps_run_in_turn_give_each_engines_own_call(setup):
    """Two engines' calls run step by step in turn (``generate_steps`` driven by benchmarks/_lockstep.py, the
    rollout benchmark's timing) give what each engine's own ``generate`` gives: the same samples, log-probs
    and statistics, at T=1, plain and speculative (a fixed k: the adaptive plan hangs on measured times);
    each call's clock is its own steps' time, within the pair's wall time, its samples finishing on it."""
    import time

    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams
    from tests.benchmark_modules import load_benchmark

    lockstep = load_benchmark("_lockstep")
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, setup.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 7)]
    sp = SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True)
    reqs = [GenerateRequest(str(i), p, sp, n=2) for i, p in enumerate(prompts)]

    def engines():
        return {kind: EngineServer(EngineConfig(model_path=setup.target, draft_kind=kind,
                                                draft_path=setup.eagle3 if kind == "eagle3" else None,
                                                num_draft_tokens=k, context_length=32, max_batch_size=4)).core
                for kind, k in (("none", 1), ("eagle3", 2))}

    def outcome(samples, stats):
        return ([s.output_ids for s in samples], [s.logprobs for s in samples],
                (stats.num_tokens, stats.num_verify_steps, stats.spec_steps, stats.k_mean))

    alone = {kind: outcome(*core.generate(reqs, seed=3)) for kind, core in engines().items()}
    t0 = time.perf_counter()
    together = lockstep.run_in_turn({kind: (lambda done, c=core: c.generate_steps(reqs, done, seed=3))
                                     for kind, core in engines().items()})
    wall = time.perf_counter() - t0
    assert {kind: outcome(samples, st) for kind, (samples, st, _) in together.items()} == alone
    clocks = [st.wall_s for _, st, _ in together.values()]
    assert all(c > 0 for c in clocks) and sum(clocks) <= wall
    for samples, st, finish in together.values():
        assert len(finish) == len(samples) == 6 and finish == sorted(finish) and finish[-1] <= st.wall_s


def test_bench_vs_vllm_runs_our_engines_in_turn_with_the_answers_of_whole_calls(setup):
    """benchmarks/bench_vs_vllm.py's ``--interleave steps``: our engines' calls started by
    ``OurEngine.start``, stepped in turn and closed by ``finish`` answer what ``generate`` (one whole call)
    answers, greedy, plain and EAGLE-3, and each call's statistics are kept (the speculation ceiling reads
    them)."""
    from tests.benchmark_modules import load_benchmark

    bench = load_benchmark("bench_vs_vllm")
    lockstep = load_benchmark("_lockstep")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, setup.cfg.vocab_size, (n,), generator=g).tolist() for n in (6, 4, 8)]
    draft = {"none": (None, {}), "eagle3": (setup.eagle3, {"num_draft_tokens": 2})}
    ours = {kind: bench.OurEngine(setup.target, "float32", 4, 32, kind, path, 2, **kw)
            for kind, (path, kw) in draft.items()}
    alone = {kind: eng.generate(prompts, 9)[1] for kind, eng in ours.items()}
    got = lockstep.run_in_turn({kind: eng.start(prompts, 9) for kind, eng in ours.items()})
    together = {kind: eng.finish(*got[kind][:2]) for kind, eng in ours.items()}
    assert {kind: out for kind, (_, out) in together.items()} == alone
    assert all(len(out) == 3 and all(len(o) == 9 for o in out) for out in alone.values())
    for kind, eng in ours.items():
        assert len(eng.stats) == 2 and eng.stats[1] is got[kind][1]
        assert together[kind][0] == eng.stats[1].wall_s > 0


def test_the_fp32_engines_draft_computes_with_bf16_weights_and_the_samples_stay_the_targets(setup):
    """``draft_bf16`` (the default): the EAGLE-3 head's layers compute with their weights rounded to bf16
    (bf16 panels where the kernel runs), off: as loaded. Greedy outputs are the target's either way."""
    from megatron_spec.layers.linear import Linear, bf16_candidate, small_linear_available
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(4, setup.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 9)]
    reqs = [GenerateRequest(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
            for i, p in enumerate(prompts)]
    outputs = {}
    for draft, flag in (("none", True), ("eagle3", True), ("eagle3", False)):
        server = EngineServer(EngineConfig(model_path=setup.target, draft_kind=draft, draft_bf16=flag,
                                           draft_path=setup.eagle3 if draft == "eagle3" else None,
                                           num_draft_tokens=3, context_length=64, max_batch_size=2))
        outputs[draft, flag] = [s.output_ids for s in server.core.generate(reqs, seed=0)[0]]
        if draft == "none":
            continue
        layers = [m for m in server.core.drafter.head.modules() if isinstance(m, Linear)]
        assert layers and all(m.round_bf16 == flag for m in layers)
        assert not all(bf16_candidate(m.weight) for m in layers)  # a draft trained in fp32
        if small_linear_available():
            bf16 = [m._small.dtype == torch.bfloat16 for m in layers]
            assert bf16 == [flag or bf16_candidate(m.weight) for m in layers]
    assert outputs["eagle3", True] == outputs["none", True] == outputs["eagle3", False]
