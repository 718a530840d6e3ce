"""The task of a GRPO run: its prompts (training and held-out), their format, and the reward.

What the rollout manager asks the engines for (:meth:`PromptTask.next_round`,
:meth:`PromptTask.eval_round`) and how an owner turns what they return into scored rollouts
(:meth:`PromptTask.score`). The data position is resumable (:class:`~megatron_spec.rl.data.PromptSampler`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

from megatron_spec.config import ConfigError, RunConfig
from megatron_spec.config_values import parse_stop_strings
from megatron_spec.rl.data import PromptSampler, load_prompts
from megatron_spec.rl.prompting import (
    encode_prompt,
    has_chat_template,
    parse_template_kwargs,
    stop_token_ids,
    truncate_at_stop_strings,
)
from megatron_spec.rl.rewards import get_reward, score
from megatron_spec.rl.rollouts import Rollout
from megatron_spec.rl.step_records import Round
from megatron_spec.rollout.settings import sampling_kwargs
from megatron_spec.rollout.types import GenerateRequest, SampleOutput, SamplingParams
from megatron_spec.telemetry import StageTimer


class PromptTask:
    """The tokenizer and response ends of ``--hf-checkpoint`` (made first: a bad chat-template flag
    fails before the policy is built); :meth:`load` then reads the prompts and the reward."""

    def __init__(self, cfg: RunConfig, timer: StageTimer):
        from transformers import AutoTokenizer

        m = cfg.model
        self.cfg = cfg
        self.timer = timer
        self.tokenizer = AutoTokenizer.from_pretrained(m.hf_checkpoint)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        # prompt format and response ends (rl/prompting.py): chat template, EOS ids of config.json
        # and generation_config.json, stop strings
        if cfg.data.apply_chat_template and not has_chat_template(self.tokenizer):
            raise ConfigError(
                f"--apply-chat-template: the tokenizer of {m.hf_checkpoint} has no chat_template"
            )
        self.stop_ids = stop_token_ids(m.hf_checkpoint, self.tokenizer)
        self.template_kwargs = parse_template_kwargs(cfg.data.apply_chat_template_kwargs)
        self.stop_strings = parse_stop_strings(cfg.data.stop)
        self.sampling = SamplingParams(
            **sampling_kwargs(dataclasses.asdict(cfg.rollout)), stop_token_ids=self.stop_ids
        )
        """Every request's sampling: the rollout settings and the stop ids (frozen, shared)."""

    def load(self, run_dir: str) -> None:
        """Training and held-out prompts (``run_dir``: the datasets' cache), the sampler, the reward."""
        cfg, seed = self.cfg, self.cfg.model.seed
        self.examples = load_prompts(
            cfg.data.prompt_data,
            prompt_key=cfg.data.prompt_key,
            answer_key=cfg.data.answer_key,
            num_synthetic=cfg.data.num_synthetic_prompts,
            seed=seed,
            cache_dir=run_dir,
        )
        self.examples = self._drop_overlong(self.examples, f"--prompt-data {cfg.data.prompt_data}")
        self.sampler = PromptSampler(len(self.examples), seed)
        self.eval_examples = []
        if cfg.logging.eval_interval:
            self.eval_examples = load_prompts(
                cfg.data.eval_data or cfg.data.prompt_data, prompt_key=cfg.data.prompt_key,
                answer_key=cfg.data.answer_key, num_synthetic=cfg.data.eval_prompts,
                seed=seed + 7_919_000, cache_dir=run_dir)
            self.eval_examples = self._drop_overlong(
                self.eval_examples, f"--eval-data {cfg.data.eval_data or cfg.data.prompt_data}"
            )[: cfg.data.eval_prompts]
        self.reward = get_reward(cfg.data.reward)

    def encode(self, prompt) -> list[int]:
        """The prompt's token ids (``rl.prompting.encode_prompt``: text or chat messages)."""
        d = self.cfg.data
        return encode_prompt(
            self.tokenizer,
            prompt,
            chat_template=d.apply_chat_template,
            system_prompt=d.system_prompt,
            template=d.prompt_template,
            template_kwargs=self.template_kwargs,
        )

    def _drop_overlong(self, examples: list, what: str) -> list:
        """``--overlong-prompts``: prompts longer than ``--max-prompt-length`` dropped at load (their count
        printed by rank 0) or an error naming the first, before the first step."""
        d = self.cfg.data
        lengths = [len(self.encode(ex.prompt)) for ex in examples]
        long = [i for i, n in enumerate(lengths) if n > d.max_prompt_length]
        if not long:
            return examples
        if d.overlong_prompts == "error":
            raise ConfigError(
                f"{what}: {len(long)} of {len(examples)} prompts are longer than --max-prompt-length "
                f"{d.max_prompt_length} tokens (the first, row {long[0]}, has {lengths[long[0]]}); raise "
                f"it, or --overlong-prompts filter drops them"
            )
        if len(long) == len(examples):
            raise ConfigError(
                f"{what}: every prompt is longer than --max-prompt-length {d.max_prompt_length} tokens "
                f"(the shortest has {min(lengths)})"
            )
        if int(os.environ.get("RANK", "0")) == 0:
            print(
                f"megatron-spec: {what}: dropped {len(long)} of {len(examples)} prompts longer than "
                f"--max-prompt-length {d.max_prompt_length} tokens (--overlong-prompts filter)",
                file=sys.stderr,
                flush=True,
            )
        drop = set(long)
        return [ex for i, ex in enumerate(examples) if i not in drop]

    def request(self, request_id: str, prompt: str, what: str, n: int) -> GenerateRequest:
        """A generate request of ``n`` samples with the rollout sampling settings; ``what`` names
        the prompt in errors (empty after tokenising, longer than --max-prompt-length)."""
        d = self.cfg.data
        ids = self.encode(prompt)
        if not ids:
            raise ValueError(f"{what} tokenises to nothing: {prompt!r}")
        if len(ids) > d.max_prompt_length:
            raise ValueError(f"{what} has {len(ids)} tokens, more than --max-prompt-length "
                             f"{d.max_prompt_length}: {prompt[:80]!r}")
        return GenerateRequest(request_id, ids, self.sampling, n=n)

    def next_round(self, step: int) -> Round:
        """The prompts of batch ``step`` (every rank draws the same), ``grpo_group_size`` samples each."""
        indices = self.sampler.next(self.cfg.grpo.prompts_per_step)
        prompts = [self.examples[i].prompt for i in indices]
        n = self.cfg.grpo.grpo_group_size
        reqs = [self.request(f"{i}", p, f"prompt {i}", n) for i, p in zip(indices, prompts)]
        return Round(reqs, indices, prompts, [self.examples[i].answer for i in indices],
                     self.cfg.model.seed * 100_003 + step, [self.examples[i].metadata for i in indices])

    def eval_round(self) -> Round:
        """The held-out prompts, one sample each, the same seed every time (two evaluations differ by
        the policy, not by the draw)."""
        reqs = [self.request(f"eval{i}", ex.prompt, f"held-out prompt {i}", 1)
                for i, ex in enumerate(self.eval_examples)]
        return Round(reqs, list(range(len(reqs))), [ex.prompt for ex in self.eval_examples],
                     [ex.answer for ex in self.eval_examples], seed=self.cfg.model.seed * 100_003 + 99_991,
                     metadata=[ex.metadata for ex in self.eval_examples])

    def probe_requests(self, prompts: int, tokens: int) -> list[GenerateRequest]:
        """Greedy requests of ``tokens`` new tokens for the first ``prompts`` training prompts (the reference
        check's probes, ``megatron_spec.rl.reference``: the same every step)."""
        greedy = dataclasses.replace(self.sampling, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
                                     max_new_tokens=tokens)
        return [
            GenerateRequest(
                f"probe{i}", self.request(f"probe{i}", ex.prompt, f"prompt {i}", 1).input_ids, greedy
            )
            for i, ex in enumerate(self.examples[:prompts])
        ]

    def score(self, samples: list[SampleOutput], meta: dict[str, tuple[int, str, Any, tuple[int, ...]]],
              version: int) -> list[Rollout]:
        """An engine's samples as rollouts of policy ``version`` with their rewards (stop strings
        cut first). ``meta``: :meth:`Round.meta`."""
        truncate_at_stop_strings(samples, self.tokenizer, self.stop_strings)
        texts = self.tokenizer.batch_decode([s.output_ids for s in samples], skip_special_tokens=True)
        rollouts = []
        for s in samples:
            index, _, _, ids, _ = meta[s.request_id]
            rollouts.append(
                Rollout(
                    index,
                    s.sample_index,
                    list(ids),
                    s.output_ids,
                    s.logprobs,
                    s.finish_reason,
                    version,
                    s.accepted_per_step,
                    s.num_verify_steps,
                )
            )
        with self.timer("reward"):
            rewards = score(
                self.reward,
                [meta[s.request_id][1] for s in samples],
                texts,
                [meta[s.request_id][2] for s in samples],
                [meta[s.request_id][4] for s in samples],
            )
        for ro, rew in zip(rollouts, rewards):
            ro.reward = rew
        return rollouts
