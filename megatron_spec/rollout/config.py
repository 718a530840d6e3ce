"""What a rollout engine is started with, and the settings users give it, declared once.

:data:`SETTINGS` is the one source of every engine and sampling setting users set: its name (the
launcher's ``RunConfig`` field and the flag ``--name`` of both ``pretrain_grpo_spec.py`` and
``megatron-spec generate``), default, help, choices, the :class:`EngineConfig` field or
:class:`~megatron_spec.rollout.types.SamplingParams` field it fills, and ``generate``'s older flag
name, still accepted (``--draft-kind`` for ``--spec-draft-kind``: users have scripts).
``megatron_spec.config`` declares its rollout and spec fields from it, ``generate`` its flags, and
both build the engine's record with :func:`engine_kwargs` and :func:`sampling_kwargs`; the rules
between the speculation settings are :func:`check_speculation`, called by all three.

:class:`EngineConfig` is plain data, picklable into the engine process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from megatron_spec.isa import DTYPE_CHOICES, resolve_dtype

DRAFT_KINDS = ("none", "eagle3", "model", "mtp", "ngram", "history")
HISTORY_TREE_MODES = ("auto", "off")
BACKENDS = ("native", "sglang", "vllm")


def parse_num_draft_tokens(value: int | str) -> int | str:
    """A ``--spec-num-draft-tokens`` value: ``auto`` or an int (argparse ``type`` and YAML values)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"num_draft_tokens must be an integer or 'auto', got {value!r}") from None


_SAME = object()

DEVICE_DEFAULTS: dict[str, dict[str, int]] = {
    "cpu": {"rollout_max_batch_size": 16, "rollout_max_new_tokens": 64},
    "cuda": {"rollout_max_batch_size": 256, "rollout_max_new_tokens": 1024},
}
"""The launcher's engine sizes where the user gives none, by the device the engines run on: the CPU demo's
(2 cores decode 16 rows at a time at their best) and a GPU engine's (vLLM's ``max_num_seqs`` default of
256 rows; a reasoning-length response, slime's ``rollout_max_response_len`` 1024)."""


def device_default(name: str, device_type: str | None = None) -> int:
    """:data:`DEVICE_DEFAULTS`' ``name`` for ``device_type`` (default: ``cuda`` where torch sees a GPU)."""
    if device_type is None:
        import torch

        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return DEVICE_DEFAULTS[device_type][name]


def default_text(name: str, default: Any) -> str:
    """A flag's default as its help says it: the value, or the sizes by device (:data:`DEVICE_DEFAULTS`)."""
    if default is None and name in DEVICE_DEFAULTS["cpu"]:
        return f"{DEVICE_DEFAULTS['cpu'][name]} on a CPU, {DEVICE_DEFAULTS['cuda'][name]} on a GPU"
    return str(default)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One engine or sampling setting as users set it."""

    name: str
    """The ``RunConfig`` field (in :attr:`group`) and, with dashes, the flag of both commands."""
    group: str
    """The ``RunConfig`` group holding it: model, rollout or spec."""
    default: Any
    help: str
    choices: tuple | None = None
    parse: Callable | None = None
    """The flag's argparse type: the default's type, else ``str`` (a union such as ``int | "auto"`` or a
    default of None names its own)."""
    engine: str | None = None
    """The :class:`EngineConfig` field it fills."""
    sampling: str | None = None
    """The ``SamplingParams`` field it fills."""
    alias: str | None = None
    """``generate``'s flag for it before the names were one (still accepted there)."""
    generate: bool = True
    """Also a flag of ``megatron-spec generate``."""
    generate_default: Any = _SAME
    """``generate``'s default where it differs (a sampler on its own, not a trainer's engine)."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _num_draft_tokens_arg(value: str) -> int | str:
    try:
        return parse_num_draft_tokens(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "hf_checkpoint",
        "model",
        None,
        "HF checkpoint directory of the policy (config.json, safetensors, tokenizer)",
        engine="model_path",
        alias="--model",
    ),
    Setting(
        "seed",
        "model",
        1234,
        "base seed: model-parallel RNG, data order, sampling",
        engine="seed",
        generate_default=0,
    ),
    Setting(
        "rollout_backend",
        "rollout",
        None,
        "rollout engine: native (PyTorch, its own process), sglang (GPU) "
        "or vllm (vLLM in its own process and Python: --rollout-vllm-python); the launcher's default: sglang "
        "with a GPU, native without",
        BACKENDS,
        alias="--backend",
        generate_default="native",
    ),
    Setting(
        "rollout_vllm_python",
        "rollout",
        None,
        "the Python of vLLM's environment for --rollout-backend vllm "
        "(default: $MEGATRON_SPEC_VLLM_PYTHON, else .venv-vllm/bin/python in this repository, made by "
        "scripts/setup_env.sh --with-vllm)",
        parse=str,
        engine="vllm_python",
    ),
    Setting(
        "rollout_startup_timeout_s",
        "rollout",
        600.0,
        "longest an engine may take to start (load, compile) before it is stopped",
        engine="startup_timeout_s",
    ),
    Setting(
        "rollout_call_timeout_s",
        "rollout",
        3600.0,
        "longest one engine call (a generate, a weight update) may "
        "take before the engine is stopped (and, in a run, restarted)",
        engine="call_timeout_s",
    ),
    Setting(
        "rollout_dtype",
        "rollout",
        "auto",
        "engine compute dtype (auto: bfloat16 where the CPU does bf16 "
        "natively or on a GPU, float32 elsewhere; see megatron-spec info)",
        DTYPE_CHOICES,
        engine="dtype",
        alias="--dtype",
    ),
    Setting(
        "rollout_max_batch_size",
        "rollout",
        None,
        "sequences the engine decodes at once",
        engine="max_batch_size",
        alias="--batch-size",
        generate_default=32,
    ),
    Setting(
        "rollout_max_new_tokens",
        "rollout",
        None,
        "longest response",
        sampling="max_new_tokens",
        alias="--max-new-tokens",
        generate_default=128,
    ),
    Setting(
        "rollout_temperature",
        "rollout",
        1.0,
        "sampling temperature (0 = greedy)",
        sampling="temperature",
        alias="--temperature",
    ),
    Setting("rollout_top_p", "rollout", 1.0, "nucleus sampling (1 = off)", sampling="top_p", alias="--top-p"),
    Setting(
        "rollout_top_k", "rollout", 0, "top-k sampling (0 or -1 = off)", sampling="top_k", alias="--top-k"
    ),
    Setting("rollout_min_p", "rollout", 0.0, "min-p sampling (0 = off)", sampling="min_p", alias="--min-p"),
    Setting(
        "rollout_num_threads",
        "rollout",
        None,
        "torch threads in the native engine process",
        parse=int,
        engine="num_threads",
        alias="--num-threads",
    ),
    Setting(
        "rollout_compile",
        "rollout",
        False,
        "native engine on a CPU: run its decoder layer compiled by "
        "torch.compile (inductor; fused norms, rotation, activation): faster steps, after a compile of "
        "seconds "
        "per step shape on first use (cached on disk for later runs); not where the extension's C++ decoder "
        "layers "
        "run for the engine's dtype (they are faster: layers.compiled.compiling_pays)",
        engine="compile",
        alias="--compile",
    ),
    Setting(
        "spec_draft_kind",
        "spec",
        "none",
        "drafter (history: earlier responses to the same prompt, native engine)",
        DRAFT_KINDS,
        engine="draft_kind",
        alias="--draft-kind",
    ),
    Setting(
        "spec_draft_path",
        "spec",
        None,
        "ModelOpt-exported EAGLE-3 directory, or draft-model HF checkpoint",
        engine="draft_path",
        alias="--draft-path",
    ),
    Setting(
        "spec_num_draft_tokens",
        "spec",
        3,
        "k: tokens drafted per verify step, or auto: chosen per step in "
        "0..--spec-max-draft-tokens from measured acceptance and step cost (native engine)",
        parse=_num_draft_tokens_arg,
        engine="num_draft_tokens",
        alias="--num-draft-tokens",
    ),
    Setting(
        "spec_max_draft_tokens",
        "spec",
        5,
        "k_max of --spec-num-draft-tokens auto",
        engine="max_draft_tokens",
        alias="--max-draft-tokens",
    ),
    Setting(
        "spec_history",
        "spec",
        False,
        "also draft from earlier responses to the same prompt (GRPO siblings, "
        "earlier steps), per row where expected to emit more (needs --spec-num-draft-tokens auto)",
        engine="history",
        alias="--history",
    ),
    Setting(
        "spec_history_live",
        "spec",
        True,
        "with the history drafter: also draft from what the running rows of "
        "the same prompt (GRPO siblings) have written so far (the live group index, spec/live.py)",
        engine="history_live",
        alias="--history-live",
    ),
    Setting(
        "spec_history_max_draft_tokens",
        "spec",
        10,
        "the longest history proposal beside the drafter "
        "(--spec-history): steps where only the history drafts may verify this many tokens",
        engine="history_max_draft_tokens",
        alias="--history-max-draft-tokens",
    ),
    Setting(
        "spec_history_tree",
        "spec",
        "auto",
        "tree steps beside --spec-history (the drafter's and the "
        "history's proposals as two branches of one verify): auto (where the cost model expects them to "
        "pay) or off",
        HISTORY_TREE_MODES,
        engine="history_tree",
        alias="--history-tree",
    ),
    Setting(
        "spec_trace",
        "spec",
        None,
        "native engine with --spec-num-draft-tokens auto: append the adaptive "
        "controller's decision of every verify step (plan, predicted and realised tokens/s, seconds) to this "
        "file as JSON lines (rollout/native/decision_trace.py)",
        parse=str,
        engine="spec_trace",
    ),
    Setting(
        "spec_mtp_num_layers",
        "spec",
        1,
        "MTP heads trained beside the policy (spec-draft-kind mtp)",
        engine="mtp_num_layers",
        generate=False,
    ),
)
SETTING: dict[str, Setting] = {s.name: s for s in SETTINGS}


def engine_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """The :class:`EngineConfig` fields that ``values`` (setting name -> value: a ``RunConfig``'s groups
    merged, or ``generate``'s parsed flags) give."""
    return {s.engine: values[s.name] for s in SETTINGS if s.engine and s.name in values}


def sampling_kwargs(values: Mapping[str, Any]) -> dict[str, Any]:
    """The ``SamplingParams`` fields that ``values`` give (see :func:`engine_kwargs`)."""
    return {s.sampling: values[s.name] for s in SETTINGS if s.sampling and s.name in values}


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """``megatron-spec generate``'s flags for the settings it takes: the one name (``--spec-draft-kind``) and
    the older one (``--draft-kind``), parsed into ``args.<setting name>``. (The launcher's flags come from
    the ``RunConfig`` fields, which are declared from the same settings: ``megatron_spec.config``.)"""
    for s in SETTINGS:
        if not s.generate:
            continue
        names = [s.flag] + ([s.alias] if s.alias else [])
        default = s.default if s.generate_default is _SAME else s.generate_default
        kw: dict[str, Any] = {"dest": s.name, "default": default, "help": f"{s.help} (default: {default})"}
        if isinstance(s.default, bool):
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = s.parse or (type(default) if default is not None else str)
            if s.choices:
                kw["choices"] = s.choices
            else:
                kw["metavar"] = s.name.rsplit("_", 1)[-1].upper()
        if s.name == "hf_checkpoint":
            kw["required"] = True
        parser.add_argument(*names, **kw)


def check_speculation(values: Mapping[str, Any], backend: str | None = None) -> None:
    """The rules between the speculation settings (``values``: setting name -> value, as for
    :func:`engine_kwargs`), each a ``ValueError`` naming the flags; ``backend``: the engine's, where known.
    The launcher, ``generate`` and :class:`EngineConfig` all check through this."""
    kind, path = values.get("spec_draft_kind", "none"), values.get("spec_draft_path")
    k, k_max = values.get("spec_num_draft_tokens", 3), values.get("spec_max_draft_tokens", 5)
    history, hist_k = values.get("spec_history", False), values.get("spec_history_max_draft_tokens", 10)
    if kind not in DRAFT_KINDS:
        raise ValueError(f"--spec-draft-kind must be one of {DRAFT_KINDS}, got {kind!r}")
    if kind in ("eagle3", "model") and not path:
        raise ValueError(f"--spec-draft-kind {kind} needs --spec-draft-path")
    if k != "auto" and (not isinstance(k, int) or isinstance(k, bool)):
        raise ValueError(f"--spec-num-draft-tokens must be an integer or 'auto', got {k!r}")
    k_most = k_max if k == "auto" else k
    if kind != "none" and k_most < 1:
        raise ValueError(
            f"--spec-num-draft-tokens (--spec-max-draft-tokens with auto) must be >= 1, got {k_most}"
        )
    if hist_k < 1:
        raise ValueError(f"--spec-history-max-draft-tokens must be >= 1, got {hist_k}")
    if history and (k != "auto" or kind in ("none", "history")):
        raise ValueError(
            "--spec-history needs --spec-num-draft-tokens auto and a --spec-draft-kind other than "
            "none and history (--spec-draft-kind history drafts from the history alone)"
        )
    if values.get("spec_history_tree", "auto") not in HISTORY_TREE_MODES:
        raise ValueError(f"--spec-history-tree must be one of {HISTORY_TREE_MODES}, "
                         f"got {values.get('spec_history_tree')!r}")
    if values.get("spec_trace") and (k != "auto" or kind == "none"):
        raise ValueError("--spec-trace records the adaptive controller's decisions: it needs "
                         "--spec-num-draft-tokens auto and a --spec-draft-kind")
    if backend in ("sglang", "vllm") and (k == "auto" or history or kind == "history"):
        name = {"sglang": "SGLang's", "vllm": "vLLM's"}[backend]
        raise ValueError(
            f"--spec-num-draft-tokens auto, --spec-history and --spec-draft-kind history need the "
            f"native engine (--rollout-backend native): {name} speculative worker fixes k at "
            f"start-up (docs/architecture.md)"
        )


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
sets
each, or None where the weight sync, the log-probs or the exactness proofs depend on our value)."""


def parse_engine_kwargs(text: str | None, backend: str) -> dict:
    """``--rollout-engine-kwargs``: a JSON object of the engine's own arguments (SGLang's ``ServerArgs``
    fields,
    vLLM's ``LLM(...)`` keywords), passed through; raises ``ValueError`` naming what is wrong."""
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
            {s.name: getattr(self, s.engine) for s in SETTINGS if s.engine and s.group == "spec"}
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
