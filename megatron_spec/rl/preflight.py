"""The checks of a GRPO run's inputs that need no process group, run before ``torch.distributed``.

The launcher calls :func:`check_inputs` right after parsing its flags, on every rank before
distributed initialisation, so a user error (a missing ``--hf-checkpoint`` directory, a draft for
another model, a missing prompt file, a tensor-parallel size the heads do not divide) is one
:class:`~megatron_spec.config.ConfigError` that rank 0 prints as one ``error:`` line, and not a
traceback per rank from deep inside the trainer or the engine process.

It reads ``config.json`` files only (the policy's, the draft's) and imports the reward function;
it loads no weights and knows nothing about training. The trainer and the engine keep their own
checks (they are also used as libraries); this only moves the first failure earlier.

:func:`openmp_wait_policy` is the other thing the launcher must decide before torch loads OpenMP.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from megatron_spec.config import ConfigError, RunConfig


def check_inputs(cfg: RunConfig, world_size: int = 1) -> None:
    """Raise :class:`ConfigError` naming the flag and the file when an input of ``cfg`` is unusable.

    Args:
        cfg: the validated run configuration (``from_args``).
        world_size: processes in the run (torchrun's ``WORLD_SIZE``), for the tensor-parallel check.
    """
    from megatron_spec.models.hf_config import DecoderConfig

    m, d, s = cfg.model, cfg.data, cfg.draft
    from megatron_spec.models.fetch import ModelNotFoundError, is_model_name, resolve_model

    if is_model_name(m.hf_checkpoint):  # smollm2, or a Hub id (Org/Name) read from huggingface_hub's cache
        try:  # several ranks must not convert the same model at once: only a single process fetches
            m.hf_checkpoint = resolve_model(m.hf_checkpoint, fetch=world_size == 1)
        except ModelNotFoundError as exc:
            raise ConfigError(f"--hf-checkpoint {exc}") from None
    if not os.path.isdir(m.hf_checkpoint):
        raise ConfigError(
            f"--hf-checkpoint {m.hf_checkpoint}: no such directory (an HF checkpoint directory)"
        )
    try:
        target = DecoderConfig.from_pretrained(m.hf_checkpoint)
    except (FileNotFoundError, ValueError) as exc:  # no config.json, an architecture we do not convert
        raise ConfigError(f"--hf-checkpoint {m.hf_checkpoint}: {exc}") from exc
    tp = m.tensor_model_parallel_size
    if tp < 1 or world_size % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the world size {world_size} "
                          f"(torchrun --nproc-per-node)")
    try:
        target.check_tensor_parallel(tp)
    except ValueError as exc:
        raise ConfigError(f"--tensor-model-parallel-size: {exc}") from exc

    from megatron_spec.rl.data import hub_snapshot, is_hub_dataset

    for flag, spec in (("--prompt-data", d.prompt_data), ("--eval-data", d.eval_data)):
        if not spec:
            continue
        if spec.startswith("synthetic:"):
            from megatron_spec.rl.synthetic_tasks import TASKS

            if spec.split(":", 1)[1] not in TASKS:
                raise ConfigError(f"{flag} {spec}: unknown synthetic task; expected one of "
                                  f"{[f'synthetic:{t}' for t in sorted(TASKS)]}")
        elif is_hub_dataset(spec):
            try:
                hub_snapshot(spec)
            except FileNotFoundError as exc:
                raise ConfigError(f"{flag} {str(exc).removeprefix('prompt data ')}") from None
        elif not (os.path.isfile(spec) or os.path.isdir(spec)):  # a folder: load_prompts reads its files
            raise ConfigError(
                f"{flag} {spec}: no such file (a JSONL or Parquet file, a folder of them, a Hub dataset "
                f"name org/name[:config][@split] in the local cache, or synthetic:<task>)"
            )

    from megatron_spec.rl.rewards import get_reward

    try:
        get_reward(d.reward)
    except ValueError as exc:
        raise ConfigError(f"--reward: {exc}") from exc

    if cfg.checkpoint.load and not os.path.isdir(cfg.checkpoint.load):
        raise ConfigError(f"--load {cfg.checkpoint.load}: no such directory")
    from megatron_spec.rl.checkpoint import check_run_folder_free, plan_resume

    # rank 0 (the others may find their own run's rank 0 holding it)
    if int(os.environ.get("RANK", "0")) == 0:
        check_run_folder_free(cfg.checkpoint.save)  # a live run there: one line, before its files are judged

    plan_resume(cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.resume)  # a used folder: one line

    if s.spec_draft_kind in ("eagle3", "model", "mtp") and s.spec_draft_path:
        _check_draft(s.spec_draft_kind, s.spec_draft_path, target)
    _check_backend(cfg.rollout.rollout_backend, cfg.rollout.rollout_vllm_python)


def _check_backend(backend: str | None, vllm_python: str | None = None) -> None:
    """SGLang, asked for or the default on a GPU, imports here; vLLM's environment exists; else one line
    naming the way out."""
    from megatron_spec.rollout import default_backend

    chosen = backend or default_backend()
    if chosen == "vllm":
        from megatron_spec.rollout.vllm_backend import vllm_python as find

        try:
            find(vllm_python)
        except FileNotFoundError as exc:
            raise ConfigError(str(exc)) from None
        return
    if chosen != "sglang":
        return
    try:
        import sglang  # noqa: F401 (imported to learn whether it is installed)
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        how = (
            "--rollout-backend sglang" if backend else "the rollout backend defaults to sglang on a GPU, but"
        )
        raise ConfigError(
            f"{how} sglang does not import here ({type(exc).__name__}: {str(exc).splitlines()[0]}); "
            f"install it (requirements/gpu.txt) or pass --rollout-backend native"
        ) from None


def _check_draft(kind: str, path: str, target) -> None:
    """The draft's ``config.json`` fits the target (hidden size, vocabulary, layers), as the engine
    would find when it loads the draft, minutes later and in another process."""
    from megatron_spec.models.hf_config import DecoderConfig

    if not os.path.isdir(path):
        raise ConfigError(f"--spec-draft-path {path}: no such directory")
    try:
        if kind == "eagle3":
            from megatron_spec.draft.modelopt_io import read_eagle3_config

            read_eagle3_config(path, target)
        elif kind == "model":
            draft = DecoderConfig.from_pretrained(path)
            if draft.vocab_size != target.vocab_size:
                raise ValueError(f"draft model {path} has vocab_size {draft.vocab_size}, the target "
                                 f"{target.vocab_size}: a draft model must share the target's tokenizer")
        else:
            from megatron_spec.draft.mtp_io import read_mtp_config

            read_mtp_config(path, target)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"--spec-draft-path ({kind}): {exc}") from exc


def openmp_wait_policy(cfg: RunConfig, env: Mapping[str, str]) -> str | None:
    """``PASSIVE`` where the native engine generates while the trainer trains (``--async-policy-lag`` > 0)
    and the user set no ``OMP_WAIT_POLICY``; else None (OpenMP's default). Reads no file and imports
    nothing: the launcher calls it before anything loads torch.

    Trainer and engine then compute at the same time on the same cores, and libgomp's threads, which
    spin for a while before they sleep when they wait, take the cores from the other process's threads:
    on a 2-core CPU the demo's GRPO loop ran at 6.0-6.5 s a step asynchronous against 3.4 s synchronous,
    and at 3.4-3.8 s asynchronous with the passive policy (docs/benchmark_log.md, "OpenMP's wait policy").
    A process alone on its cores runs faster spinning (the engine decodes up to 2x faster), so the
    synchronous loop keeps the default. libgomp reads the variable once, when torch loads it: the
    launcher sets it before importing torch, and the processes it starts inherit it."""
    if "OMP_WAIT_POLICY" in env:
        return None
    # (the backend left to its default counts as native: telling a GPU would import torch; with SGLang on a
    # GPU the trainer's few CPU threads sleeping cost little)
    if cfg.rollout.async_policy_lag > 0 and cfg.rollout.rollout_backend in (None, "native"):
        return "PASSIVE"
    return None
