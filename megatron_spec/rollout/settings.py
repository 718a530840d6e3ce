"""The engine and sampling settings users give, declared once, and the rules between them.

:data:`SETTINGS` is the one source of every engine and sampling setting users set: its name (the
launcher's ``RunConfig`` field and the flag ``--name`` of both ``pretrain_grpo_spec.py`` and
``megatron-spec generate``), default, help, choices, the :class:`~megatron_spec.rollout.config.EngineConfig`
field or :class:`~megatron_spec.rollout.types.SamplingParams` field it fills, and ``generate``'s older flag
name, still accepted (``--draft-kind`` for ``--spec-draft-kind``: users have scripts).
``megatron_spec.config`` declares its rollout, spec and draft fields from it, ``generate`` its flags, and
both build the engine's record with :func:`engine_kwargs` and :func:`sampling_kwargs`; the rules
between the speculation settings are :func:`check_speculation`, called by both and by ``EngineConfig``.

It does not know the engines: only names, defaults and the values' rules.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from megatron_spec.isa import DTYPE_CHOICES

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
    """The ``RunConfig`` group holding it: model, rollout, draft or spec."""
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
    Setting("rollout_top_k", "rollout", 0, "top-k sampling (0, -1: off)", sampling="top_k", alias="--top-k"),
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
        "native engine on a CPU: run its decoder layer compiled by torch.compile (inductor; fused norms, "
        "rotation, activation): faster steps, after a compile of seconds per step shape on first use (cached "
        "on disk for later runs); not where the extension's C++ decoder layers run for the engine's dtype "
        "(they are faster: layers.compiled.compiling_pays)",
        engine="compile",
        alias="--compile",
    ),
    Setting(
        "rollout_share_prefix",
        "rollout",
        True,
        "prompts that begin alike share that prefill: the native engine runs it once per admission where "
        "that saves >= 64 tokens (rollout/native/prefix_share.py); vLLM's enable_prefix_caching and "
        "SGLang's radix cache follow this flag",
        engine="share_prefix",
    ),
    Setting(
        "spec_draft_kind",
        "draft",
        "none",
        "drafter (history: earlier responses to the same prompt, native engine)",
        DRAFT_KINDS,
        engine="draft_kind",
        alias="--draft-kind",
    ),
    Setting(
        "spec_draft_path",
        "draft",
        None,
        "ModelOpt-exported EAGLE-3 directory, or draft-model HF checkpoint",
        engine="draft_path",
        alias="--draft-path",
    ),
    Setting(
        "spec_draft_bf16",
        "draft",
        True,
        "native engine in fp32 on a CPU: run the draft on its weights rounded to bf16 (half "
        "the bytes a draft pass reads; samples stay exactly the policy's, verification does not depend on "
        "the draft's precision)",
        engine="draft_bf16",
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
        "draft",
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
