"""The trainer side of a GRPO run's configuration: the policy model, the prompts and reward, the GRPO
update, checkpoints and logging, one section each.

Each section checks its own fields (:meth:`~megatron_spec.config.section.Section.check`); the rules between
sections are :func:`megatron_spec.config.run.check_across_sections`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_spec.config.section import Section, flag, json_object_text, setting
from megatron_spec.config_values import ConfigError, parse_stop_strings


@dataclass
class ModelConfig(Section):
    hf_checkpoint: str = setting("hf_checkpoint")
    tensor_model_parallel_size: int = flag(
        1, "tensor-parallel size (divides the world size; the rest is data parallel)"
    )
    make_vocab_size_divisible_by: int = flag(
        128, "pad the vocabulary to a multiple of this times TP (Megatron-LM)"
    )
    bf16: bool = flag(False, "train the policy in bfloat16 (default float32)")
    seed: int = setting("seed")


@dataclass
class DataConfig(Section):
    prompt_data: str = flag(None, "prompt set: a JSONL or Parquet file, a directory a datasets library wrote "
                            "(save_to_disk) or holding JSONL/Parquet files, or 'synthetic:<task>' (see "
                            "megatron_spec.rl.synthetic_tasks)")
    prompt_key: str = flag("prompt", "column holding the prompt text")
    answer_key: str = flag("answer", "column holding the reference answer passed to the reward")
    apply_chat_template: bool = flag(
        False,
        "render each prompt as a user turn with the tokenizer's chat template "
        "(add_generation_prompt; the template writes BOS and the other special "
        "tokens); off: the prompt is tokenised with the tokenizer's own special "
        "tokens (BOS where it adds one)",
    )
    apply_chat_template_kwargs: str = flag(
        None,
        "the chat template's own variables as a JSON object (a mapping in "
        "YAML), e.g. '{\"enable_thinking\": false}' for Qwen3",
        parse=lambda v: json_object_text(v, "--apply-chat-template-kwargs"),
    )
    system_prompt: str = flag(None, "system turn put before each prompt (needs --apply-chat-template)")
    prompt_template: str = flag(None, "text each prompt becomes, with {prompt} standing for the prompt "
                                "column, before the chat template: e.g. '{prompt} Answer True or False.'")
    stop: str = flag(
        None,
        "stop string(s) ending a response after the EOS ids of config.json and "
        "generation_config.json: one string or a JSON list; the response keeps the stop string",
    )
    reward: str = flag(
        "synthetic",
        "reward function: a registered name (synthetic, math, exact), 'module:function' (the "
        "working directory importable) or 'path/to/file.py:function'",
    )
    num_synthetic_prompts: int = flag(2048, "prompts generated for a synthetic task")
    max_prompt_length: int = flag(256, "longest prompt in tokens (see --overlong-prompts)")
    overlong_prompts: str = flag(
        "filter",
        "prompts longer than --max-prompt-length: filter (dropped when the data "
        "loads, their count printed, as verl and slime do) or error",
        ("filter", "error"),
    )
    eval_data: str = flag(
        None,
        "held-out prompts for --eval-interval: a file or 'synthetic:<task>' (default: the "
        "synthetic training task drawn with another seed)",
    )
    eval_prompts: int = flag(128, "prompts per held-out evaluation (the first N of --eval-data)")


    def check(self) -> None:
        if self.prompt_template is not None and "{prompt}" not in self.prompt_template:
            raise ConfigError(f"--prompt-template {self.prompt_template!r} has no {{prompt}} placeholder")
        if self.system_prompt and not self.apply_chat_template:
            raise ConfigError(
                "--system-prompt needs --apply-chat-template (a system turn exists only in a chat template)"
            )
        try:
            parse_stop_strings(self.stop)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        if self.eval_prompts < 1:
            raise ConfigError(f"--eval-prompts {self.eval_prompts} must be >= 1")


@dataclass
class GRPOConfig(Section):
    train_iters: int = flag(20, "RL steps")
    prompts_per_step: int = flag(8, "prompts sampled per step")
    grpo_group_size: int = flag(8, "G: samples per prompt")
    micro_batch_size: int = flag(8, "sequences per forward/backward (gradient accumulation over the rest)")
    grpo_num_minibatches: int = flag(1, "optimizer steps per rollout batch (1 = strictly on-policy)")
    lr: float = flag(1e-5, "policy learning rate (AdamW)")
    lr_warmup_steps: int = flag(0, "linear learning-rate warm-up over the first N RL steps (AdamW's first "
                                "updates move every parameter by about lr, whatever its gradient's noise)")
    lr_decay_style: str = flag(
        "constant",
        "learning rate after the warm-up, over the remaining --train-iters steps, down to --lr-min",
        ("constant", "cosine", "linear"),
    )
    lr_min: float = flag(0.0, "learning rate a cosine or linear decay reaches at step --train-iters")
    weight_decay: float = flag(0.0, "AdamW weight decay (matrices only: norms and biases get none)")
    clip_grad: float = flag(1.0, "policy gradient-norm clip (0 = off)")
    clip_eps_low: float = flag(0.2, "ratio clip below: 1 - eps_low")
    clip_eps_high: float = flag(0.28, "ratio clip above: 1 + eps_high")
    kl_coef: float = flag(
        0.0, "coefficient of the k3 KL estimate to a frozen reference (0 = no reference model)"
    )
    loss_agg: str = flag("token", "loss aggregation", ("token", "sequence"))
    advantage_baseline: str = flag("group", "baseline of the advantage", ("group", "batch"))
    advantage_normalize_std: bool = flag(True, "divide advantages by the group (or batch) std")
    tis_cap: float = flag(
        0.0,
        "truncated importance-sampling correction by engine/trainer ratio, cap C (0 = off); "
        "the weight multiplies the policy-gradient and the KL term",
    )
    dynamic_sampling: bool = flag(
        False,
        "drop groups whose rewards are all equal before training (DAPO's dynamic "
        "sampling: their advantages are 0); the step trains on fewer rollouts, "
        "train/samples_trained says how many",
    )
    truncated_responses: str = flag(
        "keep",
        "responses cut at --rollout-max-new-tokens: keep (train on them as "
        "scored) or drop (no loss on them; they still count in their group's "
        "baseline)",
        ("keep", "drop"),
    )


    def check(self) -> None:
        if self.lr_warmup_steps < 0:
            raise ConfigError(f"--lr-warmup-steps {self.lr_warmup_steps} must be >= 0")
        if not 0.0 <= self.lr_min <= self.lr:
            raise ConfigError(f"--lr-min {self.lr_min} must be in [0, --lr {self.lr}]")
        if self.dynamic_sampling and self.advantage_baseline != "group":
            raise ConfigError(
                "--dynamic-sampling needs --advantage-baseline group: with the batch baseline a group "
                "of equal rewards still has a non-zero advantage"
            )
        if self.grpo_num_minibatches < 1:
            raise ConfigError(f"--grpo-num-minibatches {self.grpo_num_minibatches} must be >= 1")
        if self.grpo_group_size < 1 or self.prompts_per_step < 1:
            raise ConfigError("--grpo-group-size and --prompts-per-step must be >= 1")
        if self.micro_batch_size < 1:
            raise ConfigError("--micro-batch-size must be >= 1")
        rollouts = self.grpo_group_size * self.prompts_per_step
        if rollouts % self.grpo_num_minibatches:
            raise ConfigError(f"--grpo-num-minibatches {self.grpo_num_minibatches} does not divide the "
                              f"{rollouts} rollouts of a step (prompts-per-step x group-size)")
        if not 0 <= self.clip_eps_low < 1 or self.clip_eps_high < 0:
            raise ConfigError("--clip-eps-low must be in [0, 1) and --clip-eps-high >= 0")


@dataclass
class CheckpointConfig(Section):
    save: str = flag(
        None,
        "the run's folder: checkpoints, metrics, exports (default runs/grpo-<date>-<time>); a run "
        "started again with the same --save resumes from its latest complete checkpoint",
    )
    load: str = flag(None, "resume from this checkpoint directory (latest iteration)")
    resume: bool = flag(
        True,
        "resume from the latest complete checkpoint in --save when it has one; --no-resume "
        "starts over there, removing the previous run's checkpoints, metrics and exports",
    )
    save_interval: int = flag(
        10, "save a checkpoint every N steps, and after the last (0 = only after the last)"
    )
    save_keep: int = flag(
        0, "keep the newest N checkpoints, removing older ones after each save (0 = keep all)"
    )
    save_hf: bool = flag(
        True,
        "at the end of the run write the trained policy as an HF folder, <run>/hf/policy, "
        "beside its draft (<run>/hf/eagle3, mtp or draft_model): what transformers, vLLM, "
        "SGLang and lm-eval load (docs/serving_exports.md)",
    )


    def check(self) -> None:
        if self.save_interval < 0 or self.save_keep < 0:
            raise ConfigError("--save-interval and --save-keep must be >= 0")


@dataclass
class LoggingConfig(Section):
    logger: str = flag(
        "jsonl,tensorboard",
        "where the metrics go, comma-separated: jsonl (always written: resume and the "
        "report read it), tensorboard, wandb (W&B; WANDB_MODE=offline needs no network)",
    )
    wandb_project: str = flag("megatron-spec", "W&B project (--logger wandb)")
    wandb_name: str = flag(
        None, "W&B run name (default: the run folder's name; a resumed run continues its W&B run)"
    )
    metrics_path: str = flag(None, "metrics JSONL (default <save>/metrics.jsonl)")
    tensorboard_dir: str = flag(None, "TensorBoard directory (default <save>/tensorboard; 'none' = off)")
    log_interval: int = flag(1, "progress line every N steps (0: none)")
    quiet: bool = flag(False, "no progress line")
    dump_rollouts: bool = flag(False, "write every step's rollouts to <save>/rollouts/step_NNNNNN.jsonl")
    eval_interval: int = flag(
        0,
        "every N steps and after the last, the mean reward of the current policy on held-out "
        "prompts, one sample each with the rollout sampling settings and a fixed seed "
        "(eval/reward; 0 = off; synchronous runs only)",
    )

    def check(self) -> None:
        if self.log_interval < 0:
            raise ConfigError(f"--log-interval {self.log_interval} must be >= 0 (0: no progress line)")
        if self.eval_interval < 0:
            raise ConfigError(f"--eval-interval {self.eval_interval} must be >= 0")
        unknown = set(self.logger.split(",")) - {"jsonl", "tensorboard", "wandb"}
        if unknown:
            raise ConfigError(
                f"--logger {self.logger}: unknown {sorted(unknown)}; choose from jsonl, tensorboard, "
                f"wandb (comma-separated)"
            )
