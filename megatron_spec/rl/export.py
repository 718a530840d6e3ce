"""The trained policy out of the run: an HF folder beside its draft.

Layout (``--save-hf`` writes it to ``<run>/hf`` at the end of a run; ``megatron-spec export-hf`` from any
complete checkpoint)::

    hf/
        policy/        config.json, model*.safetensors (huggingface_hub's writer), tokenizer files with the
                       chat template, generation_config.json: what transformers, vLLM, SGLang and
                       lm-eval load (``AutoModelForCausalLM.from_pretrained("hf/policy")``)
        eagle3/        the matching draft in the format its engines load (ModelOpt's EAGLE-3 export, the MTP
                       heads, or the draft model's HF folder), when the run had one
        export.json    what was exported: step, policy version, draft kind and version, dtype, source

The folder is written under a temporary name and renamed into place: a crash never leaves half an export
under the final name. :func:`write_hf_export` is collective over the TP group (the policy's tensors are
gathered one at a time, ``models.gpt.iter_hf_tensors``); :func:`export_checkpoint` rebuilds the policy of
a checkpoint in one process (megatron-core's dist_checkpointing reshards it to TP=1) and writes the same
folder.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch

DRAFT_FOLDERS = {"eagle3": "eagle3", "mtp": "mtp", "model": "draft_model"}
"""The draft's folder name in an export, by ``--spec-draft-kind`` (n-gram and history drafts have no
weights)."""


class ExportError(RuntimeError):
    """What was named cannot be exported (said in one line by ``export-hf``)."""


def write_hf_export(out: str, model: torch.nn.Module, source: str, *, tp_group=None, write: bool,
                    draft_kind: str = "none", draft_dir: str | None = None, dtype: torch.dtype | None = None,
                    info: dict[str, Any] | None = None) -> None:
    """Write the export folder ``out`` (module docstring). Collective over ``tp_group``: every TP rank
    calls it; ``write`` on one rank (the others only take part in the gathers).

    Args:
        model: the Megatron policy (this rank's shard).
        source: the HF checkpoint the run started from (its config, tokenizer, chat template and
            generation config are the export's; the config's dtype becomes ``dtype``).
        draft_dir: a servable draft folder to put beside the policy (``draft_kind`` names it).
        dtype: the exported weights' dtype (default: the policy's own).
        info: extra fields of ``export.json``.
    """
    from megatron_spec.models.gpt import iter_hf_tensors

    tensors = {}
    for name, t in iter_hf_tensors(model, tp_group, dtype):
        if write:
            tensors[name] = t.detach().cpu().clone()
    if not write:
        return
    from transformers import AutoTokenizer, GenerationConfig

    from megatron_spec.models.checkpoint import HFCheckpoint, atomic_folder, save_hf_checkpoint

    with atomic_folder(out) as tmp:
        config = dict(HFCheckpoint(source).config_dict)
        held = next(iter(tensors.values())).dtype
        name = str(held).removeprefix("torch.")
        config["torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"] = name
        policy = os.path.join(tmp, "policy")
        save_hf_checkpoint(policy, tensors, config, extra_files=())
        AutoTokenizer.from_pretrained(source).save_pretrained(policy)  # the chat template with it
        try:
            GenerationConfig.from_pretrained(source).save_pretrained(policy)
        except OSError:  # the source has none: transformers' defaults apply, as they did to the run
            pass
        record = {"policy": "policy", "dtype": name, "source": os.path.abspath(source), **(info or {})}
        if draft_dir is not None:
            folder = DRAFT_FOLDERS[draft_kind]
            shutil.copytree(draft_dir, os.path.join(tmp, folder))
            record["draft"] = folder
        with open(os.path.join(tmp, "export.json"), "w") as f:
            json.dump(record, f, indent=2)


def export_trained(cfg, info, actor, run_dir: str, step: int) -> None:
    """The end of a run (``--save-hf``): ``<run>/hf`` from the policy in memory (collective over TP; the
    data-parallel replicas hold the same weights, so DP rank 0's TP group writes)."""
    import sys

    from megatron_spec.models.gpt import unwrap

    s = cfg.draft
    draft_dir = None
    if actor.draft is not None:
        draft_dir = os.path.join(run_dir, "draft_export")  # exported after every update
    elif s.spec_draft_kind in DRAFT_FOLDERS and s.spec_draft_path:
        draft_dir = s.spec_draft_path
    out = os.path.join(run_dir, "hf")
    if info.dp_rank == 0:
        write_hf_export(
            out,
            unwrap(actor.model),
            cfg.model.hf_checkpoint,
            tp_group=info.tp_group,
            write=info.rank == 0,
            draft_kind=s.spec_draft_kind,
            draft_dir=draft_dir,
            info={
                "step": step,
                "policy_version": actor.policy_version,
                "draft_kind": s.spec_draft_kind,
                "draft_version": actor.draft_version,
            },
        )
    if info.rank == 0:
        print(
            f"megatron-spec: trained policy: {os.path.abspath(os.path.join(out, 'policy'))}",
            file=sys.stderr,
            flush=True,
        )


def resolve_checkpoint(path: str) -> str:
    """The iteration folder ``path`` names: itself (it holds ``trainer_state.json``), or the latest
    complete checkpoint of a ``--save`` folder."""
    from megatron_spec.rl.checkpoint import LATEST, latest_step, unreadable

    path = os.path.abspath(path)
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        it = path
    elif os.path.isfile(os.path.join(path, LATEST)):
        it = os.path.join(path, f"iter_{latest_step(path):07d}")
    elif os.path.isdir(path):
        raise ExportError(
            f"{path} holds no checkpoint (no trainer_state.json, no {LATEST}): name a run's --save "
            f"folder or one of its iter_* folders"
        )
    else:
        raise ExportError(f"no such folder: {path}")
    problem = unreadable(it)
    if problem:
        raise ExportError(problem)
    return it


def checkpoint_plan(iter_dir: str) -> dict[str, Any]:
    """What exporting ``iter_dir`` needs: its trainer state, the run's settings, the TP size, the draft."""
    with open(os.path.join(iter_dir, "trainer_state.json")) as f:
        state = json.load(f)
    cfg = state.get("config")
    if cfg is None:
        raise ExportError(f"{iter_dir}/trainer_state.json has no run settings (saved by an older version): "
                          f"export it from the run that wrote it")
    source = cfg["model"]["hf_checkpoint"]
    if not os.path.isfile(os.path.join(source, "config.json")):
        raise ExportError(
            f"the run started from {source}, which is gone: its config and tokenizer are the export's"
        )
    saved = cfg.get("draft") or cfg["spec"]  # runs saved before the draft had a section of its own
    kind = saved["spec_draft_kind"]
    draft = None
    if os.path.isdir(os.path.join(iter_dir, "draft")):
        draft = os.path.join(iter_dir, "draft")  # the online-trained draft of this step
    elif kind in DRAFT_FOLDERS and saved.get("spec_draft_path"):
        draft = saved["spec_draft_path"]  # a draft the run served unchanged
    return {"state": state, "config": cfg, "source": source, "tp_size": int(state["tp_size"]),
            "draft_kind": kind, "draft_dir": draft}


def export_checkpoint(path: str, out: str, *, dtype: str | None = None) -> str:
    """Export the checkpoint ``path`` names (:func:`resolve_checkpoint`) to ``out``; returns the iteration
    folder read. The policy is rebuilt in this process at TP=1 whatever TP it was saved at (megatron-core's
    ``dist_checkpointing`` gathers the shards on load; only the model's tensors are read)."""
    from megatron_spec.models import HFCheckpoint
    from megatron_spec.models.gpt import build_gpt_model
    from megatron_spec.parallel import destroy_parallel, init_parallel
    from megatron_spec.rl.checkpoint import load_checkpoint

    iter_dir = resolve_checkpoint(path)
    plan = checkpoint_plan(iter_dir)
    m = plan["config"]["model"]
    info = init_parallel(tp_size=1, seed=m["seed"])
    try:
        ckpt = HFCheckpoint(plan["source"])
        model = build_gpt_model(
            ckpt.decoder_config,
            params_dtype=torch.bfloat16 if m["bf16"] else torch.float32,
            vocab_divisible_by=m["make_vocab_size_divisible_by"],
            device=info.device,
        )
        model.load_state_dict(load_checkpoint(iter_dir, {"model": model.sharded_state_dict()})["model"])
        s = plan["state"]
        write_hf_export(out, model, plan["source"], write=True, draft_kind=plan["draft_kind"],
                        draft_dir=plan["draft_dir"], dtype=getattr(torch, dtype) if dtype else None,
                        info={"step": s["step"], "policy_version": s["policy_version"],
                              "draft_kind": plan["draft_kind"], "draft_version": s.get("draft_version"),
                              "checkpoint": iter_dir})
    finally:
        destroy_parallel()
    return iter_dir
