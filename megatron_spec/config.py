"""Configuration of a GRPO run: one dataclass per subsystem, CLI flags generated from them.

Every field becomes a kebab-case flag (``micro_batch_size`` -> ``--micro-batch-size``), with
its docstring as help (the ``field(metadata={"help": ...})``), so the flags, their defaults
and ``--help`` can never drift apart. ``--config FILE.yaml`` supplies values for long runs;
flags given on the command line override the file. The resolved :class:`RunConfig` is
printed once at start and saved with the run (``config.yaml``).

Cross-field checks raise :class:`ConfigError` (a ``ValueError``) naming the flags involved; the
launcher prints it as one ``error:`` line and exits 2, where a real crash keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron_spec.config_values import ConfigError, coerce, parse_stop_strings
from megatron_spec.rollout.config import (
    SETTING,
    check_speculation,
    default_text,
    device_default,
    parse_num_draft_tokens,
)


def _json_object(value: Any, flag: str) -> str:
    """A JSON object flag's value as JSON text (a YAML file may give the mapping itself)."""
    import json

    if isinstance(value, dict):
        return json.dumps(value)
    try:
        parsed = json.loads(value)
    except (TypeError, json.JSONDecodeError):
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {value!r}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{flag} must be a JSON object, got {value!r}")
    return value


def _f(
    default: Any, help: str, choices: tuple | None = None, flag: str | None = None, parse: Any = None
) -> Any:
    meta = {"help": help}
    if parse:
        meta["parse"] = parse  # the flag's argparse type where the field's type is a union (int | "auto")
    if choices:
        meta["choices"] = choices
    if flag:
        meta["flag"] = flag
    return field(default=default, metadata=meta)


def _setting(name: str) -> Any:
    """A field declared by the engine settings' one source (``megatron_spec.rollout.config.SETTINGS``)."""
    s = SETTING[name]
    return _f(s.default, s.help, s.choices, parse=s.parse)


@dataclass
class ModelConfig:
    hf_checkpoint: str = _setting("hf_checkpoint")
    tensor_model_parallel_size: int = _f(
        1, "tensor-parallel size (divides the world size; the rest is data parallel)"
    )
    make_vocab_size_divisible_by: int = _f(
        128, "pad the vocabulary to a multiple of this times TP (Megatron-LM)"
    )
    bf16: bool = _f(False, "train the policy in bfloat16 (default float32)")
    seed: int = _setting("seed")


@dataclass
class DataConfig:
    prompt_data: str = _f(None, "prompt set: a JSONL or Parquet file, a directory a datasets library wrote "
                                "(save_to_disk) or holding JSONL/Parquet files, or 'synthetic:<task>' (see "
                                "megatron_spec.rl.synthetic_tasks)")
    prompt_key: str = _f("prompt", "column holding the prompt text")
    answer_key: str = _f("answer", "column holding the reference answer passed to the reward")
    apply_chat_template: bool = _f(
        False,
        "render each prompt as a user turn with the tokenizer's chat template "
        "(add_generation_prompt; the template writes BOS and the other special "
        "tokens); off: the prompt is tokenised with the tokenizer's own special "
        "tokens (BOS where it adds one)",
    )
    apply_chat_template_kwargs: str = _f(
        None,
        "the chat template's own variables as a JSON object (a mapping in "
        "YAML), e.g. '{\"enable_thinking\": false}' for Qwen3",
        parse=lambda v: _json_object(v, "--apply-chat-template-kwargs"),
    )
    system_prompt: str = _f(None, "system turn put before each prompt (needs --apply-chat-template)")
    prompt_template: str = _f(None, "text each prompt becomes, with {prompt} standing for the prompt column, "
                                    "before the chat template: e.g. '{prompt} Answer True or False.'")
    stop: str = _f(
        None,
        "stop string(s) ending a response after the EOS ids of config.json and "
        "generation_config.json: one string or a JSON list; the response keeps the stop string",
    )
    reward: str = _f(
        "synthetic",
        "reward function: a registered name (synthetic, math, exact), 'module:function' (the "
        "working directory importable) or 'path/to/file.py:function'",
    )
    num_synthetic_prompts: int = _f(2048, "prompts generated for a synthetic task")
    max_prompt_length: int = _f(256, "longest prompt in tokens (see --overlong-prompts)")
    overlong_prompts: str = _f(
        "filter",
        "prompts longer than --max-prompt-length: filter (dropped when the data "
        "loads, their count printed, as verl and slime do) or error",
        ("filter", "error"),
    )
    eval_data: str = _f(
        None,
        "held-out prompts for --eval-interval: a file or 'synthetic:<task>' (default: the "
        "synthetic training task drawn with another seed)",
    )
    eval_prompts: int = _f(128, "prompts per held-out evaluation (the first N of --eval-data)")


@dataclass
class RolloutConfig:
    rollout_backend: str = _setting("rollout_backend")
    rollout_dtype: str = _setting("rollout_dtype")
    rollout_weight_dtype: str = _f(
        "fp32",
        "dtype of streamed weights (fp8: block-FP8 target, draft unquantised)",
        ("fp32", "bf16", "fp8"),
    )
    rollout_max_batch_size: int = _setting("rollout_max_batch_size")
    rollout_max_new_tokens: int = _setting("rollout_max_new_tokens")
    rollout_temperature: float = _setting("rollout_temperature")
    rollout_top_p: float = _setting("rollout_top_p")
    rollout_top_k: int = _setting("rollout_top_k")
    rollout_min_p: float = _setting("rollout_min_p")
    rollout_num_threads: int = _setting("rollout_num_threads")
    rollout_compile: bool = _setting("rollout_compile")
    rollout_vllm_python: str = _setting("rollout_vllm_python")
    rollout_startup_timeout_s: float = _setting("rollout_startup_timeout_s")
    rollout_call_timeout_s: float = _setting("rollout_call_timeout_s")
    rollout_bucket_mb: int = _f(64, "weight-streaming bucket size in MiB")
    rollout_reference_check: bool = _f(
        False,
        "start the native engine beside the rollout engine (plain decoding, "
        "the same weights streamed to it) and after every weight sync compare "
        "both engines' greedy tokens on the first --rollout-reference-prompts "
        "training prompts; a difference stops the run naming the prompt and "
        "position (health/reference_*, docs/metrics.md). Costs a second copy "
        "of the weights and a second sync per step",
    )
    rollout_reference_prompts: int = _f(4, "prompts of --rollout-reference-check")
    rollout_reference_tokens: int = _f(32, "greedy tokens per prompt of --rollout-reference-check")
    async_policy_lag: int = _f(
        0,
        "policy lag L: the engines generate the next batch while the trainer trains this "
        "one, and batch t comes from policy version max(0, t-L); one batch is in flight, "
        "so L=1 gives all the overlap and L>1 only older weights (0 = synchronous)",
    )
    rollout_release_memory: bool = _f(
        True, "release engine memory (KV cache, weights) while the trainer trains"
    )
    rollout_engine_kwargs: str = _f(
        None,
        "JSON object of the rollout engine's own arguments, passed through: SGLang "
        "ServerArgs fields (checked by the lossless guard), vLLM LLM(...) keywords, "
        "e.g. '{\"chunked_prefill_size\": 8192}'; not those our flags set",
    )
    rollout_mem_fraction_static: float = _f(
        None,
        "SGLang's mem_fraction_static: the share of GPU memory its weights "
        "and KV cache take while it generates (default: SGLang's choice, "
        "sized for a GPU of its own; colocated, see docs/memory_plan.md)",
    )
    colocate_offload: str = _f(
        "none",
        "what the trainer moves to host memory while the colocated engine generates: "
        "optimizer (fp32 main weights, AdamW moments, gradient buffers) or all (and "
        "the weights); a no-op on CPU (docs/memory_plan.md)",
        ("none", "optimizer", "all"),
    )
    engine_restarts: int = _f(2, "restarts of a dead engine per step before the run fails")
    rollout_num_engines: int = _f(
        None,
        "rollout engines; engine e is owned by the first rank of the e-th block of "
        "world/N ranks and serves a share of each step's prompts (default: one per "
        "node)",
    )
    rollout_tensor_parallel_size: int = _f(
        None,
        "GPUs (ranks) per engine: SGLang's tp_size (default: every rank of "
        "the engine's block with SGLang; the native engine runs 1)",
    )
    rollout_wait_timeout_s: float = _f(
        10800.0,
        "longest a rank waits for the engines' rollouts (the long-timeout "
        "group around generation); exceeded: the run stops naming the engine",
    )
    dist_timeout_s: float = _f(
        600.0, "timeout of the training collectives (gradient reduction, weight gathers)"
    )

    def __post_init__(self):
        if self.rollout_max_batch_size is None:  # not given: sized by the device
            self.rollout_max_batch_size = device_default("rollout_max_batch_size")
        if self.rollout_max_new_tokens is None:
            self.rollout_max_new_tokens = device_default("rollout_max_new_tokens")


@dataclass
class SpecConfig:
    spec_draft_kind: str = _setting("spec_draft_kind")
    spec_draft_path: str = _setting("spec_draft_path")
    spec_num_draft_tokens: int | str = _setting("spec_num_draft_tokens")
    spec_max_draft_tokens: int = _setting("spec_max_draft_tokens")
    spec_history: bool = _setting("spec_history")
    spec_history_live: bool = _setting("spec_history_live")
    spec_history_max_draft_tokens: int = _setting("spec_history_max_draft_tokens")
    spec_history_tree: str = _setting("spec_history_tree")
    spec_trace: str | None = _setting("spec_trace")
    spec_online_draft_training: bool = _f(
        False, "train the EAGLE-3 draft online from the verifier's hidden states"
    )
    spec_draft_ttt_steps: int = _f(3, "training-time-test unroll of the online draft trainer")
    spec_draft_lr: float = _f(
        3e-4, "online draft learning rate (1e-3 shook a converged draft: docs/draft_training.md)"
    )
    spec_draft_tv_weight: float = _f(
        0.0,
        "add this weight times the total variation 1 - sum min(p, q) to the online "
        "EAGLE-3 draft's loss: trains for acceptance (docs/draft_training.md)",
    )
    spec_mtp_num_layers: int = _setting("spec_mtp_num_layers")
    spec_watchdog_steps: int = _f(
        3,
        "steps of acceptance ~1 before the collapse watchdog acts (0 = off); a sudden "
        "collapse from healthy acceptance acts on its first step",
    )
    spec_watchdog_fallback: bool = _f(False, "on acceptance collapse fall back to autoregressive decoding")

    @property
    def spec_k_max(self) -> int:
        """Tokens drafted per step at most (the fixed k, or --spec-max-draft-tokens with auto)."""
        return (
            self.spec_max_draft_tokens
            if self.spec_num_draft_tokens == "auto"
            else int(self.spec_num_draft_tokens)
        )


@dataclass
class GRPOConfig:
    train_iters: int = _f(20, "RL steps")
    prompts_per_step: int = _f(8, "prompts sampled per step")
    grpo_group_size: int = _f(8, "G: samples per prompt")
    micro_batch_size: int = _f(8, "sequences per forward/backward (gradient accumulation over the rest)")
    grpo_num_minibatches: int = _f(1, "optimizer steps per rollout batch (1 = strictly on-policy)")
    lr: float = _f(1e-5, "policy learning rate (AdamW)")
    lr_warmup_steps: int = _f(0, "linear learning-rate warm-up over the first N RL steps (AdamW's first "
                                 "updates move every parameter by about lr, whatever its gradient's noise)")
    lr_decay_style: str = _f(
        "constant",
        "learning rate after the warm-up, over the remaining --train-iters steps, down to --lr-min",
        ("constant", "cosine", "linear"),
    )
    lr_min: float = _f(0.0, "learning rate a cosine or linear decay reaches at step --train-iters")
    weight_decay: float = _f(0.0, "AdamW weight decay (matrices only: norms and biases get none)")
    clip_grad: float = _f(1.0, "policy gradient-norm clip (0 = off)")
    clip_eps_low: float = _f(0.2, "ratio clip below: 1 - eps_low")
    clip_eps_high: float = _f(0.28, "ratio clip above: 1 + eps_high")
    kl_coef: float = _f(
        0.0, "coefficient of the k3 KL estimate to a frozen reference (0 = no reference model)"
    )
    loss_agg: str = _f("token", "loss aggregation", ("token", "sequence"))
    advantage_baseline: str = _f("group", "baseline of the advantage", ("group", "batch"))
    advantage_normalize_std: bool = _f(True, "divide advantages by the group (or batch) std")
    tis_cap: float = _f(
        0.0,
        "truncated importance-sampling correction by engine/trainer ratio, cap C (0 = off); "
        "the weight multiplies the policy-gradient and the KL term",
    )
    dynamic_sampling: bool = _f(
        False,
        "drop groups whose rewards are all equal before training (DAPO's dynamic "
        "sampling: their advantages are 0); the step trains on fewer rollouts, "
        "train/samples_trained says how many",
    )
    truncated_responses: str = _f(
        "keep",
        "responses cut at --rollout-max-new-tokens: keep (train on them as "
        "scored) or drop (no loss on them; they still count in their group's "
        "baseline)",
        ("keep", "drop"),
    )


@dataclass
class CheckpointConfig:
    save: str = _f(
        None,
        "the run's folder: checkpoints, metrics, exports (default runs/grpo-<date>-<time>); a run "
        "started again with the same --save resumes from its latest complete checkpoint",
    )
    load: str = _f(None, "resume from this checkpoint directory (latest iteration)")
    resume: bool = _f(
        True,
        "resume from the latest complete checkpoint in --save when it has one; --no-resume "
        "starts over there, removing the previous run's checkpoints, metrics and exports",
    )
    save_interval: int = _f(
        10, "save a checkpoint every N steps, and after the last (0 = only after the last)"
    )
    save_keep: int = _f(
        0, "keep the newest N checkpoints, removing older ones after each save (0 = keep all)"
    )
    save_hf: bool = _f(
        True,
        "at the end of the run write the trained policy as an HF folder, <run>/hf/policy, "
        "beside its draft (<run>/hf/eagle3, mtp or draft_model): what transformers, vLLM, "
        "SGLang and lm-eval load (docs/serving_exports.md)",
    )


@dataclass
class LoggingConfig:
    logger: str = _f(
        "jsonl,tensorboard",
        "where the metrics go, comma-separated: jsonl (always written: resume and the "
        "report read it), tensorboard, wandb (W&B; WANDB_MODE=offline needs no network)",
    )
    wandb_project: str = _f("megatron-spec", "W&B project (--logger wandb)")
    wandb_name: str = _f(
        None, "W&B run name (default: the run folder's name; a resumed run continues its W&B run)"
    )
    metrics_path: str = _f(None, "metrics JSONL (default <save>/metrics.jsonl)")
    tensorboard_dir: str = _f(None, "TensorBoard directory (default <save>/tensorboard; 'none' = off)")
    log_interval: int = _f(1, "progress line every N steps (0: none)")
    quiet: bool = _f(False, "no progress line")
    dump_rollouts: bool = _f(False, "write every step's rollouts to <save>/rollouts/step_NNNNNN.jsonl")
    eval_interval: int = _f(
        0,
        "every N steps and after the last, the mean reward of the current policy on held-out "
        "prompts, one sample each with the rollout sampling settings and a fixed seed "
        "(eval/reward; 0 = off; synchronous runs only)",
    )


GROUPS: dict[str, type] = {
    "model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "spec": SpecConfig,
    "grpo": GRPOConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> RunConfig:
        m, r, s, g = self.model, self.rollout, self.spec, self.grpo
        if not m.hf_checkpoint:
            raise ConfigError("--hf-checkpoint is required")
        if not self.data.prompt_data:
            raise ConfigError("--prompt-data is required")
        if s.spec_online_draft_training and s.spec_draft_kind not in ("eagle3", "mtp"):
            raise ConfigError("--spec-online-draft-training needs --spec-draft-kind eagle3 or mtp")
        if s.spec_draft_kind == "mtp" and not s.spec_online_draft_training and not s.spec_draft_path:
            raise ConfigError(
                "--spec-draft-kind mtp needs --spec-online-draft-training (heads trained beside the "
                "policy) or --spec-draft-path (an MTP export)"
            )
        if not (s.spec_draft_tv_weight >= 0 and math.isfinite(s.spec_draft_tv_weight)):
            raise ConfigError(f"--spec-draft-tv-weight {s.spec_draft_tv_weight} must be >= 0 and finite")
        if s.spec_draft_tv_weight and (s.spec_draft_kind != "eagle3" or not s.spec_online_draft_training):
            raise ConfigError(
                "--spec-draft-tv-weight trains the EAGLE-3 draft online: it needs --spec-draft-kind "
                "eagle3 and --spec-online-draft-training"
            )
        try:
            # YAML may hold "auto" or 3
            s.spec_num_draft_tokens = parse_num_draft_tokens(s.spec_num_draft_tokens)
        except ValueError as exc:
            raise ConfigError(f"--spec-num-draft-tokens: {exc}") from exc
        try:
            check_speculation(dataclasses.asdict(s), r.rollout_backend)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        lg, d = self.logging, self.data
        if lg.log_interval < 0:
            raise ConfigError(f"--log-interval {lg.log_interval} must be >= 0 (0: no progress line)")
        if lg.eval_interval < 0 or d.eval_prompts < 1:
            raise ConfigError(
                f"--eval-interval {lg.eval_interval} must be >= 0 and --eval-prompts {d.eval_prompts} >= 1"
            )
        if lg.eval_interval and r.async_policy_lag:
            raise ConfigError(
                "--eval-interval needs a synchronous run (--async-policy-lag 0): the engine is busy "
                "generating ahead in async mode"
            )
        if d.prompt_template is not None and "{prompt}" not in d.prompt_template:
            raise ConfigError(f"--prompt-template {d.prompt_template!r} has no {{prompt}} placeholder")
        if d.system_prompt and not d.apply_chat_template:
            raise ConfigError(
                "--system-prompt needs --apply-chat-template (a system turn exists only in a chat template)"
            )
        try:
            parse_stop_strings(d.stop)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if lg.eval_interval and not d.eval_data and not d.prompt_data.startswith("synthetic:"):
            raise ConfigError("--eval-interval with a file prompt set needs --eval-data (held-out prompts)")
        if g.lr_warmup_steps < 0:
            raise ConfigError(f"--lr-warmup-steps {g.lr_warmup_steps} must be >= 0")
        if not 0.0 <= g.lr_min <= g.lr:
            raise ConfigError(f"--lr-min {g.lr_min} must be in [0, --lr {g.lr}]")
        if g.dynamic_sampling and g.advantage_baseline != "group":
            raise ConfigError(
                "--dynamic-sampling needs --advantage-baseline group: with the batch baseline a group "
                "of equal rewards still has a non-zero advantage"
            )
        if g.grpo_num_minibatches < 1:
            raise ConfigError(f"--grpo-num-minibatches {g.grpo_num_minibatches} must be >= 1")
        if g.grpo_group_size < 1 or g.prompts_per_step < 1:
            raise ConfigError("--grpo-group-size and --prompts-per-step must be >= 1")
        if g.micro_batch_size < 1:
            raise ConfigError("--micro-batch-size must be >= 1")
        rollouts = g.grpo_group_size * g.prompts_per_step
        if rollouts % g.grpo_num_minibatches:
            raise ConfigError(f"--grpo-num-minibatches {g.grpo_num_minibatches} does not divide the "
                              f"{rollouts} rollouts of a step (prompts-per-step x group-size)")
        if not 0 <= g.clip_eps_low < 1 or g.clip_eps_high < 0:
            raise ConfigError("--clip-eps-low must be in [0, 1) and --clip-eps-high >= 0")
        if r.rollout_top_k < -1:
            raise ConfigError(
                f"--rollout-top-k {r.rollout_top_k}: 0 or -1 is off, else the tokens kept (>= 1)"
            )
        r.rollout_top_k = max(r.rollout_top_k, 0)  # -1 = off, as SGLang, vLLM, slime and verl write it
        if r.async_policy_lag < 0:
            raise ConfigError("--async-policy-lag must be >= 0")
        if r.colocate_offload != "none" and r.async_policy_lag:
            raise ConfigError(
                f"--colocate-offload {r.colocate_offload} needs a synchronous run (--async-policy-lag 0): "
                f"with a policy lag the engine generates while the trainer trains"
            )
        try:
            from megatron_spec.rollout.config import parse_engine_kwargs

            # auto: by the GPU, at start
            parse_engine_kwargs(r.rollout_engine_kwargs, r.rollout_backend or "auto")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        unknown = set(self.logging.logger.split(",")) - {"jsonl", "tensorboard", "wandb"}
        if unknown:
            raise ConfigError(
                f"--logger {self.logging.logger}: unknown {sorted(unknown)}; choose from jsonl, tensorboard, "
                f"wandb (comma-separated)"
            )
        if r.rollout_mem_fraction_static is not None and not 0 < r.rollout_mem_fraction_static < 1:
            raise ConfigError(
                f"--rollout-mem-fraction-static must be in (0, 1), got {r.rollout_mem_fraction_static}"
            )
        if r.rollout_weight_dtype == "fp8" and r.rollout_dtype == "float32" and r.rollout_backend == "sglang":
            raise ConfigError(
                "--rollout-weight-dtype fp8 with SGLang runs the FP8 kernels; set --rollout-dtype bfloat16"
            )
        if r.rollout_num_engines is not None and r.rollout_num_engines < 1:
            raise ConfigError(f"--rollout-num-engines must be >= 1, got {r.rollout_num_engines}")
        if r.rollout_tensor_parallel_size is not None and r.rollout_tensor_parallel_size < 1:
            raise ConfigError(
                f"--rollout-tensor-parallel-size must be >= 1, got {r.rollout_tensor_parallel_size}"
            )
        if r.rollout_backend in ("native", "vllm") and r.rollout_tensor_parallel_size not in (None, 1):
            raise ConfigError(
                f"--rollout-tensor-parallel-size {r.rollout_tensor_parallel_size}: the {r.rollout_backend} "
                f"engine runs on one device (1) here; use --rollout-backend sglang for engines over "
                f"several GPUs"
            )
        if r.rollout_backend == "vllm":
            from megatron_spec.rollout.vllm_protocol import check_engine_settings

            try:
                import torch

                check_engine_settings(s.spec_draft_kind, adaptive=s.spec_num_draft_tokens == "auto",
                                      history=s.spec_history, weight_dtype=r.rollout_weight_dtype,
                                      device_type="cuda" if torch.cuda.is_available() else "cpu",
                                      temperatures=[r.rollout_temperature])
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        if r.rollout_reference_check and (r.rollout_reference_prompts < 1 or r.rollout_reference_tokens < 1):
            raise ConfigError(
                f"--rollout-reference-prompts {r.rollout_reference_prompts} and --rollout-reference-tokens "
                f"{r.rollout_reference_tokens} must be >= 1"
            )
        if r.rollout_wait_timeout_s <= 0 or r.dist_timeout_s <= 0:
            raise ConfigError("--rollout-wait-timeout-s and --dist-timeout-s must be > 0")
        if self.checkpoint.save_interval < 0 or self.checkpoint.save_keep < 0:
            raise ConfigError("--save-interval and --save-keep must be >= 0")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _field_type(cls: type, f: dataclasses.Field) -> type:
    hint = typing.get_type_hints(cls)[f.name]
    return hint


_METAVARS = {int: "N", float: "X"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument group per subsystem; defaults are None so the YAML file can fill in. Positional
    ``section.key=value`` overrides (NeMo-RL's and verl's form) come last and win over flags and file."""
    parser.add_argument(
        "--config",
        default=None,
        help="YAML file with values for any of the flags below: sections "
        "(model, data, rollout, spec, grpo, checkpoint, logging) of keys with or without their "
        "section's prefix (rollout: {max_batch_size: 16} or {rollout_max_batch_size: 16})",
    )
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="overrides after the flags, e.g. grpo.lr=1e-5 rollout.max_new_tokens=512 (values read "
        "as YAML, then as the key's type)",
    )
    for group_name, cls in GROUPS.items():
        group = parser.add_argument_group(group_name)
        for f in dataclasses.fields(cls):
            kind = _field_type(cls, f)
            kw: dict[str, Any] = {
                "dest": f"{group_name}.{f.name}",
                "default": None,
                "help": f"{f.metadata['help']} (default: {default_text(f.name, f.default)})",
            }
            if kind is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = f.metadata.get("parse") or {int: int, float: float}.get(kind, str)
                if "choices" in f.metadata:
                    kw["choices"] = f.metadata["choices"]
                else:
                    kw["metavar"] = _METAVARS.get(kind, "K" if f.metadata.get("parse") else "STR")
            group.add_argument(_flag(f), **kw)


def _resolve_key(group: str, key: str, where: str) -> dataclasses.Field:
    """The field ``key`` names in ``group``: its name, or its name without the section's prefix
    (``max_batch_size`` in ``rollout``); an unknown key is a :class:`ConfigError` with the closest names."""
    import difflib

    fields = {f.name: f for f in dataclasses.fields(GROUPS[group])}
    for prefix in ("", f"{group}_"):
        if prefix + key in fields:
            return fields[prefix + key]
    short = {n.removeprefix(f"{group}_"): n for n in fields}
    near = difflib.get_close_matches(key, list(fields) + list(short), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(dict.fromkeys(short.get(n, n) for n in near))}?" if near else ""
    raise ConfigError(f"{where}: unknown key {group}.{key}{hint}")


def _resolve_section(name: str, where: str) -> str:
    import difflib

    if name in GROUPS:
        return name
    near = difflib.get_close_matches(name, list(GROUPS), n=1)
    hint = f"; did you mean {near[0]}?" if near else f"; expected one of {', '.join(GROUPS)}"
    raise ConfigError(f"{where}: unknown section {name!r}{hint}")


def _set(values: dict[str, dict[str, Any]], group: str, key: str, value: Any, where: str) -> None:
    group = _resolve_section(group, where)
    f = _resolve_key(group, key, where)
    values[group][f.name] = coerce(group, f, _field_type(GROUPS[group], f), value, where)


def parse_override(text: str) -> tuple[str, str, Any]:
    """``section.key=value`` as ``(section, key, value)``, the value read as YAML (``1e-5`` stays text for
    :func:`megatron_spec.config_values.coerce`)."""
    path, sep, raw = text.partition("=")
    group, dot, key = path.strip().partition(".")
    if not sep or not dot or not group or not key:
        raise ConfigError(f"override {text!r}: expected section.key=value (e.g. grpo.lr=1e-5)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return group, key, value


def from_args(args: argparse.Namespace) -> RunConfig:
    """RunConfig from parsed flags, with ``--config`` YAML values under the flags and ``section.key=value``
    overrides over both."""
    values: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    if getattr(args, "config", None):
        if not os.path.isfile(args.config):
            raise ConfigError(f"--config {args.config}: no such file")
        with open(args.config) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:
                raise ConfigError(f"--config {args.config} is not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ConfigError(
                f"--config {args.config}: expected sections {sorted(GROUPS)}, got {type(data).__name__}"
            )
        for group_name, body in data.items():
            if body is not None and not isinstance(body, dict):
                raise ConfigError(f"{args.config}: section {group_name!r} must hold keys, got {body!r}")
            for key, value in (body or {}).items():
                _set(values, str(group_name), str(key), value, args.config)
    for key, value in vars(args).items():
        if "." in key and value is not None:
            group_name, name = key.split(".", 1)
            values[group_name][name] = value
    for text in getattr(args, "overrides", None) or ():
        _set(values, *parse_override(text), f"override {text}")
    return RunConfig(**{g: GROUPS[g](**values[g]) for g in GROUPS}).validate()
