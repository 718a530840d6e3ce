"""A GRPO run's whole configuration, :class:`RunConfig`: its sections and the rules between them.

Each section checks its own fields (:mod:`megatron_spec.config.section`); what needs two sections at once is
:func:`check_across_sections`, the one place those rules live. It does not know flags or files: the flags and
the ``--config`` file are read by :mod:`megatron_spec.config.flags`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import yaml

from megatron_spec.config.rollout_sections import DraftConfig, RolloutConfig, SpecConfig
from megatron_spec.config.section import Section
from megatron_spec.config.train_sections import (
    CheckpointConfig,
    DataConfig,
    GRPOConfig,
    LoggingConfig,
    ModelConfig,
)
from megatron_spec.config_values import ConfigError
from megatron_spec.rollout.settings import check_speculation

SECTIONS: dict[str, type[Section]] = {
    "model": ModelConfig, "data": DataConfig, "rollout": RolloutConfig, "draft": DraftConfig,
    "spec": SpecConfig, "grpo": GRPOConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
}
"""The sections by their name: the :class:`RunConfig` field, the ``--config`` file's section and the
``section.key=value`` override's."""


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def validate(self) -> RunConfig:
        """Every section's own checks (again: a field may have changed since the section was made), then
        :func:`check_across_sections`; raises :class:`ConfigError`. Returns the config."""
        for name in SECTIONS:
            getattr(self, name).check()
        check_across_sections(self)
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def check_across_sections(cfg: RunConfig) -> None:
    """The rules between sections: what a run needs at all, the speculation settings against the draft and
    the engine's backend, held-out evaluation against the data and the policy lag. Raises
    :class:`ConfigError` naming the flags."""
    d, r, lg = cfg.data, cfg.rollout, cfg.logging
    if not cfg.model.hf_checkpoint:
        raise ConfigError("--hf-checkpoint is required")
    if not d.prompt_data:
        raise ConfigError("--prompt-data is required")
    speculation = {**dataclasses.asdict(cfg.draft), **dataclasses.asdict(cfg.spec)}
    try:
        check_speculation(speculation, r.rollout_backend)
        if r.rollout_backend == "vllm":
            _check_vllm(cfg)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if lg.eval_interval and r.async_policy_lag:
        raise ConfigError(
            "--eval-interval needs a synchronous run (--async-policy-lag 0): the engine is busy "
            "generating ahead in async mode"
        )
    if lg.eval_interval and not d.eval_data and not d.prompt_data.startswith("synthetic:"):
        raise ConfigError("--eval-interval with a file prompt set needs --eval-data (held-out prompts)")


def _check_vllm(cfg: RunConfig) -> None:
    """What vLLM's engine refuses of the draft, the speculation and the sampling (``ValueError``)."""
    import torch

    from megatron_spec.rollout.vllm_protocol import check_engine_settings

    s = cfg.spec
    check_engine_settings(
        cfg.draft.spec_draft_kind,
        adaptive=s.spec_num_draft_tokens == "auto",
        history=s.spec_history,
        weight_dtype=cfg.rollout.rollout_weight_dtype,
        device_type="cuda" if torch.cuda.is_available() else "cpu",
        temperatures=[cfg.rollout.rollout_temperature],
    )
