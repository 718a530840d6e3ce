"""Configuration of a GRPO run: one dataclass per subsystem, the flags generated from them.

:class:`RunConfig` (:mod:`.run`) holds the sections: the trainer's (:mod:`.train_sections`: model, data,
grpo, checkpoint, logging) and the rollouts' (:mod:`.rollout_sections`: rollout, draft, spec). Each section
checks its own fields when made; the rules between sections are :func:`.run.check_across_sections`; the
flags, the ``--config`` YAML file and ``section.key=value`` overrides are read by :mod:`.flags`. The resolved
:class:`RunConfig` is printed once at start and saved with the run (``config.yaml``).

Every check raises :class:`ConfigError` (a ``ValueError``) naming the flags involved; the launcher prints it
as one ``error:`` line and exits 2, where a real crash keeps its traceback.
"""

from megatron_spec.config.flags import add_arguments, from_args, parse_override
from megatron_spec.config.rollout_sections import DraftConfig, RolloutConfig, SpecConfig
from megatron_spec.config.run import SECTIONS, RunConfig, check_across_sections
from megatron_spec.config.section import Section
from megatron_spec.config.train_sections import (
    CheckpointConfig,
    DataConfig,
    GRPOConfig,
    LoggingConfig,
    ModelConfig,
)
from megatron_spec.config_values import ConfigError, parse_stop_strings

__all__ = [
    "SECTIONS",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "DraftConfig",
    "GRPOConfig",
    "LoggingConfig",
    "ModelConfig",
    "RolloutConfig",
    "RunConfig",
    "Section",
    "SpecConfig",
    "add_arguments",
    "check_across_sections",
    "from_args",
    "parse_override",
    "parse_stop_strings",
]
