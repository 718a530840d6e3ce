"""The native engine against transformers: greedy identity for every drafter, exact log-probs.

Runs ``EngineServer`` in-process (the same object the engine process runs) to keep the
tests fast; the process boundary has its own tests in test_engine_process.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.server import EngineServer
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from megatron_spec.speculative import SamplingTensors, process_logits

KINDS = ["none", "ngram", "model", "eagle3"]


def _server(setup, kind: str, **kw) -> EngineServer:
    draft_path = {"eagle3": setup.eagle3, "model": setup.draft_model}.get(kind)
    kw.setdefault("context_length", 96)
    return EngineServer(EngineConfig(model_path=setup.target, draft_kind=kind, draft_path=draft_path, **kw))


def _prompts(cfg, n: int, seed: int = 11) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            4, cfg.vocab_size, (int(torch.randint(2, 12, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def hf_target(setup):
    return transformers.AutoModelForCausalLM.from_pretrained(setup.target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def greedy_reference(setup, hf_target):
    """transformers' generate(do_sample=False), stopping at EOS like the engine."""
    prompts = _prompts(setup.cfg, 10)
    ref = []
    for p in prompts:
        out = hf_target.generate(torch.tensor([p]), do_sample=False, max_new_tokens=40, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    return prompts, ref


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical_to_transformers_and_engine_ar(setup, greedy_reference, kind, k):
    if kind == "none" and k == 3:
        pytest.skip("plain decoding has no k")
    prompts, ref = greedy_reference
    server = _server(setup, kind, num_draft_tokens=k, max_batch_size=4)  # fewer slots than samples
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=40), n=1 + i % 2)
            for i, p in enumerate(prompts)]
    samples, stats = server.generate(reqs)
    assert len(samples) == sum(r.n for r in reqs)
    for s in samples:
        i = int(s.request_id[1:])
        assert s.output_ids == ref[i], (kind, k, s.request_id, s.sample_index)
        assert s.finish_reason == ("stop" if ref[i][-1] == 2 else "length")
    if kind != "none":
        assert stats.spec_steps > 0 and len(stats.accept_rate_per_position) == k


@pytest.mark.slow  # compiles the layer for 4 step shapes (~40-60 s)
def test_compiled_layers_greedy_identical_to_transformers(setup, greedy_reference, monkeypatch):
    """--rollout-compile: the decoder layer compiled by torch.compile serves decode (1 token a row) and
    verify (k + 1) steps of 1 and several rows; the greedy tokens stay transformers', for plain decoding
    and EAGLE-3 k=3, and its graphs are counted: the warm-up built all of them, none is built mid-generation
    (a context of 60 positions, a cache of 64: the longest rows' reads cover all of it, which once cost every
    graph a
    second build, ``layers.kv_cache``)."""
    prompts, ref = greedy_reference
    from megatron_spec.rollout.native import warm_up

    # compiled even where the C++ layers run
    monkeypatch.setattr(warm_up, "compiling_pays", lambda dtype: True)
    server = _server(setup, "eagle3", num_draft_tokens=3, max_batch_size=4, compile=True, context_length=60)
    warmed = server.info()["compiled_graphs"]
    assert server.target.compiled is not None and warmed >= 2  # warmed at start
    assert server.info()["compile_seconds"] > 0
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=40), n=1 + i % 2)
            for i, p in enumerate(prompts)]
    for spec in (True, False):  # EAGLE-3 verify steps, then plain decoding through the same graphs
        server.set_speculation(spec)
        samples, stats = server.generate(reqs)
        for s in samples:
            assert s.output_ids == ref[int(s.request_id[1:])], (spec, s.request_id, s.sample_index)
        assert (stats.spec_steps > 0) == spec
    assert server.info()["compiled_graphs"] == warmed


@pytest.mark.parametrize("kind, history", [("ngram", False), ("model", False), ("eagle3", False),
                                           ("history", False), ("model", True), ("eagle3", True)])
@pytest.mark.slow  # ~20-30 s each
def test_adaptive_k_greedy_identical_to_transformers(setup, greedy_reference, kind, history):
    """num_draft_tokens auto: k changes step by step (0 included), the output never does; nor with
    the history drafter alone or beside a drafter (the second call drafts from the first's responses)."""
    prompts, ref = greedy_reference
    server = _server(
        setup,
        kind,
        num_draft_tokens="auto",
        max_draft_tokens=4,
        max_batch_size=4,
        history=history,
        history_max_draft_tokens=8,
    )
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=40), n=1 + i % 2)
            for i, p in enumerate(prompts)]
    server.generate(reqs)
    samples, stats = server.generate(reqs)
    if kind == "history" or history:
        assert stats.source_steps.get("history", 0) + stats.source_steps.get("live", 0) > 0, (
            stats.source_steps
        )
    for s in samples:
        assert s.output_ids == ref[int(s.request_id[1:])], (kind, s.request_id, s.sample_index)
        # the main drafter proposes at most 4; history proposals beside it up to 8 (steps it sits out),
        # or 4 + 8 in a tree step (both branches count)
        assert len(s.draft_lengths) == s.num_verify_steps - 1
        assert all(0 <= k <= (4 + 8 if history else 4) for k in s.draft_lengths), (
            s.draft_lengths,
            s.draft_sources,
        )
        # the history drafter as main: both its indexes
        main = (kind, "live") if kind == "history" else (kind,)
        assert all(
            k <= (4 if src in main else 8)
            for k, src in zip(s.draft_lengths, s.draft_sources)
            if src != "tree"
        )
    assert sum(stats.k_counts) == sum(len(s.draft_lengths) for s in samples)
    assert len([c for c in stats.k_counts if c]) >= 2, stats.k_counts  # k did change (exploration at least)
    if history:  # greedy siblings repeat each other: the history drafted alone, past the main drafter's 4
        assert len(stats.k_counts) > 5 and sum(stats.k_counts[5:]) > 0, stats.k_counts
    assert stats.summary()["k_mean"] is not None


@pytest.mark.parametrize("kind", ["none", "eagle3", "model"])
def test_logprobs_equal_transformers_processed(setup, hf_target, kind):
    """Each reported log-prob is log_softmax of transformers' processed logits (fp32, 1e-5)."""
    server = _server(setup, kind, num_draft_tokens=3, max_batch_size=8, seed=5)
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, ignore_eos=True)
    prompts = _prompts(setup.cfg, 3, seed=2)
    samples, _ = server.generate([GenerateRequest(f"r{i}", p, sp, n=3) for i, p in enumerate(prompts)])
    worst = 0.0
    for s in samples:
        p = prompts[int(s.request_id[1:])]
        with torch.no_grad():
            logits = hf_target(torch.tensor([p + s.output_ids])).logits[0, len(p) - 1:-1]
        lp = process_logits(
            logits, SamplingTensors.from_values(0.7, 20, 0.9, 0.0, batch_size=logits.shape[0])
        )
        ref = lp.gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0]
        assert torch.isfinite(ref).all(), "engine emitted a token outside the processed support"
        worst = max(worst, (ref - torch.tensor(s.logprobs)).abs().max().item())
    assert worst < 1e-5


def test_greedy_logprobs_are_unscaled_policy(setup, hf_target):
    server = _server(setup, "eagle3", num_draft_tokens=2, max_batch_size=2)
    p = _prompts(setup.cfg, 1, seed=3)[0]
    (s,), _ = server.generate([GenerateRequest("g", p, SamplingParams(temperature=0.0, max_new_tokens=10,
                                                                        ignore_eos=True))])
    with torch.no_grad():
        logits = hf_target(torch.tensor([p + s.output_ids])).logits[0, len(p) - 1:-1]
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.output_ids)[:, None])[:, 0]
    assert (ref - torch.tensor(s.logprobs)).abs().max().item() < 1e-5


def test_stop_tokens_max_new_tokens_and_continuous_batching(setup):
    """Mixed lengths and stop ids, more samples than slots: each sample equals running it alone."""
    alone = _server(setup, "ngram", max_batch_size=1)
    batched = _server(setup, "ngram", max_batch_size=3)
    prompts = _prompts(setup.cfg, 6, seed=4)
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=3 + 5 * i,
                                                         stop_token_ids=(17, 23)), n=2 if i == 2 else 1)
            for i, p in enumerate(prompts)]
    got, _ = batched.generate(reqs)
    for r in reqs:
        ref, _ = alone.generate([GenerateRequest(r.request_id, r.input_ids, r.sampling)])
        for s in (x for x in got if x.request_id == r.request_id):
            assert s.output_ids == ref[0].output_ids
            assert len(s.output_ids) <= r.sampling.max_new_tokens
            if s.finish_reason == "stop":
                assert s.output_ids[-1] in (17, 23, 2)
            assert not set(s.output_ids[:-1]) & {17, 23, 2}


def test_bf16_engine_runs_and_mostly_agrees(setup):
    """An engine asked for bfloat16 runs in what this CPU does well (megatron_spec.isa): bf16 where
    bf16 is native (then it mostly agrees with fp32), fp32 elsewhere (then it agrees exactly). CI runs
    this file a second time with MEGATRON_SPEC_NO_NATIVE_BF16=1, so both branches run there."""
    from megatron_spec.isa import probe

    srv32 = _server(setup, "eagle3", max_batch_size=4)
    srv16 = _server(setup, "eagle3", max_batch_size=4, dtype="bfloat16")
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
            for i, p in enumerate(_prompts(setup.cfg, 4, seed=8))]
    a, _ = srv32.generate(reqs)
    b, _ = srv16.generate(reqs)
    if probe().native_bf16:
        assert srv16.config.dtype == "bfloat16" and srv16.target.embed_tokens.weight.dtype == torch.bfloat16
        first_agree = sum(x.output_ids[0] == y.output_ids[0] for x, y in zip(a, b))
        assert first_agree >= 3  # bf16 rounding may flip a near-tie, not the typical argmax
    else:  # no native bf16 here ({probe().why_not_bf16()}): the request ran in fp32
        assert srv16.config.dtype == "float32" and srv16.target.embed_tokens.weight.dtype == torch.float32
        assert [x.output_ids for x in a] == [y.output_ids for y in b]


def test_request_errors_are_named(setup):
    server = _server(setup, "none", max_batch_size=2)
    too_long = GenerateRequest("long", [5] * 90, SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="request long: prompt of 90 tokens"):
        server.generate([too_long])
    with pytest.raises(ValueError, match="token id 999 outside the vocabulary"):
        server.generate([GenerateRequest("bad", [5, 999], SamplingParams(max_new_tokens=2))])


def _plans(server, ks):
    """The adaptive controller's plans replaced by ``ks`` step by step, the last one kept (its planning still
    runs); returns the list the main drafter's proposals are recorded in."""
    from megatron_spec.rollout.native.adaptive import StepPlan

    ctl, drafter = server.core.controller, server.core.drafter
    plan, propose, drafts = ctl.choose_step, drafter.propose, []
    step = iter(ks)

    def forced(options):
        plan(options)
        k = next(step, ks[-1])
        ctl.last_plan = (StepPlan(k), len(options))
        return StepPlan(k)

    def recorded(tokens, k, *a):
        out = propose(tokens, k, *a)
        if k:
            drafts.append(out[0].tolist())
        return out

    ctl.choose_step, drafter.propose = forced, recorded
    return drafts


@pytest.mark.parametrize("kind", ["eagle3", "model"])
def test_a_step_planned_at_k0_is_plain_decoding_and_feeds_the_drafter(setup, kind):
    """A step the adaptive controller plans at k = 0 is a plain step (``SpeculativeWorker._decode``): at T=1
    the same tokens and log-probs as plain decoding with the same seed. The drafter is fed what it sat out
    (EAGLE-3: each token with the target's states at the one before it), so after 5 steps at k = 0 its
    first proposal is the one a drafter that never sat out makes: a fresh engine prefilled with the same
    context."""
    prompts = _prompts(setup.cfg, 3, seed=31)

    def adaptive():
        return _server(setup, kind, num_draft_tokens="auto", max_draft_tokens=3, max_batch_size=3)

    held, plain = adaptive(), _server(setup, "none", max_batch_size=3)
    _plans(held, [0])
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    reqs = [GenerateRequest(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    (got, st), (ref, _) = held.core.generate(reqs, seed=5), plain.core.generate(reqs, seed=5)
    assert st.k_counts == [3 * 11]
    for a, b in zip(got, ref):
        assert a.output_ids == b.output_ids and a.draft_lengths == [0] * 11
        assert torch.equal(torch.tensor(a.logprobs), torch.tensor(b.logprobs))
    # greedy, 5 steps at k = 0, then k = 2: the first drafts against a fresh engine's from the same context
    late, fresh = adaptive(), adaptive()
    drafts, fresh_drafts = _plans(late, [0] * 5 + [2]), _plans(fresh, [2])
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    out, _ = late.core.generate([GenerateRequest(f"r{i}", p, greedy) for i, p in enumerate(prompts)])
    short = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    # the prefill draws the 6th token: the first step drafts after it, as the held engine's 6th step did
    fresh.core.generate([GenerateRequest(f"r{i}", p + s.output_ids[:5], short)
                         for i, (p, s) in enumerate(zip(prompts, out))])
    assert len(drafts[0]) == 3 and drafts[0] == fresh_drafts[0]


@pytest.mark.parametrize("kind", ["none", "eagle3"])
def test_prefill_riding_along_a_step_changes_nothing(setup, kind):
    """Prompts admitted while rows run are prefilled in the running rows' step forward; every
    sample (tokens and log-probs) equals running its request alone."""
    batched = _server(setup, kind, max_batch_size=3)
    alone = _server(setup, kind, max_batch_size=2)
    prompts = _prompts(setup.cfg, 7, seed=21)
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=4 + 3 * i),
                            n=2 if i in (1, 4) else 1) for i, p in enumerate(prompts)]
    calls = []
    fwd = batched.core.model.forward_segments
    batched.core.model.forward_segments = lambda segs, *a, **kw: (
        calls.append(len(segs)) or fwd(segs, *a, **kw)
    )
    got, _ = batched.generate(reqs)
    assert max(calls) == 2  # some prompts did ride along
    for r in reqs:
        ref, _ = alone.generate([r])
        mine = [s for s in got if s.request_id == r.request_id]
        assert len(mine) == r.n
        for s, t in zip(mine, ref):
            assert s.output_ids == t.output_ids
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(t.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["none", "eagle3", "model", "ngram"])
def test_a_prompt_split_over_free_slots_starts_the_rest_from_its_parked_prefill(setup, kind):
    """A request with more samples than the batch has slots (r1: 5 on 3) starts those that fit and parks its
    prompt's prefill; the others start from it as slots free up, without a second prefill. A request that
    fits waits for its slots. Every sample (tokens and log-probs) equals running its request alone, with
    adaptive k too."""
    kw = dict(num_draft_tokens="auto", max_draft_tokens=3) if kind == "eagle3" else {}
    batched = _server(setup, kind, max_batch_size=3, **kw)
    alone = _server(setup, kind, max_batch_size=8)
    prompts = _prompts(setup.cfg, 4, seed=33)
    sp = [SamplingParams(temperature=0.0, max_new_tokens=3 + 4 * i, ignore_eos=True) for i in range(4)]
    reqs = [GenerateRequest(f"r{i}", p, sp[i], n=(2, 5, 1, 3)[i]) for i, p in enumerate(prompts)]
    prefilled = []
    start = batched.core.start
    batched.core.start = lambda adm, *a: prefilled.extend(r.request_id for r in adm.batch) or start(adm, *a)
    parked = set()  # the requests whose samples started from the parking slot
    unpark = batched.core._unpark

    def recording(rows):
        waiting = batched.core._parked
        started = unpark(rows)
        if started:
            parked.add(waiting.req.request_id)
        return started

    batched.core._unpark = recording
    got, _ = batched.generate(reqs)
    assert sorted(prefilled) == ["r0", "r1", "r2", "r3"]  # each prompt prefilled once
    assert parked == {"r1"}
    assert batched.core._parked is None
    for r in reqs:
        ref, _ = alone.generate([r])
        mine = [s for s in got if s.request_id == r.request_id]
        assert [s.sample_index for s in mine] == list(range(r.n))
        for s, t in zip(mine, ref):
            assert s.output_ids == t.output_ids
            torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(t.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["eagle3", "model", "ngram"])
def test_tree_steps_greedy_identical_to_transformers(setup, greedy_reference, kind, monkeypatch):
    """The test hook history_tree_always: wherever a row has a history proposal the step is a tree (the
    drafter's k
    tokens and the history's as two branches of one verify); the history branch is kept past the
    drafter's tokens (its cache entries moved into place, the drafter's state rebuilt from the kept
    path) and the output is still transformers' greedy output. n-gram: a point-mass first branch,
    often shorter than k (-1 padding inside the tree)."""
    prompts, ref = greedy_reference
    monkeypatch.setenv("MEGATRON_SPEC_TEST_HOOKS", "history_tree_always")
    server = _server(setup, kind, num_draft_tokens="auto", max_draft_tokens=3, max_batch_size=4, history=True,
                     history_max_draft_tokens=8)
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=40), n=1 + i % 2)
            for i, p in enumerate(prompts)]
    server.generate(reqs)
    samples, stats = server.generate(reqs)
    assert stats.source_steps.get("tree", 0) > 20 and stats.tree_second > 10, (
        stats.source_steps,
        stats.tree_second,
    )
    for s in samples:
        assert s.output_ids == ref[int(s.request_id[1:])], (kind, s.request_id, s.sample_index)
    assert stats.source_accept_length("tree") > stats.source_accept_length(kind)


def test_spec_trace_records_every_adaptive_decision(setup, tmp_path):
    """--spec-trace: one JSON line per verify step the controller planned (its rows add up to the engine's
    row-steps), with its plan, predicted and realised rates; the output unchanged by tracing."""
    import json

    path = tmp_path / "sub" / "trace.jsonl"
    prompts = _prompts(setup.cfg, 4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    reqs = [GenerateRequest(f"r{i}", p, sp) for i, p in enumerate(prompts)]
    plain = _server(setup, "ngram", num_draft_tokens="auto", max_draft_tokens=3, max_batch_size=4)
    traced = _server(setup, "ngram", num_draft_tokens="auto", max_draft_tokens=3, max_batch_size=4,
                     spec_trace=str(path))
    want, _ = plain.generate(reqs)
    got, stats = traced.generate(reqs)
    assert [s.output_ids for s in got] == [s.output_ids for s in want]
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records and [r["step"] for r in records] == sorted(r["step"] for r in records)
    for r in records:
        assert r["plan"] in ("all", "history", "tree") and 0 <= r["k"] <= 3
        assert r["rows"] >= 1 and r["seconds"] > 0 and 0 <= r["draft_s"] <= r["seconds"]
        assert (r["draft_s"] > 0) == (r["k"] > 0)  # the n-gram drafter proposes in every speculative step
        assert r["realized_tps"] == pytest.approx(r["tokens"] / r["seconds"], rel=1e-3)
    assert sum(r["rows"] for r in records) == sum(stats.k_counts)  # every row-step the controller planned
    assert sum(r["tokens"] for r in records) <= stats.num_tokens
    assert any(r["predicted_tps"] is not None for r in records)
    with pytest.raises(ValueError, match="--spec-trace records the adaptive controller"):
        EngineConfig(model_path=setup.target, draft_kind="ngram", num_draft_tokens=3, spec_trace=str(path))


def test_held_plain_steps_ask_the_history_for_nothing_and_keep_the_output(setup, greedy_reference,
                                                                          monkeypatch):
    """A step the adaptive controller holds at plain decoding (``exploration.Hold``, forced here on 3 steps in
    4) prices nothing and asks the history drafter for no proposals (its next call indexes the rows' tokens of
    the held steps first), the steps between still draft from it, and the output is still transformers'
    greedy output."""
    from megatron_spec.rollout.native.adaptive import DraftLengthController
    from megatron_spec.rollout.native.history_drafter import HistoryDrafter

    prompts, ref = greedy_reference
    monkeypatch.setattr(DraftLengthController, "holds", lambda self, b: self.steps > 2 and self.steps % 4)
    asked = []
    real = HistoryDrafter.propose_rows

    def propose_rows(self, tokens, k):
        asked.append(k)
        out = real(self, tokens, k)
        assert all(n == len(seq) for n, seq in zip(self.indexed, tokens) if n)  # the live index is current
        return out

    monkeypatch.setattr(HistoryDrafter, "propose_rows", propose_rows)
    server = _server(setup, "eagle3", num_draft_tokens="auto", max_draft_tokens=3, max_batch_size=4,
                     history=True)
    reqs = [GenerateRequest(f"r{i}", p, SamplingParams(temperature=0.0, max_new_tokens=40))
            for i, p in enumerate(prompts)]
    server.generate(reqs)
    samples, stats = server.generate(reqs)  # the same prompts again: the history has their answers
    for s in samples:
        assert s.output_ids == ref[int(s.request_id[1:])], s.request_id
    steps = server.core.controller.steps
    assert steps > 8 and 0 < len(asked) < steps // 2 and all(k > 0 for k in asked)
    assert stats.source_steps.get("history", 0) + stats.source_steps.get("live", 0) > 0
