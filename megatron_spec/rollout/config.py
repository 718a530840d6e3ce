"""What a rollout engine is started with (both backends read the same record).

:class:`EngineConfig` is plain data, picklable into the engine process. The trainer builds
it from its ``RolloutConfig``/``SpecConfig`` (``megatron_spec.config``); ``megatron-spec
generate`` builds it from its flags.
"""

from __future__ import annotations

import dataclasses
import os

from megatron_spec.isa import DTYPE_CHOICES, resolve_dtype

DRAFT_KINDS = ("none", "eagle3", "model", "mtp", "ngram", "history")
HISTORY_TREE_MODES = ("auto", "off", "always")
BACKENDS = ("native", "sglang")


def parse_num_draft_tokens(value: "int | str") -> "int | str":
    """A ``--num-draft-tokens`` value: ``auto`` or an int (argparse ``type`` and YAML values)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"num_draft_tokens must be an integer or 'auto', got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model_path: str
    """HF checkpoint directory of the target (config.json, safetensors, tokenizer)."""
    draft_kind: str = "none"
    """none | eagle3 | model | mtp | ngram."""
    draft_path: str | None = None
    """EAGLE-3 export (ModelOpt) or draft-model HF checkpoint; MTP heads come from the trainer."""
    num_draft_tokens: int | str = 3
    """k: tokens drafted per verify step, or ``auto``: chosen per step in 0..``max_draft_tokens`` by the
    engine from measured acceptance and step cost (native engine; ``adaptive.py``)."""
    max_draft_tokens: int = 5
    """k_max of ``num_draft_tokens auto``."""
    history: bool = False
    """Also draft from earlier responses to the same prompt (this call's siblings, earlier calls'),
    per row and step where the adaptive controller expects it to emit more (needs ``auto``)."""
    history_max_draft_tokens: int = 10
    """The longest history proposal beside a drafter (``history``): in steps where only the history
    drafts, the verify step may be this wide (a proposal from the history costs no forward)."""
    history_tree: str = "auto"
    """Tree steps beside ``history`` (the drafter's k tokens and up to ``history_max_draft_tokens`` of the
    history's as two branches of one verify, ``megatron_spec.spec.verify_tree``): ``auto`` where the
    controller expects them to pay, ``off``, or ``always`` whenever a row has a history proposal (tests)."""
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
    engine_index: int = 0
    """Which of the job's engines this is (``--rollout-num-engines``): names it in logs and in
    the fault-injection points of the tests (``megatron_spec.faults``)."""

    def __post_init__(self) -> None:
        if self.draft_kind not in DRAFT_KINDS:
            raise ValueError(f"draft_kind must be one of {DRAFT_KINDS}, got {self.draft_kind!r}")
        if self.draft_kind in ("eagle3", "model") and not self.draft_path:
            raise ValueError(f"draft_kind {self.draft_kind} needs a draft_path")
        if self.num_draft_tokens != "auto" and (not isinstance(self.num_draft_tokens, int)
                                                or isinstance(self.num_draft_tokens, bool)):
            raise ValueError(f"num_draft_tokens must be an int or 'auto', got {self.num_draft_tokens!r}")
        if self.draft_kind != "none" and self.k < 1:
            raise ValueError(f"num_draft_tokens (max_draft_tokens with auto) must be >= 1, got {self.k}")
        if self.history and (not self.adaptive or self.draft_kind in ("none", "history")):
            raise ValueError("history beside a drafter needs num_draft_tokens auto and a draft_kind other than "
                             "none and history (draft_kind history drafts from the history alone)")
        if self.history_tree not in HISTORY_TREE_MODES:
            raise ValueError(f"history_tree must be one of {HISTORY_TREE_MODES}, got {self.history_tree!r}")
        if self.history and self.history_max_draft_tokens < 1:
            raise ValueError(f"history_max_draft_tokens must be >= 1, got {self.history_max_draft_tokens}")
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

    def resolved(self, device: str | None = None) -> "EngineConfig":
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
