"""One ``generate`` call of the SGLang backend: every sample of the requests in one ``sglang.Engine`` batch,
the lossless guard run with their sampling parameters, per-sample seeds where SGLang takes them, and SGLang's
outputs parsed into :class:`SampleOutput` (``sglang_protocol.parse_output``).

This module does not know about weight sessions, memory release or readiness: the caller checks that the
engine may generate and passes the weight versions to stamp on the samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from megatron_spec.rollout import sglang_protocol as proto
from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SampleOutput, stats_from_samples


def generate_batch(
    engine: Any,
    server_args: Any,
    requests: Sequence[GenerateRequest],
    *,
    num_draft_tokens: int,
    speculative: bool,
    target_version: str | None,
    draft_version: str | None,
    seed: int | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> tuple[list[SampleOutput], GenerateStats]:
    """Generate every sample of ``requests`` through ``engine`` (an ``sglang.Engine`` launched with
    ``server_args``); ``num_draft_tokens`` is the k the statistics report (0 without speculation)."""
    from megatron_spec.speculative import check_lossless

    expanded = [(r, i) for r in requests for i in range(r.n)]
    if not expanded:
        return [], GenerateStats(num_draft_tokens=num_draft_tokens)
    check_lossless(
        server_args,
        sampling={
            "temperature": [r.sampling.temperature for r, _ in expanded],
            "min_p": [r.sampling.min_p for r, _ in expanded],
        },
    )
    deterministic = bool(getattr(server_args, "enable_deterministic_inference", False))
    params = _sampling_params(expanded, seed, deterministic)
    t0 = time.perf_counter()
    try:
        outs = engine.generate(
            input_ids=[list(r.input_ids) for r, _ in expanded],
            sampling_params=params,
            return_logprob=True,
        )
    except Exception as exc:  # its scheduler died or hung up: the rollout manager restarts the engine
        from megatron_spec.interfaces import EngineDiedError

        raise EngineDiedError(
            f"SGLang engine failed during generate: {type(exc).__name__}: {exc}"
        ) from exc
    wall = time.perf_counter() - t0
    if isinstance(outs, dict):
        outs = [outs]
    if len(outs) != len(expanded):
        raise proto.SGLangOutputError(f"SGLang returned {len(outs)} outputs for {len(expanded)} samples")
    samples = [
        proto.parse_output(o, r.request_id, i, speculative=speculative, target_version=target_version,
                           draft_version=draft_version)
        for o, (r, i) in zip(outs, expanded)
    ]
    if on_progress is not None:
        on_progress(len(samples))
    return samples, stats_from_samples(samples, wall, num_draft_tokens)


def _sampling_params(expanded: list[tuple[GenerateRequest, int]], seed: int | None, deterministic: bool
                     ) -> list[dict[str, Any]]:
    """SGLang's sampling parameters per sample (``(request, sample index)``); with ``seed`` and
    ``deterministic`` (its flashinfer sampler rejects seeds otherwise), a ``sampling_seed`` per sample."""
    params = []
    for j, (r, _) in enumerate(expanded):
        p = r.sampling.to_sglang()
        if seed is not None and deterministic:
            p["sampling_seed"] = (int(seed) * 1_000_003 + j) % (1 << 63)
        params.append(p)
    return params
