"""Our engine settings and records in vLLM's terms, and back: pure functions, no vLLM import.

* :func:`check_supported`: the configurations the vLLM backend refuses, each with one line naming why
  and what to use instead. On vLLM's CPU build, *sampled* (T > 0) speculative decoding is wrong
  (vllm#55005, open: the CPU path of the sampling-parameter expansion discards its output, so the
  verify step reads temperature / top-k / top-p from uninitialised memory), while greedy speculation
  and plain sampling are not affected; ``tests/rollout/test_vllm_backend.py`` runs the statistical
  checks on what is accepted.
* :func:`llm_kwargs`: the ``vllm.LLM`` arguments of an :class:`~megatron_spec.rollout.config.EngineConfig`
  (speculative settings mapped from ours: EAGLE-3 export, n-gram prompt lookup, a draft model).
* :func:`vllm_eagle3_dir`: a ModelOpt EAGLE-3 export as vLLM must read it (aux-layer ids one higher).
* :func:`sampling_kwargs` / :func:`sample_output`: a request's sampling in ``vllm.SamplingParams``
  fields, and one vLLM completion as a :class:`~megatron_spec.rollout.types.SampleOutput` (acceptance
  per verify step from vLLM's own per-request speculative counters).

Imported in both environments: by the trainer (checks before anything starts) and by the vLLM server.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.types import FINISH_LENGTH, FINISH_STOP, SampleOutput, SamplingParams

TRANSFER_BACKEND = "megatron_spec_bucket"
"""The weight-transfer backend ``megatron_spec.rollout.vllm_worker`` registers in vLLM."""
WORKER_EXTENSION = "megatron_spec.rollout.vllm_worker.WorkerExtension"
DRAFT_KINDS = ("none", "eagle3", "ngram", "model")

SAMPLED_SPEC_DEFECT = (
    "vLLM's CPU build verifies sampled (temperature > 0) speculative decoding wrongly (vllm#55005, open: the "
    "CPU sampling-parameter expansion discards its output, so temperature/top-k/top-p are read from "
    "uninitialised memory); use greedy speculation (--rollout-temperature 0), plain sampling "
    "(--spec-draft-kind none), or --rollout-backend native")


class VllmOutputError(RuntimeError):
    """A vLLM completion that contradicts itself (logprobs for other tokens, an aborted request, ...)."""


def check_engine_settings(draft_kind: str, *, adaptive: bool = False, history: bool = False,
                          weight_dtype: str = "bf16", device_type: str = "cpu",
                          temperatures: Sequence[float] = ()) -> None:
    """Raise ``ValueError`` (one line: what, why, the alternatives) for what the backend refuses.

    Args:
        temperatures: the sampling temperatures the engine will be asked for (the run's, or one call's).
    """
    if draft_kind not in DRAFT_KINDS:
        hint = {
            "mtp": "vLLM drafts with the MTP layers a checkpoint ships, not heads trained beside the policy",
            "history": "the history drafter is the native engine's",
        }.get(draft_kind, "")
        raise ValueError(
            f"--spec-draft-kind {draft_kind} is not available with --rollout-backend vllm ({hint}); "
            f"use one of {DRAFT_KINDS} or --rollout-backend native"
        )
    if adaptive or history:
        raise ValueError("--spec-num-draft-tokens auto and --spec-history need the native engine "
                         "(--rollout-backend native): vLLM drafts a fixed k")
    if weight_dtype == "fp8":
        raise ValueError(
            "--rollout-weight-dtype fp8 is not wired for --rollout-backend vllm; use bf16 or fp32"
        )
    if draft_kind != "none" and device_type == "cpu" and any(t > 0 for t in temperatures):
        raise ValueError(SAMPLED_SPEC_DEFECT)


def check_supported(config: EngineConfig, temperatures: Sequence[float] = ()) -> None:
    """:func:`check_engine_settings` for an engine's record."""
    check_engine_settings(
        config.draft_kind,
        adaptive=config.adaptive,
        history=config.history,
        weight_dtype="fp8" if config.fp8_weights else "bf16",
        device_type=config.device_type,
        temperatures=temperatures,
    )


def speculative_config(config: EngineConfig, draft_dir: str | None) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for our draft settings (None: plain decoding).

    Args:
        draft_dir: the EAGLE-3 export as vLLM reads it (:func:`vllm_eagle3_dir`); the draft model's own
            checkpoint for ``model``.
    """
    k = config.k
    if config.draft_kind == "none":
        return None
    if config.draft_kind == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": config.ngram_min,
                "prompt_lookup_max": config.ngram_max}
    if config.draft_kind == "eagle3":
        return {"method": "eagle3", "model": draft_dir, "num_speculative_tokens": k}
    if config.draft_kind == "model":
        return {"method": "draft_model", "model": draft_dir or config.draft_path, "num_speculative_tokens": k}
    raise ValueError(f"draft kind {config.draft_kind!r} has no vLLM speculative method")


def kv_cache_gib(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
    """Whole GiB of KV cache for ``max_batch_size`` sequences of ``context_length`` tokens (vLLM's CPU
    build takes the size in whole GiB: ``VLLM_CPU_KVCACHE_SPACE``), at least 1."""
    itemsize = 4 if config.dtype == "float32" else 2
    need = 2 * num_layers * num_kv_heads * head_dim * itemsize * config.context_length * config.max_batch_size
    return max(1, -(-int(need * 1.25) // (1 << 30)))


def llm_kwargs(config: EngineConfig, *, speculation: bool, draft_dir: str | None) -> dict[str, Any]:
    """The ``vllm.LLM`` keyword arguments of ``config`` (resolved dtype), with our weight-transfer backend
    and worker extension, the processed log-probs our samples carry, and per-request speculative counters."""
    kw: dict[str, Any] = {
        "model": config.model_path,
        "dtype": config.dtype,
        "max_num_seqs": config.max_batch_size,
        "max_model_len": config.context_length,
        "seed": config.seed,
        # dummy weights when the trainer streams them; not with a draft checkpoint: vLLM then shares the
        # target's
        # LM head with the EAGLE-3 head (a draft vocabulary's head no longer fits) and draws d2t at random
        "load_format": "auto" if config.load_weights or config.draft_kind in ("eagle3", "model") else "dummy",
        "worker_extension_cls": WORKER_EXTENSION,
        "weight_transfer_config": {"backend": TRANSFER_BACKEND},
        # the sampled token's log-prob under the distribution it was drawn from (temperature, top-k/p)
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": False,
        "enforce_eager": not config.compile,
        "enable_prefix_caching": config.share_prefix,  # --[no-]rollout-share-prefix
    }
    spec = speculative_config(config, draft_dir) if speculation else None
    if spec is not None:  # vLLM refuses per-request counters without a speculative method
        kw.update(speculative_config=spec, per_request_spec_decode_metrics="detailed")
    # --rollout-engine-kwargs (none of the above: rollout.config.parse_engine_kwargs)
    kw.update(config.engine_kwargs)
    return kw


def vllm_eagle3_dir(draft: str, work: str) -> str:
    """The EAGLE-3 export as vLLM must read it: a copy (config written anew, weights linked) whose
    aux-layer ids are one higher.

    vLLM's id ``i`` is the hidden state *entering* decoder layer ``i`` (the output of layer ``i - 1``;
    ``LlamaModel.forward`` records ``idx + 1`` after layer ``idx``), while ModelOpt's export and the native
    engine mean the output of layer ``i``. Same weights, same layers read."""
    out = os.path.join(work, "vllm_eagle3_draft")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(draft, "config.json")) as f:
        cfg = json.load(f)
    for holder in (cfg, cfg.get("eagle_config") or {}):
        if holder.get("eagle_aux_hidden_state_layer_ids"):
            holder["eagle_aux_hidden_state_layer_ids"] = [
                i + 1 for i in holder["eagle_aux_hidden_state_layer_ids"]
            ]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in os.listdir(draft):
        if name != "config.json" and not os.path.exists(os.path.join(out, name)):
            os.symlink(os.path.abspath(os.path.join(draft, name)), os.path.join(out, name))
    return out


def sample_seed(seed: int, index: int) -> int:
    """The vLLM seed of request ``index`` of a call seeded ``seed`` (its n samples get ``seed + i``:
    vLLM's parallel sampling), spaced so that no two requests' samples share a seed."""
    return (int(seed) * 1_000_003 + index * 65_536) % (1 << 62)


def sampling_kwargs(s: SamplingParams, n: int, seed: int | None) -> dict[str, Any]:
    """``vllm.SamplingParams`` fields with the meaning of ours (top-k 0 = off in both; the sampled token's
    log-prob returned; token ids only)."""
    kw: dict[str, Any] = {"n": n, "temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k,
                          "min_p": s.min_p, "max_tokens": s.max_new_tokens, "ignore_eos": s.ignore_eos,
                          "logprobs": 0, "detokenize": False, "skip_special_tokens": False}
    if s.stop_token_ids:
        kw["stop_token_ids"] = list(s.stop_token_ids)
    if seed is not None:
        kw["seed"] = seed
    return kw


def sample_output(request_id: str, sample_index: int, token_ids: Sequence[int],
                  logprobs: Sequence[Mapping[int, Any]] | None, finish_reason: str | None,
                  spec_metrics: Mapping[str, Any] | None, *, target_version: str | None,
                  draft_version: str | None) -> SampleOutput:
    """One vLLM completion (``CompletionOutput`` fields) as a :class:`SampleOutput`.

    ``spec_metrics``: vLLM's per-request speculative counters (``per_request_spec_decode_metrics`` at
    ``detailed``: ``per_step_accepted`` and ``per_step_drafted``, one entry per verify step that drafted).
    Every verify step emits its accepted drafts plus one token, and the prefill one, so the sample took
    ``len(tokens) - sum(accepted)`` target forwards (a last step cut by EOS or the length limit counts whole).

    Raises:
        VllmOutputError: an aborted request, a missing log-prob, or a log-prob for another token.
    """
    ids = [int(t) for t in token_ids]
    if finish_reason not in (FINISH_STOP, FINISH_LENGTH):
        raise VllmOutputError(
            f"request {request_id} sample {sample_index}: vLLM finish_reason {finish_reason!r}"
        )
    if logprobs is None or len(logprobs) != len(ids):
        raise VllmOutputError(
            f"request {request_id}: {0 if logprobs is None else len(logprobs)} log-probs for "
            f"{len(ids)} tokens (sample with logprobs=0)"
        )
    lps = []
    for i, (tok, entry) in enumerate(zip(ids, logprobs)):
        if tok not in entry:
            raise VllmOutputError(
                f"request {request_id}: log-prob {i} is for tokens {sorted(entry)}, output has {tok}"
            )
        v = entry[tok]
        lps.append(float(v.logprob if hasattr(v, "logprob") else v))
    accepted = [int(a) for a in (spec_metrics or {}).get("per_step_accepted", [])]
    drafted = [int(d) for d in (spec_metrics or {}).get("per_step_drafted", [])]
    if len(accepted) != len(drafted):
        raise VllmOutputError(
            f"request {request_id}: {len(accepted)} accepted counts for {len(drafted)} steps"
        )
    return SampleOutput(request_id=request_id, sample_index=sample_index, output_ids=ids, logprobs=lps,
                        finish_reason=finish_reason, num_verify_steps=max(1, len(ids) - sum(accepted)),
                        accepted_per_step=accepted, weight_version=target_version,
                        draft_weight_version=draft_version, draft_lengths=drafted,
                        draft_sources=["vllm"] * len(drafted))
