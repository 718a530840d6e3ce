"""Drafters for speculative decoding: the EAGLE-3 head and its ModelOpt checkpoint I/O.

- :mod:`.eagle3_config`: :class:`Eagle3Config` (parsed from an export's config.json, validated
  against the target), ``d2t`` checks.
- :mod:`.eagle3`: :class:`Eagle3Head` (engine mode over the native KV cache and a full-sequence
  mode for training), the aux-feature convention, the TTT attention mask.
- :mod:`.rope`: default / YaRN RoPE as the serving engine applies it to an exported draft.
- :mod:`.modelopt_io`: :func:`load_eagle3` / :func:`save_eagle3` for the format
  ``export_speculative_decoding`` writes.
- :mod:`.modelopt_train`: :func:`train_and_export_eagle3`, ModelOpt's own training + export
  (imports ModelOpt and transformers only when called).
- :mod:`.trainer` / :mod:`.optim` / :mod:`.losses`: online EAGLE-3 training on the capture cache
  (``Eagle3Trainer``, ``build_draft_trainer``; see docs/draft_training.md).
- :mod:`.mtp` / :mod:`.mtp_head` / :mod:`.mtp_io`: MTP heads trained beside the policy on detached
  states (megatron-core's layers), their engine twin and their files.
"""

from __future__ import annotations

from typing import Any

from megatron_spec.draft.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    Eagle3Output,
    default_aux_layer_ids,
    select_aux_hidden_states,
    ttt_attention_mask,
)
from megatron_spec.draft.modelopt_io import load_eagle3, read_eagle3_config, save_eagle3

__all__ = [
    "Eagle3Config", "Eagle3Head", "Eagle3Output", "Eagle3TrainResult", "default_aux_layer_ids", "load_eagle3",
    "read_eagle3_config", "save_eagle3", "select_aux_hidden_states", "train_and_export_eagle3",
    "ttt_attention_mask",
]


def __getattr__(name: str) -> Any:
    if name in ("train_and_export_eagle3", "Eagle3TrainResult"):
        from megatron_spec.draft import modelopt_train

        return getattr(modelopt_train, name)
    raise AttributeError(f"module 'megatron_spec.draft' has no attribute {name!r}")
