"""What the SGLang backend sends to and reads from ``sglang.Engine`` (SGLang 0.5.23), as pure functions.

* :func:`server_kwargs`: ``ServerArgs`` fields from our :class:`EngineConfig` (EAGLE-3 /
  standalone draft model, exact verification, the draft read from its checkpoint, memory saver
  for colocation, block FP8 for the target only, the engine's GPUs via :func:`gpu_placement`).
* :func:`update_request` / :func:`session_request` / :func:`checksum_request`: the request
  objects of the weight-update protocol (``UpdateWeightsFromTensorReqInput`` with an explicit
  selector, never SGLang's default ``"all"``, which loads target tensors into the EAGLE-3 draft).
* :func:`parse_output`: one ``generate`` output (``output_ids`` + ``meta_info``) as our
  :class:`SampleOutput`, counting verify steps the way the native engine does.

Facts used (read from the 0.5.23 sources; docs/design.md, "SGLang"):
``spec_verify_ct`` counts decode verify passes only (``batch_result_processor`` increments it
when a verify commits tokens); the prefill's token is in ``completion_tokens`` but not in
``spec_verify_ct``. ``spec_correct_drafts_histogram[j]`` counts verify steps that accepted j
drafts. ``output_token_logprobs`` entries are ``(logprob, token_id, text)`` with logprob =
log_softmax(logits / T) (unscaled for greedy rows): temperature is applied, top-k/top-p
renormalisation is not (``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset), so under top-k/top-p they are
log p(t) + log Z with Z <= 1 the mass of the support. :func:`parse_output` passes them on as
they are; the GRPO trainer subtracts the verifier's own log Z (``capture/support.py``) before
the mismatch metrics and the TIS weights read them (docs/metrics.md). SGLang's own
renormalised ``return_sampling_mask`` log-probs need a finite top-k and no speculation.

This module imports nothing from SGLang at import time; the request builders take the
request classes from ``sglang.srt.managers.io_struct`` when called.
"""

from __future__ import annotations

import json
import os
import random
import socket
from collections.abc import Mapping, Sequence
from typing import Any

from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.types import FINISH_LENGTH, FINISH_STOP, SampleOutput

SELECTORS = ("target", "draft")
INITIAL_VERSION = "init"
# The EAGLE-3 draft reads the target's embedding (``set_embed``): keep it out of the draft digest,
# or every target update would look like a change of the draft.
DRAFT_SHARED_TENSORS = ("embed_tokens",)


class SGLangOutputError(RuntimeError):
    """A generate output that is inconsistent or reports an abort."""


def speculative_kwargs(config: EngineConfig) -> dict[str, Any]:
    """Speculative-decoding fields for ``config.draft_kind`` (empty for ``none``).

    Exact verification: topk 1 (a chain) and acceptance thresholds 1.0. EAGLE-3 verifies by
    rejection sampling with min(1, p/q). STANDALONE (a draft model) cannot: SGLang 0.5.23 refuses
    ``speculative_use_rejection_sampling`` for it (``_handle_eagle_family`` in
    ``srt/arg_groups/speculative_hook.py`` raises NotImplementedError: only the EAGLE draft workers
    hand the kernel a target-vocabulary proposal), so a draft model runs SGLang's default verify,
    which treats each draft token as a point mass q = 1[x] (accept with p(x), else resample from
    p without x): exact, with lower acceptance than min(1, p/q).

    The draft's weights are read from its checkpoint at launch (``speculative_draft_load_format``
    "auto"), whatever the target's load format: SGLang gives the draft the target's format when
    the draft's is unset (``build_load_config``: ``load_format or get_model().load_format``), and a
    dummy draft would start random, and an EAGLE-3 draft without its ``d2t`` token map, which
    SGLang's EAGLE worker reads once at start-up (``init_lm_head``) and no weight update carries.

    Raises:
        ValueError: draft kinds this backend does not launch (n-gram, MTP: use ``native``).
    """
    kind, k = config.draft_kind, config.k
    if kind == "none":
        return {}
    if kind in ("ngram", "mtp"):
        raise ValueError(f"draft_kind {kind!r} is not launched by the SGLang backend (its n-gram / NEXTN "
                         f"settings do not map onto ours); use --rollout-backend native")
    algorithm = {"eagle3": "EAGLE3", "model": "STANDALONE"}[kind]
    return {
        "speculative_algorithm": algorithm,
        "speculative_draft_model_path": config.draft_path,
        "speculative_draft_load_format": "auto",
        "speculative_num_steps": k,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": k + 1,
        "speculative_accept_threshold_single": 1.0,
        "speculative_accept_threshold_acc": 1.0,
        "speculative_use_rejection_sampling": algorithm == "EAGLE3",
    }


def fp8_target_config(model_path: str) -> dict[str, Any]:
    """The target's ``config.json`` with the block-FP8 ``quantization_config`` added."""
    from megatron_spec.sync.fp8 import quantization_config

    with open(os.path.join(model_path, "config.json")) as f:
        hf = json.load(f)
    return dict(hf, quantization_config=quantization_config())


def gpu_placement(gpu_ids: Sequence[int], tp_size: int) -> dict[str, int]:
    """SGLang's ``base_gpu_id`` / ``gpu_id_step`` for an engine whose TP rank i runs on local GPU
    ``gpu_ids[i]``.

    SGLang places TP rank i (one node, no pipeline parallelism) on ``base_gpu_id + i * gpu_id_step``
    (``Engine._launch_scheduler_processes``; ``weight_cache.protocol.compute_local_gpu_id``), so it
    can only run on GPUs in arithmetic progression. Colocated, ``gpu_ids[i]`` is the device of the
    trainer rank that packs engine TP rank i's payloads (CUDA IPC stays on one device).

    Raises:
        ValueError: not one id per TP rank, a negative id, or ids SGLang cannot place.
    """
    ids = [int(g) for g in gpu_ids]
    if len(ids) != tp_size:
        raise ValueError(f"SGLang engine at TP={tp_size} needs one GPU per TP rank, got gpu_ids {ids}")
    if min(ids) < 0:
        raise ValueError(f"gpu_ids must be local CUDA device indices >= 0, got {ids}")
    step = ids[1] - ids[0] if len(ids) > 1 else 1
    if step < 1 or ids != [ids[0] + i * step for i in range(tp_size)]:
        raise ValueError(
            f"SGLang places TP rank i on base_gpu_id + i * gpu_id_step (step >= 1): gpu_ids {ids} are "
            f"not increasing in equal steps; colocate each engine with ranks on such GPUs"
        )
    return {"base_gpu_id": ids[0], "gpu_id_step": step}


NCCL_PORT_LOW, NCCL_PORT_BLOCK, NCCL_PORT_BLOCKS = 22000, 1000, 8
"""Where engines look for their NCCL port: SGLang's own choice is a random free port in
22000-29999 (``get_free_port_below_ephemeral``); here engine e looks in block ``e % 8`` of 1000."""


def nccl_port(engine_index: int, *, attempts: int = 64, rng: random.Random | None = None) -> int:
    """A free TCP port for the NCCL group of engine ``engine_index``, from a block of its own.

    Each SGLang engine's scheduler binds an ``nccl_port`` only after start-up, and SGLang picks it
    (``PortArgs.init_new`` with ``nccl_port`` None) as a random port of 22000-29999 that is free
    at that moment: engines started together on one node can pick the same one and one of them
    fails to bind. Engines of one node have different indices, and with at most 8 GPUs a node
    holds at most 8 engines, so blocks ``engine_index % 8`` never overlap between them. Checked
    free by binding it on all IPv4 addresses, as SGLang's own check does.

    Raises:
        RuntimeError: no free port among ``attempts`` tries in the block.
    """
    lo = NCCL_PORT_LOW + (engine_index % NCCL_PORT_BLOCKS) * NCCL_PORT_BLOCK
    rng = rng or random.Random()
    for port in rng.sample(range(lo, lo + NCCL_PORT_BLOCK), attempts):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
            return port
    raise RuntimeError(
        f"no free port in {lo}-{lo + NCCL_PORT_BLOCK - 1} for engine {engine_index}'s NCCL group "
        f"after {attempts} tries"
    )


def server_kwargs(config: EngineConfig, *, tp_size: int = 1, speculation: bool = True,
                  overrides: Mapping[str, Any] | None = None, fp8_config_file: str | None = None,
                  gpu_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)`` for ``config``.

    ``gpu_ids`` (one local device index per TP rank, see :func:`gpu_placement`) become
    ``base_gpu_id`` / ``gpu_id_step``; without them SGLang uses GPUs ``0 .. tp_size-1``. The NCCL
    port comes from the engine's own block (:func:`nccl_port`), not from SGLang's shared range.

    FP8 (``config.fp8_weights``): the target is launched as a block-FP8 model with dummy weights,
    since a bf16 checkpoint cannot be loaded into FP8 parameters; the trainer (or
    :class:`SGLangEngine` for ``load_weights``) pushes quantised weights before the first
    generate. Its ``quantization_config`` reaches the target only: ``fp8_config_file`` (written
    from :func:`fp8_target_config`) is passed as ``decrypted_config_file``, the config file SGLang
    reads for the target's model config and never for the draft's (``ModelConfig.from_server_args``).
    ``json_model_override_args`` would not do: it is applied to the draft's model config as well,
    and its ``quant_method`` wins over the draft's "unquant" (``_verify_quantization``), so an
    EAGLE-3 head would be built FP8 and filled with bf16 weights. The draft is unquantised and read
    from its checkpoint.

    Raises:
        ValueError: FP8 weights without ``fp8_config_file``.
    """
    kw: dict[str, Any] = {
        "model_path": config.model_path,
        "dtype": config.dtype,
        "tp_size": tp_size,
        "random_seed": config.seed,
        "context_length": config.context_length,
        "max_running_requests": config.max_batch_size,
        "skip_tokenizer_init": True,  # we send token ids and read output_ids
        "enable_memory_saver": True,  # release/resume around training (colocated)
        "load_format": "auto" if config.load_weights else "dummy",
        "weight_version": INITIAL_VERSION,  # what the native engine calls checkpoint weights
        "nccl_port": nccl_port(config.engine_index),  # engines started together on a node do not race for one
    }
    if not config.share_prefix:  # --no-rollout-share-prefix: SGLang's prefix cache off too
        kw["disable_radix_cache"] = True
    if gpu_ids is not None:
        kw.update(gpu_placement(gpu_ids, tp_size))
    if speculation:
        kw.update(speculative_kwargs(config))
    if config.fp8_weights:
        if fp8_config_file is None:
            raise ValueError(
                "FP8 rollout weights need fp8_config_file: the target's config.json with the block-FP8 "
                "quantization_config (fp8_target_config), written where the engine can read it"
            )
        kw["decrypted_config_file"] = os.path.abspath(fp8_config_file)
        kw["load_format"] = "dummy"
        if kw.get("speculative_algorithm"):
            kw["speculative_draft_model_quantization"] = "unquant"
    if overrides:
        kw.update(overrides)
    return kw


def _io_struct():
    from sglang.srt.managers import io_struct

    return io_struct


def _check_selector(selector: str) -> None:
    if selector not in SELECTORS:
        raise ValueError(
            f"selector must be 'target' or 'draft' (SGLang's 'all' loads target tensors into the "
            f"EAGLE-3 draft), got {selector!r}"
        )


def update_request(payloads: Sequence[bytes], selector: str, weight_version: str | None, flush_cache: bool):
    """``UpdateWeightsFromTensorReqInput`` for flattened-bucket payloads (one per engine TP rank).

    SGLang's TP rank r deserialises ``serialized_named_tensors[r]`` and nothing else
    (``TpModelWorker.deserialize_own_rank``), so ``payloads[r]`` must be the bucket packed on
    rank r's GPU. Each holds the *full* (unsharded) HF tensors: SGLang's parallel layers narrow
    them to rank r's shard in their ``weight_loader`` (tests/sync/test_sglang_tp_payloads.py).
    """
    _check_selector(selector)
    if not payloads or not all(isinstance(p, (bytes, bytearray)) for p in payloads):
        raise TypeError("payloads must be a non-empty list of serialized buckets (bytes), one per TP rank")
    return _io_struct().UpdateWeightsFromTensorReqInput(
        serialized_named_tensors=[bytes(p) for p in payloads], load_format="flattened_bucket",
        flush_cache=flush_cache, weight_version=weight_version, selector=selector)


def session_request(begin: bool, selector: str = "all"):
    """``BeginWeightUpdateReqInput(selector)`` or ``EndWeightUpdateReqInput()``."""
    io = _io_struct()
    if not begin:
        return io.EndWeightUpdateReqInput()
    if selector not in (*SELECTORS, "all"):
        raise ValueError(f"session selector must be 'target', 'draft' or 'all', got {selector!r}")
    return io.BeginWeightUpdateReqInput(selector=selector)


def checksum_request(selector: str):
    """``CheckWeightsReqInput(action="checksum")`` for one group (the draft without shared tensors)."""
    _check_selector(selector)
    skip = list(DRAFT_SHARED_TENSORS) if selector == "draft" else None
    return _io_struct().CheckWeightsReqInput(action="checksum", selector=selector, skip_tensor_list=skip)


def memory_request(release: bool, tags: Sequence[str]):
    io = _io_struct()
    cls = io.ReleaseMemoryOccupationReqInput if release else io.ResumeMemoryOccupationReqInput
    return cls(tags=list(tags))


def parse_output(out: Mapping[str, Any], request_id: str, sample_index: int, *, speculative: bool,
                 target_version: str | None, draft_version: str | None) -> SampleOutput:
    """One SGLang ``generate`` result as a :class:`SampleOutput`.

    ``num_verify_steps`` = ``spec_verify_ct + 1`` (the prefill counts as one, as in the native
    engine) with speculation, else one per token. ``accepted_per_step`` is rebuilt from the
    acceptance histogram (step order is not reported; the statistics do not need it).

    Raises:
        SGLangOutputError: an aborted request, or counts that contradict each other.
    """
    meta = out.get("meta_info")
    if meta is None or "output_ids" not in out:
        raise SGLangOutputError(
            f"request {request_id}: SGLang output lacks output_ids/meta_info: keys {sorted(out)}"
        )
    output_ids = [int(t) for t in out["output_ids"]]
    finish = meta.get("finish_reason") or {}
    ftype = finish.get("type") if isinstance(finish, Mapping) else finish
    if ftype == "abort":
        raise SGLangOutputError(f"request {request_id} aborted by SGLang: {finish.get('message')}")
    if ftype not in (FINISH_STOP, FINISH_LENGTH):
        raise SGLangOutputError(f"request {request_id}: unknown finish_reason {finish!r}")
    completion = int(meta.get("completion_tokens", len(output_ids)))
    if completion != len(output_ids):
        raise SGLangOutputError(
            f"request {request_id}: completion_tokens {completion} != {len(output_ids)} output ids"
        )
    lps = meta.get("output_token_logprobs")
    if lps is None or len(lps) != len(output_ids):
        raise SGLangOutputError(
            f"request {request_id}: {0 if lps is None else len(lps)} output_token_logprobs for "
            f"{len(output_ids)} tokens (generate with return_logprob=True)"
        )
    logprobs = []
    for i, (entry, tok) in enumerate(zip(lps, output_ids)):
        lp, lp_tok = float(entry[0]), int(entry[1])
        if lp_tok != tok:
            raise SGLangOutputError(
                f"request {request_id}: logprob {i} is for token {lp_tok}, output has {tok}"
            )
        logprobs.append(lp)
    verify_ct = int(meta.get("spec_verify_ct", 0) or 0)
    accepted: list[int] = []
    if speculative and verify_ct > 0:
        steps = verify_ct + 1
        hist = meta.get("spec_correct_drafts_histogram") or []
        if hist:
            if sum(hist) != verify_ct:
                raise SGLangOutputError(
                    f"request {request_id}: acceptance histogram covers {sum(hist)} steps, "
                    f"spec_verify_ct is {verify_ct}"
                )
            accepted = [j for j, c in enumerate(hist) for _ in range(int(c))]
            if 1 + sum(accepted) + verify_ct < completion:
                raise SGLangOutputError(
                    f"request {request_id}: {completion} tokens from {verify_ct} verify steps "
                    f"accepting {sum(accepted)} drafts"
                )
    else:
        steps = completion
    version = meta.get("weight_version")
    if version is not None and version not in (target_version, draft_version):
        raise SGLangOutputError(
            f"request {request_id}: generated under weight_version {version!r}, the engine "
            f"should hold target {target_version!r} / draft {draft_version!r}"
        )
    return SampleOutput(
        request_id=request_id,
        sample_index=sample_index,
        output_ids=output_ids,
        logprobs=logprobs,
        finish_reason=ftype,
        num_verify_steps=steps,
        accepted_per_step=accepted,
        weight_version=target_version,
        draft_weight_version=draft_version,
    )
