"""What a rollout engine is started with: :class:`EngineConfig`, plain data, picklable into the engine
process, and the engine's own arguments a user passes through (:func:`parse_engine_kwargs`).

The settings users give and the rules between them are :mod:`megatron_spec.rollout.settings`; this module
does not know flags or ``RunConfig``.
"""

from __future__ import annotations

import dataclasses
import os

from megatron_spec.isa import DTYPE_CHOICES, resolve_dtype
from megatron_spec.rollout.settings import SETTINGS, check_speculation

ENGINE_KWARGS_SET_HERE = {
    "sglang": {
        "model_path": "--hf-checkpoint",
        "dtype": "--rollout-dtype",
        "tp_size": "--rollout-tensor-parallel-size",
        "random_seed": "--seed",
        "context_length": "--max-prompt-length + --rollout-max-new-tokens",
        "max_running_requests": "--rollout-max-batch-size",
        "mem_fraction_static": "--rollout-mem-fraction-static",
        "skip_tokenizer_init": None,
        "enable_memory_saver": None,
        "load_format": None,
        "weight_version": None,
        "decrypted_config_file": None,
        "speculative_algorithm": "--spec-draft-kind",
        "speculative_draft_model_path": "--spec-draft-path",
        "speculative_num_steps": "--spec-num-draft-tokens",
        "speculative_num_draft_tokens": "--spec-num-draft-tokens",
        "speculative_eagle_topk": None,
    },
    "vllm": {
        "model": "--hf-checkpoint",
        "dtype": "--rollout-dtype",
        "max_num_seqs": "--rollout-max-batch-size",
        "max_model_len": "--max-prompt-length + --rollout-max-new-tokens",
        "seed": "--seed",
        "enforce_eager": "--rollout-compile",
        "speculative_config": "--spec-*",
        "load_format": None,
        "worker_extension_cls": None,
        "weight_transfer_config": None,
        "logprobs_mode": None,
        "disable_log_stats": None,
        "per_request_spec_decode_metrics": None,
    },
}
"""The engine arguments megatron-spec sets itself (what ``--rollout-engine-kwargs`` may not: the flag that
sets each, or None where the weight sync, the log-probs or the exactness proofs depend on our value)."""


def parse_engine_kwargs(text: str | None, backend: str) -> dict:
    """``--rollout-engine-kwargs``: a JSON object of the engine's own arguments (SGLang's ``ServerArgs``
    fields, vLLM's ``LLM(...)`` keywords), passed through; raises ``ValueError`` naming what is wrong."""
    from megatron_spec.config_values import json_object

    value = json_object("--rollout-engine-kwargs", text)
    if value and backend == "native":
        raise ValueError(
            "--rollout-engine-kwargs: the native engine takes no engine arguments (its settings are the "
            "--rollout-* flags); they are for --rollout-backend sglang or vllm"
        )
    for key in value:
        if key in ENGINE_KWARGS_SET_HERE.get(backend, {}):
            flag = ENGINE_KWARGS_SET_HERE[backend][key]
            raise ValueError(
                f"--rollout-engine-kwargs: {key!r} is set by megatron-spec "
                + (f"from {flag}" if flag else "(the weight sync, log-probs or exactness depend on it)")
            )
    return value


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_path: str
    """HF checkpoint directory of the target (config.json, safetensors, tokenizer)."""
    draft_kind: str = "none"
    """none | eagle3 | model | mtp | ngram."""
    draft_path: str | None = None
    """EAGLE-3 export (ModelOpt) or draft-model HF checkpoint; MTP heads come from the trainer."""
    draft_bf16: bool = True
    """Native engine in fp32 on a CPU: the draft computes with its weights rounded to bf16 (half the bytes a
    draft pass reads; the samples stay exactly the target's: verification does not depend on the draft)."""
    num_draft_tokens: int | str = 3
    """k: tokens drafted per verify step, or ``auto``: chosen per step in 0..``max_draft_tokens`` by the
    engine from measured acceptance and step cost (native engine; ``adaptive.py``)."""
    max_draft_tokens: int = 5
    """k_max of ``num_draft_tokens auto``."""
    history: bool = False
    """Also draft from earlier responses to the same prompt (this call's siblings, earlier calls'),
    per row and step where the adaptive controller expects it to emit more (needs ``auto``)."""
    history_live: bool = True
    """With the history drafter (``history``, or ``draft_kind`` ``history``): also the live group index,
    the text the running rows of each prompt have emitted so far (``megatron_spec.speculative.live``)."""
    history_max_draft_tokens: int = 10
    """The longest history proposal beside a drafter (``history``): in steps where only the history
    drafts, the verify step may be this wide (a proposal from the history costs no forward)."""
    history_tree: str = "auto"
    """Tree steps beside ``history`` (the drafter's k tokens and up to ``history_max_draft_tokens`` of the
    history's as two branches of one verify, ``megatron_spec.speculative.verify_tree``): ``auto`` where the
    controller expects them to pay, or ``off`` (the tests force them with the test hook
    ``history_tree_always``, ``megatron_spec.faults``)."""
    share_prefix: bool = True
    """Prompts share the prefill of a beginning they share: the native engine's admissions
    (:mod:`megatron_spec.rollout.native.prefix_share`), vLLM's ``enable_prefix_caching``, SGLang's radix cache
    (``disable_radix_cache`` when off)."""
    spec_trace: str | None = None
    """A JSON-lines file the adaptive controller appends its decision of every verify step to
    (:mod:`megatron_spec.rollout.native.decision_trace`), or None."""
    device: str = "cpu"
    """Where the native engine runs: ``cpu``, ``cuda`` or ``cuda:N`` (the trainer passes its own device, so a
    GPU rank's engine shares its GPU). SGLang places itself (``tp_size`` GPUs from this process's)."""
    dtype: str = "float32"
    """Engine compute dtype: auto | float32 | bfloat16. Each backend resolves it once at start-up through
    ``megatron_spec.isa.resolve_dtype`` (the native engine: bf16 only where the CPU does bf16 natively,
    an explicit bfloat16 elsewhere runs in fp32 with a warning; SGLang: bf16 on the GPU) and keeps the
    resolved value in its ``config``. The user-facing defaults (``--rollout-dtype``, ``generate
    --dtype``) are ``auto``; this record's default stays the exact fp32 that library callers expect."""
    max_batch_size: int = 32
    """Sequences decoded at once (KV-cache slots)."""
    context_length: int = 2048
    """Longest prompt + generation the engine accepts."""
    seed: int = 0
    ngram_min: int = 1
    ngram_max: int = 4
    num_threads: int | None = None
    """torch intra-op threads in the engine process (None: torch's default)."""
    compile: bool = False
    """Run the target's single-segment forwards through its decoder layer compiled by ``torch.compile``
    (``megatron_spec.layers.compiled``; native engine on a CPU, weights packed for oneDNN). Greedy tokens as
    eager (fp32 logits within ~2e-6 relative); ``warm_up`` compiles the decode and verify shapes at
    start-up."""
    load_weights: bool = True
    """Read the target weights from ``model_path``; False waits for a weight update instead."""
    fp8_weights: bool = False
    """Expect block-FP8 target weights (``weight_scale_inv``) in updates and dequantise them."""
    mtp_num_layers: int = 1
    """MTP heads the trainer streams (draft_kind mtp)."""
    warm_up: bool = True
    """Build oneDNN's primitives for every decode-sized row count at start-up
    (``model.warm_linears``), so the first rollouts do not pay for them."""
    startup_timeout_s: float = 600.0
    call_timeout_s: float = 3600.0
    vllm_python: str | None = None
    """The vLLM environment's Python (``--rollout-backend vllm``;
    ``megatron_spec.rollout.vllm_backend.vllm_python``)."""
    engine_kwargs: dict = dataclasses.field(default_factory=dict)
    """The engine's own arguments, passed through (``--rollout-engine-kwargs``;
    :func:`parse_engine_kwargs`)."""
    engine_index: int = 0
    """Which of the job's engines this is (``--rollout-num-engines``): names it in logs and in
    the fault-injection points of the tests (``megatron_spec.faults``)."""

    def __post_init__(self) -> None:
        check_speculation(
            {s.name: getattr(self, s.engine) for s in SETTINGS if s.engine and s.group in ("draft", "spec")}
        )
        kind, _, index = self.device.partition(":")
        if kind not in ("cpu", "cuda") or (index and (kind != "cuda" or not index.isdigit())):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {self.dtype!r}")
        if self.max_batch_size < 1 or self.context_length < 2:
            raise ValueError("max_batch_size must be >= 1 and context_length >= 2")
        if not os.path.isdir(self.model_path):
            raise FileNotFoundError(f"model_path {self.model_path} is not a directory")
        if self.draft_path and self.draft_kind in ("eagle3", "model") and not os.path.isdir(self.draft_path):
            raise FileNotFoundError(f"draft_path {self.draft_path} is not a directory")

    def resolved(self, device: str | None = None) -> EngineConfig:
        """This config with ``dtype`` resolved for an engine on ``device`` (``cpu`` | ``cuda``; default: the
        config's own ``device``)."""
        dtype = resolve_dtype(self.dtype, device or self.device_type)
        return self if dtype == self.dtype else dataclasses.replace(self, dtype=dtype)

    @property
    def device_type(self) -> str:
        """``cpu`` or ``cuda``."""
        return self.device.partition(":")[0]

    @property
    def adaptive(self) -> bool:
        return self.num_draft_tokens == "auto"

    @property
    def k(self) -> int:
        """Tokens drafted per step (k_max with ``auto``); 0 without a drafter."""
        if self.draft_kind == "none":
            return 0
        return self.max_draft_tokens if self.adaptive else self.num_draft_tokens

    @property
    def k_verify(self) -> int:
        """The widest verify step, in drafted tokens: k, or the history's longest proposal beside it."""
        return max(self.k, self.history_max_draft_tokens) if self.history else self.k
