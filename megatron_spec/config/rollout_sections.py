"""The rollout side of a GRPO run's configuration: the engines (:class:`RolloutConfig`), the draft
(:class:`DraftConfig`) and how the rollouts speculate with it (:class:`SpecConfig`).

Each section checks its own fields (:meth:`~megatron_spec.config.section.Section.check`); the rules between
sections, such as the speculation settings against the engine's backend, are
:func:`megatron_spec.config.run.check_across_sections`. The engine and sampling fields are declared from the
settings' one table, :data:`megatron_spec.rollout.settings.SETTINGS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_spec.config.section import Section, flag, setting
from megatron_spec.config_values import ConfigError
from megatron_spec.rollout.settings import device_default, parse_num_draft_tokens


@dataclass
class RolloutConfig(Section):
    rollout_backend: str = setting("rollout_backend")
    rollout_dtype: str = setting("rollout_dtype")
    rollout_weight_dtype: str = flag(
        "fp32",
        "dtype of streamed weights (fp8: block-FP8 target, draft unquantised)",
        ("fp32", "bf16", "fp8"),
    )
    rollout_max_batch_size: int = setting("rollout_max_batch_size")
    rollout_max_new_tokens: int = setting("rollout_max_new_tokens")
    rollout_temperature: float = setting("rollout_temperature")
    rollout_top_p: float = setting("rollout_top_p")
    rollout_top_k: int = setting("rollout_top_k")
    rollout_min_p: float = setting("rollout_min_p")
    rollout_num_threads: int = setting("rollout_num_threads")
    rollout_compile: bool = setting("rollout_compile")
    rollout_share_prefix: bool = setting("rollout_share_prefix")
    rollout_vllm_python: str = setting("rollout_vllm_python")
    rollout_startup_timeout_s: float = setting("rollout_startup_timeout_s")
    rollout_call_timeout_s: float = setting("rollout_call_timeout_s")
    rollout_bucket_mb: int = flag(64, "weight-streaming bucket size in MiB")
    rollout_reference_check: bool = flag(
        False,
        "start the native engine beside the rollout engine (plain decoding, "
        "the same weights streamed to it) and after every weight sync compare "
        "both engines' greedy tokens on the first --rollout-reference-prompts "
        "training prompts; a difference stops the run naming the prompt and "
        "position (health/reference_*, docs/metrics.md). Costs a second copy "
        "of the weights and a second sync per step",
    )
    rollout_reference_prompts: int = flag(4, "prompts of --rollout-reference-check")
    rollout_reference_tokens: int = flag(32, "greedy tokens per prompt of --rollout-reference-check")
    async_policy_lag: int = flag(
        0,
        "policy lag L: the engines generate the next batch while the trainer trains this "
        "one, and batch t comes from policy version max(0, t-L); one batch is in flight, "
        "so L=1 gives all the overlap and L>1 only older weights (0 = synchronous)",
    )
    rollout_release_memory: bool = flag(
        True, "release engine memory (KV cache, weights) while the trainer trains"
    )
    rollout_engine_kwargs: str = flag(
        None,
        "JSON object of the rollout engine's own arguments, passed through: SGLang "
        "ServerArgs fields (checked by the lossless guard), vLLM LLM(...) keywords, "
        "e.g. '{\"chunked_prefill_size\": 8192}'; not those our flags set",
    )
    rollout_mem_fraction_static: float = flag(
        None,
        "SGLang's mem_fraction_static: the share of GPU memory its weights "
        "and KV cache take while it generates (default: SGLang's choice, "
        "sized for a GPU of its own; colocated, see docs/memory_plan.md)",
    )
    colocate_offload: str = flag(
        "none",
        "what the trainer moves to host memory while the colocated engine generates: "
        "optimizer (fp32 main weights, AdamW moments, gradient buffers) or all (and "
        "the weights); a no-op on CPU (docs/memory_plan.md)",
        ("none", "optimizer", "all"),
    )
    engine_restarts: int = flag(2, "restarts of a dead engine per step before the run fails")
    rollout_num_engines: int = flag(
        None,
        "rollout engines; engine e is owned by the first rank of the e-th block of "
        "world/N ranks and serves a share of each step's prompts (default: one per "
        "node)",
    )
    rollout_tensor_parallel_size: int = flag(
        None,
        "GPUs (ranks) per engine: SGLang's tp_size (default: every rank of "
        "the engine's block with SGLang; the native engine runs 1)",
    )
    rollout_wait_timeout_s: float = flag(
        10800.0,
        "longest a rank waits for the engines' rollouts (the long-timeout "
        "group around generation); exceeded: the run stops naming the engine",
    )
    dist_timeout_s: float = flag(
        600.0, "timeout of the training collectives (gradient reduction, weight gathers)"
    )

    def __post_init__(self) -> None:
        if self.rollout_max_batch_size is None:  # not given: sized by the device
            self.rollout_max_batch_size = device_default("rollout_max_batch_size")
        if self.rollout_max_new_tokens is None:
            self.rollout_max_new_tokens = device_default("rollout_max_new_tokens")
        super().__post_init__()

    def check(self) -> None:
        self._check_sampling_and_sizes()
        self._check_engines()

    def _check_sampling_and_sizes(self) -> None:
        if self.rollout_top_k < -1:
            raise ConfigError(
                f"--rollout-top-k {self.rollout_top_k}: 0 or -1 is off, else the tokens kept (>= 1)"
            )
        self.rollout_top_k = max(self.rollout_top_k, 0)  # -1 = off, as SGLang, vLLM, slime and verl write it
        if self.async_policy_lag < 0:
            raise ConfigError("--async-policy-lag must be >= 0")
        if self.colocate_offload != "none" and self.async_policy_lag:
            raise ConfigError(
                f"--colocate-offload {self.colocate_offload} needs a synchronous run (--async-policy-lag 0): "
                f"with a policy lag the engine generates while the trainer trains"
            )
        if self.rollout_mem_fraction_static is not None and not 0 < self.rollout_mem_fraction_static < 1:
            raise ConfigError(
                f"--rollout-mem-fraction-static must be in (0, 1), got {self.rollout_mem_fraction_static}"
            )
        prompts, tokens = self.rollout_reference_prompts, self.rollout_reference_tokens
        if self.rollout_reference_check and (prompts < 1 or tokens < 1):
            raise ConfigError(
                f"--rollout-reference-prompts {prompts} and --rollout-reference-tokens {tokens} must be >= 1"
            )
        if self.rollout_wait_timeout_s <= 0 or self.dist_timeout_s <= 0:
            raise ConfigError("--rollout-wait-timeout-s and --dist-timeout-s must be > 0")

    def _check_engines(self) -> None:
        from megatron_spec.rollout.config import parse_engine_kwargs

        try:  # a backend of None is chosen by the GPU at start: "auto" here
            parse_engine_kwargs(self.rollout_engine_kwargs, self.rollout_backend or "auto")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        fp8_in_fp32 = self.rollout_weight_dtype == "fp8" and self.rollout_dtype == "float32"
        if fp8_in_fp32 and self.rollout_backend == "sglang":
            raise ConfigError(
                "--rollout-weight-dtype fp8 with SGLang runs the FP8 kernels; set --rollout-dtype bfloat16"
            )
        if self.rollout_num_engines is not None and self.rollout_num_engines < 1:
            raise ConfigError(f"--rollout-num-engines must be >= 1, got {self.rollout_num_engines}")
        tp = self.rollout_tensor_parallel_size
        if tp is not None and tp < 1:
            raise ConfigError(f"--rollout-tensor-parallel-size must be >= 1, got {tp}")
        if self.rollout_backend in ("native", "vllm") and tp not in (None, 1):
            raise ConfigError(
                f"--rollout-tensor-parallel-size {tp}: the {self.rollout_backend} "
                f"engine runs on one device (1) here; use --rollout-backend sglang for engines over "
                f"several GPUs"
            )


@dataclass
class DraftConfig(Section):
    """The draft that proposes tokens: its kind, its weights and how it trains online."""

    spec_draft_kind: str = setting("spec_draft_kind")
    spec_draft_path: str = setting("spec_draft_path")
    spec_draft_bf16: bool = setting("spec_draft_bf16")
    spec_online_draft_training: bool = flag(
        False, "train the EAGLE-3 draft online from the verifier's hidden states"
    )
    spec_draft_ttt_steps: int = flag(3, "training-time-test unroll of the online draft trainer")
    spec_draft_lr: float = flag(
        3e-4, "online draft learning rate (1e-3 shook a converged draft: docs/draft_training.md)"
    )
    spec_draft_tv_weight: float = flag(
        0.0,
        "add this weight times the total variation 1 - sum min(p, q) to the online "
        "EAGLE-3 draft's loss: trains for acceptance (docs/draft_training.md)",
    )
    spec_mtp_num_layers: int = setting("spec_mtp_num_layers")

    def check(self) -> None:
        kind, online, tv = self.spec_draft_kind, self.spec_online_draft_training, self.spec_draft_tv_weight
        if online and kind not in ("eagle3", "mtp"):
            raise ConfigError("--spec-online-draft-training needs --spec-draft-kind eagle3 or mtp")
        if kind == "mtp" and not online and not self.spec_draft_path:
            raise ConfigError(
                "--spec-draft-kind mtp needs --spec-online-draft-training (heads trained beside the "
                "policy) or --spec-draft-path (an MTP export)"
            )
        if not (tv >= 0 and math.isfinite(tv)):
            raise ConfigError(f"--spec-draft-tv-weight {tv} must be >= 0 and finite")
        if tv and (kind != "eagle3" or not online):
            raise ConfigError(
                "--spec-draft-tv-weight trains the EAGLE-3 draft online: it needs --spec-draft-kind "
                "eagle3 and --spec-online-draft-training"
            )


@dataclass
class SpecConfig(Section):
    """How the rollouts speculate with the draft: tokens per step, the history drafter, the watchdog."""

    spec_num_draft_tokens: int | str = setting("spec_num_draft_tokens")
    spec_max_draft_tokens: int = setting("spec_max_draft_tokens")
    spec_history: bool = setting("spec_history")
    spec_history_live: bool = setting("spec_history_live")
    spec_history_max_draft_tokens: int = setting("spec_history_max_draft_tokens")
    spec_history_tree: str = setting("spec_history_tree")
    spec_trace: str | None = setting("spec_trace")
    spec_watchdog_steps: int = flag(
        3,
        "steps of acceptance ~1 before the collapse watchdog acts (0 = off); a sudden "
        "collapse from healthy acceptance acts on its first step",
    )
    spec_watchdog_fallback: bool = flag(False, "on acceptance collapse fall back to autoregressive decoding")

    @property
    def spec_k_max(self) -> int:
        """Tokens drafted per step at most (the fixed k, or --spec-max-draft-tokens with auto)."""
        return (
            self.spec_max_draft_tokens
            if self.spec_num_draft_tokens == "auto"
            else int(self.spec_num_draft_tokens)
        )

    def check(self) -> None:
        try:  # YAML may hold "auto" or 3
            self.spec_num_draft_tokens = parse_num_draft_tokens(self.spec_num_draft_tokens)
        except ValueError as exc:
            raise ConfigError(f"--spec-num-draft-tokens: {exc}") from exc
