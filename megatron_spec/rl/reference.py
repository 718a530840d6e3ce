"""``--rollout-reference-check``: the rollout engine's greedy tokens against our engine holding the same
weights.

The streamer's fingerprints prove the bytes an engine loaded equal the bytes sent; they cannot prove the
engine computes with them (a kernel's cached copy of a weight, a tied head left unpacked: docs/design.md,
"vLLM"). This check does: the owner of an engine starts the native engine beside it (plain decoding, the
engine settings of the run otherwise), streams it the same policy after every weight sync, and both decode
the same prompts greedily. Greedy decoding is a function of the weights alone (speculation included: the
verifier keeps only its own argmax), so two engines holding the same weights write the same tokens,
unless two logits tie within the engines' rounding; the message of a difference gives both log-probs at
the first differing position, so a tie shows itself.

:func:`compare_greedy` is the comparison (pure); :class:`ReferenceCheck` the engine, its streamer and the
prompts. Metrics: ``health/reference_equal`` (share of prompts with equal tokens), ``health/reference_tokens``
(tokens compared), ``health/reference_s`` (the reference's sync and both decodes), docs/metrics.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from megatron_spec.rollout.types import GenerateRequest, SampleOutput


class ReferenceMismatch(RuntimeError):
    """The rollout engine's greedy tokens differ from the reference engine's with the same weights."""


@dataclasses.dataclass
class Comparison:
    equal: int
    prompts: int
    tokens: int
    first_difference: str | None
    """The first prompt that differs, said in words (None: all equal)."""


def compare_greedy(engine: Sequence[SampleOutput], reference: Sequence[SampleOutput], *,
                   decode=None) -> Comparison:
    """Token-for-token comparison of two engines' greedy samples of the same requests (matched by id).

    ``decode``: token ids -> text for the message (optional). A prompt is equal when both wrote the same
    tokens; ``tokens`` counts the positions compared (the shorter of each pair)."""
    ref = {s.request_id: s for s in reference}
    equal = tokens = 0
    first = None
    for s in engine:
        r = ref.get(s.request_id)
        if r is None:
            raise ValueError(f"reference check: the reference engine returned no sample for {s.request_id}")
        a, b = list(s.output_ids), list(r.output_ids)
        tokens += min(len(a), len(b))
        if a == b:
            equal += 1
            continue
        if first is None:
            pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            lp = lambda xs, i: f"{xs[i]:.4f}" if i < len(xs) else "-"
            tok = lambda xs, i: str(xs[i]) if i < len(xs) else "end"
            said = f" after {decode(a[:pos])!r}" if decode is not None else ""
            first = (
                f"request {s.request_id}: position {pos}{said}: the engine wrote token {tok(a, pos)} "
                f"(log-prob {lp(s.logprobs, pos)}), the reference {tok(b, pos)} (log-prob "
                f"{lp(r.logprobs, pos)})"
            )
    return Comparison(equal, len(engine), tokens, first)


class ReferenceCheck:
    """The native engine beside one owner's rollout engine, and the probe prompts.

    Args:
        config: the rollout engine's record; the reference runs it with plain decoding.
        requests: the probe prompts (greedy; :meth:`PromptTask.probe_requests`).
        bucket_bytes, weight_dtype: the streamer's settings (the run's).
    """

    def __init__(self, config, requests: Sequence[GenerateRequest], *, bucket_bytes: int, weight_dtype: str):
        from megatron_spec.rollout import make_engine
        from megatron_spec.sync.streamer import WeightStreamer

        plain = dataclasses.replace(
            config,
            draft_kind="none",
            draft_path=None,
            history=False,
            num_draft_tokens=3 if config.num_draft_tokens == "auto" else config.num_draft_tokens,
        )
        self.engine = make_engine(plain, backend="native")
        self.streamer = WeightStreamer(self.engine, bucket_bytes=bucket_bytes, weight_dtype=weight_dtype)
        self.requests = list(requests)
        self.version: str | None = None

    def sync(self, model, version: str, tp_group=None) -> None:
        """Stream the policy ``version`` into the reference engine (once per version)."""
        if self.version != version:
            self.streamer.sync_target(model, version, tp_group=tp_group)
            self.version = version

    def compare(self, engine, decode=None) -> Comparison:
        """Both engines decode the probe prompts greedily (the same seed: greedy ignores it)."""
        mine, _ = engine.generate(self.requests, seed=0)
        ref, _ = self.engine.generate(self.requests, seed=0)
        return compare_greedy(mine, ref, decode=decode)

    def shutdown(self) -> None:
        self.engine.shutdown()


def reference_metrics(results: Sequence[tuple[Comparison, float] | None]) -> dict[str, Any]:
    """The job's ``health/reference_*`` from every owner's comparison (``None``: a rank without one);
    raises :class:`ReferenceMismatch` (on every rank: all hold the same results) when any prompt differs."""
    got = [r for r in results if r is not None]
    if not got:
        return {}
    prompts = sum(c.prompts for c, _ in got)
    equal = sum(c.equal for c, _ in got)
    out = {
        "health/reference_equal": equal / max(prompts, 1),
        "health/reference_tokens": sum(c.tokens for c, _ in got),
        "health/reference_s": max(s for _, s in got),
    }
    bad = [c.first_difference for c, _ in got if c.first_difference is not None]
    if bad:
        raise ReferenceMismatch(
            f"--rollout-reference-check: {prompts - equal} of {prompts} greedy probe prompts differ between "
            "the rollout "
            f"engine and the native engine holding the same weights; first: {bad[0]}. Equal log-probs at "
            "that position "
            "are a tie; otherwise the engine does not compute with the weights it was sent (drop the flag "
            "to run on)"
        )
    return out



def check_owners(reference: ReferenceCheck | None, engine, decode, info, sync_s: float) -> dict[str, Any]:
    """Every owner's engine and its reference decode the probe prompts (``reference`` None: a rank without an
    engine); every rank gets every result (one gather over the long-timeout group) and raises on a difference.
    An engine that dies during the probe is left to the next round's restart (the check runs again then)."""
    import logging
    import time

    import torch.distributed as dist

    from megatron_spec.interfaces import EngineDiedError, EngineTimeoutError

    mine = None
    if reference is not None:
        t0 = time.perf_counter()
        try:
            mine = (reference.compare(engine, decode=decode), sync_s + time.perf_counter() - t0)
        except (EngineDiedError, EngineTimeoutError) as exc:
            logging.getLogger(__name__).warning(
                "--rollout-reference-check skipped: the engine failed during the probe (%s)", exc
            )
    results = [mine]
    if info.world_size > 1:
        results = [None] * info.world_size
        dist.all_gather_object(results, mine, group=info.wait_group)
    return reference_metrics(results)
