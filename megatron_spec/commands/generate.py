"""``megatron-spec generate``: run the rollout engine alone on an HF checkpoint.

Reads prompts from JSONL (``{"id", "prompt"}`` or ``{"id", "input_ids"}``), writes one JSON
line per sample (with the decoded ``text`` when the checkpoint has a tokenizer), shows a
progress bar on stderr, and ends stdout with one JSON summary line (tokens/s, accept length,
per-position acceptance, the compute ``dtype`` and the ``cpu_capability``). The engine and sampling
flags are the launcher's (``--hf-checkpoint``, ``--spec-draft-kind``, ``--rollout-temperature``: one
table, ``megatron_spec.rollout.settings.SETTINGS``), each also under its older name here (``--model``,
``--draft-kind``, ``--temperature``). ``--rollout-dtype auto`` (the default) is resolved through
``megatron_spec.isa.resolve_dtype``: bf16 only where the CPU does bf16 natively (or on a GPU), fp32
elsewhere. Bad input (a missing model or draft directory, prompts, a
draft for another model, a prompt too long for the context) is one ``error:`` line on stderr and
exit status 2; an engine that died, 1. The prompt, output and summary names are a contract
(docs/design.md, "megatron-spec generate").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.types import GenerateRequest, GenerateStats, SamplingParams

HELP = "generate samples with the rollout engine (optionally speculative) from a prompts JSONL file"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The engine and sampling settings under the launcher's names (``--spec-draft-kind``,
    ``--rollout-dtype``), each also under its older name here (``--draft-kind``, ``--dtype``): one table,
    ``megatron_spec.rollout.settings.SETTINGS``; then what only a sampler on its own needs."""
    from megatron_spec.rollout.settings import add_generate_arguments

    add_generate_arguments(p)
    p.add_argument("--prompts", required=True, help="JSONL: {'id', 'prompt'} or {'id', 'input_ids'} per line")
    p.add_argument("--n", type=int, default=1, help="samples per prompt (they share the prompt's prefill)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's EOS")
    p.add_argument("--context-length", type=int, default=None,
                   help="engine context (default: longest prompt + --rollout-max-new-tokens)")
    p.add_argument("--device", default="cpu", help="where the native engine runs: cpu, cuda or cuda:N")
    p.add_argument("--output", required=True, help="output JSONL, one line per sample")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--apply-chat-template",
        action="store_true",
        help="render each text prompt as a user turn with the tokenizer's chat template (prompts that are "
        "lists of chat messages always are); the trainer's encoding, rl/prompting.encode_prompt",
    )
    p.add_argument("--system-prompt", default=None, help="system turn before each chat prompt")
    p.add_argument(
        "--prompt-template", default=None, help="text each prompt becomes, {prompt} standing for it"
    )
    p.add_argument(
        "--apply-chat-template-kwargs", default=None, help="the chat template's variables, a JSON object"
    )


def check_paths(args: argparse.Namespace) -> None:
    """The model (and draft) directories exist; checked first, so a typo in ``--hf-checkpoint`` is named as
    such rather than as a symptom (no tokenizer, no config.json)."""
    from megatron_spec.models.fetch import is_model_name, resolve_model

    model = args.hf_checkpoint
    if is_model_name(model):  # smollm2, or a Hub id read from the local huggingface_hub cache
        model = args.hf_checkpoint = resolve_model(
            model, log=lambda m: print(f"megatron-spec generate: {m}", file=sys.stderr))
    if not os.path.isdir(model):
        raise FileNotFoundError(f"--hf-checkpoint {model}: no such directory (an HF checkpoint directory)")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(
            f"--hf-checkpoint {model} has no config.json (not an HF checkpoint directory)"
        )
    path = args.spec_draft_path
    if path and args.spec_draft_kind in ("eagle3", "model", "mtp") and not os.path.isdir(path):
        raise FileNotFoundError(f"--spec-draft-path {path}: no such directory")


_PART = "\x00"  # joins a request id and the index of one of its batches (never in a JSON id a user wrote)


def batched_requests(prompts, sampling, n: int, batch_size: int) -> list:
    """One request per prompt, or, where ``n`` samples do not fit ``batch_size`` sequences at once, one per
    batch of at most ``batch_size`` samples (the engine holds ``batch_size`` KV-cache slots, not ``n``)."""
    from megatron_spec.rollout.types import GenerateRequest

    if n <= batch_size:
        return [GenerateRequest(rid, ids, sampling, n=n) for rid, ids in prompts]
    return [GenerateRequest(f"{rid}{_PART}{j}", ids, sampling, n=min(batch_size, n - start))
            for rid, ids in prompts for j, start in enumerate(range(0, n, batch_size))]


def merge_batches(samples, batch_size: int) -> list:
    """The samples of :func:`batched_requests`' batches under their prompt's id, numbered 0..n-1."""
    out = []
    for s in samples:
        if _PART in s.request_id:
            rid, j = s.request_id.split(_PART)
            s = dataclasses.replace(s, request_id=rid, sample_index=int(j) * batch_size + s.sample_index)
        out.append(s)
    return out


def check_context(args: argparse.Namespace, prompts) -> int:
    """The engine's context: the longest prompt plus ``--rollout-max-new-tokens`` (or ``--context-length``),
    refused with one error when it exceeds the model's positions (``max_position_embeddings``)."""
    from megatron_spec.models.hf_config import DecoderConfig

    limit = DecoderConfig.from_pretrained(args.hf_checkpoint).max_position_embeddings
    rid, ids = max(prompts, key=lambda p: len(p[1]))
    new = args.rollout_max_new_tokens
    need = len(ids) + new
    if need > limit:
        raise ValueError(
            f"prompt {rid!r} has {len(ids)} tokens; with --rollout-max-new-tokens {new} it needs "
            f"{need} positions, more than the model's context of {limit} (max_position_embeddings in "
            f"{args.hf_checkpoint}/config.json)"
        )
    if args.context_length and args.context_length > limit:
        raise ValueError(f"--context-length {args.context_length} exceeds the model's context of {limit} "
                         f"(max_position_embeddings)")
    return args.context_length or need


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None when it has none (token ids are written either way)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError):
        return None


def read_prompts(path: str, tokenizer, encoding: dict | None = None) -> list[tuple[str, list[int]]]:
    """``(id, input_ids)`` per line; text (or chat-message) prompts are encoded as the trainer encodes them
    (``rl.prompting.encode_prompt`` with ``encoding``: chat_template, system_prompt, template,
    template_kwargs) with ``tokenizer`` (the model's; None when it has none, and then they are an error)."""
    from megatron_spec.rl.prompting import encode_prompt

    encoding = encoding or {"chat_template": False}
    if not os.path.isfile(path):
        raise FileNotFoundError(f"prompts file {path} does not exist")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc})") from exc
            rid = str(obj.get("id", lineno - 1))
            if "input_ids" in obj:
                ids = obj["input_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    raise ValueError(f"{path}:{lineno}: input_ids must be a list of ints")
            elif "prompt" in obj:
                if tokenizer is None:
                    raise ValueError(f"{path}:{lineno}: a text prompt, but the model has no tokenizer "
                                     f"(give 'input_ids')")
                ids = encode_prompt(tokenizer, obj["prompt"], **encoding)
            else:
                raise ValueError(f"{path}:{lineno}: needs 'prompt' or 'input_ids'")
            if not ids:
                raise ValueError(f"{path}:{lineno}: empty prompt")
            rows.append((rid, ids))
    if not rows:
        raise ValueError(f"prompts file {path} has no prompts")
    return rows


@dataclasses.dataclass(frozen=True)
class _Job:
    """What :func:`run` resolved from the flags before it starts an engine."""

    dtype: str
    """The compute dtype ``--rollout-dtype`` resolved to."""
    sampling: SamplingParams
    requests: list[GenerateRequest]
    batch_size: int
    """Samples an engine runs at once (``--rollout-max-batch-size``)."""
    config: EngineConfig


def _plan(args: argparse.Namespace, tokenizer) -> _Job:
    """Resolve the dtype, check the speculation settings, read the prompts and build the requests and the
    engine config; raises ``ValueError`` or ``FileNotFoundError`` for bad input."""
    from megatron_spec.isa import resolve_dtype
    from megatron_spec.rl.prompting import parse_template_kwargs
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.settings import check_speculation, engine_kwargs, sampling_kwargs
    from megatron_spec.rollout.types import SamplingParams

    backend = args.rollout_backend
    values = vars(args)
    device_type = "cuda" if backend == "sglang" else args.device.partition(":")[0]
    dtype = resolve_dtype(args.rollout_dtype, device_type)
    check_speculation(values, backend)
    encoding = {
        "chat_template": args.apply_chat_template,
        "system_prompt": args.system_prompt,
        "template": args.prompt_template,
        "template_kwargs": parse_template_kwargs(args.apply_chat_template_kwargs),
    }
    prompts = read_prompts(args.prompts, tokenizer, encoding)
    sampling = SamplingParams(**sampling_kwargs(values), ignore_eos=args.ignore_eos)
    batch_size = args.rollout_max_batch_size
    requests = batched_requests(prompts, sampling, args.n, batch_size)
    context = check_context(args, prompts)
    config = EngineConfig(
        **{**engine_kwargs(values), "dtype": dtype}, device=args.device, context_length=context
    )
    if backend == "vllm":
        from megatron_spec.rollout.vllm_backend import vllm_python
        from megatron_spec.rollout.vllm_protocol import check_supported

        check_supported(config, [sampling.temperature])
        vllm_python(config.vllm_python)
    return _Job(dtype, sampling, requests, batch_size, config)


def _generate(args: argparse.Namespace, job: _Job) -> tuple[list, GenerateStats]:
    """Run the job's requests on a fresh engine, with a progress bar on stderr; the samples under their
    prompts' ids."""
    from tqdm import tqdm

    from megatron_spec.rollout import make_engine

    total = len(job.requests) * args.n
    temperatures = (job.sampling.temperature,)
    with make_engine(job.config, backend=args.rollout_backend, temperatures=temperatures) as engine:
        bar = tqdm(total=total, desc="generate", unit="sample", disable=args.no_progress, file=sys.stderr)
        seen = [0]

        def on_progress(n: int) -> None:
            bar.update(n - seen[0])
            seen[0] = n

        try:
            samples, stats = engine.generate(job.requests, on_progress=on_progress)
            samples = merge_batches(samples, job.batch_size)
            bar.update(total - seen[0])
        finally:
            bar.close()
    return samples, stats


def write_samples(path: str, samples, tokenizer) -> None:
    """One JSON line per sample (with the decoded ``text`` where there is a tokenizer), written to a
    temporary file that replaces ``path`` once complete."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        for s in samples:
            row = s.to_json()
            if tokenizer is not None:
                row["text"] = tokenizer.decode(s.output_ids, skip_special_tokens=True)
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def run(args: argparse.Namespace) -> int:
    """Generate; the exit status: 0, 2 for bad input or a request the engine refused, 1 for an engine that
    died or timed out."""
    from megatron_spec.interfaces import EngineCallError, EngineError
    from megatron_spec.isa import probe

    try:
        check_paths(args)
    except FileNotFoundError as exc:
        print(f"megatron-spec generate: error: {exc}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(args.hf_checkpoint)
    try:
        job = _plan(args, tokenizer)
    except (ValueError, FileNotFoundError) as exc:
        print(f"megatron-spec generate: error: {exc}", file=sys.stderr)
        return 2
    try:
        samples, stats = _generate(args, job)
    except EngineCallError as exc:  # the engine refused the configuration or a request
        print(f"megatron-spec generate: error: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:  # died or timed out
        print(f"megatron-spec generate: engine failure: {exc}", file=sys.stderr)
        return 1
    write_samples(args.output, samples, tokenizer)
    print(json.dumps({**stats.summary(), "dtype": job.dtype, "cpu_capability": probe().capability}))
    return 0
