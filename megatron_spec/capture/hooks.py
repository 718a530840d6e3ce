"""Forward hooks on a megatron-core ``GPTModel`` that fill the draft-training cache.

Usage, around the verifier forward the GRPO loop runs anyway::

    capture = Capture(trainer.capture_config(CaptureConfig(...)))
    with capture.record(policy, response_mask):          # one forward per block
        logits = policy(input_ids, position_ids, attention_mask=None)
    ...
    metrics = trainer.train_step(capture.take())

What is recorded, per captured token ``x_t`` (``response_mask[b, t]`` True, t >= 1, and with
``prompt_context`` the positions before the response as unscored context rows; see
:mod:`megatron_spec.capture.cache` for the row convention):

* outputs of the aux decoder layers at ``t - 1`` (EAGLE-3; forward hooks on
  ``decoder.layers[i]``: "output of layer i", which is transformers' ``hidden_states[i + 1]``),
  or the final-normed decoder output at ``t - 1`` (MTP; hook on ``decoder.final_layernorm``);
* the embedding of ``x_t`` (hook on ``embedding``: the draft needs the target's embedding and
  this avoids a vocab-parallel lookup later);
* the teacher at ``t`` and the target log-prob of ``x_{t+1}`` (hook on ``output_layer``; computed
  from the vocab-parallel logits, see :mod:`megatron_spec.capture.teacher`).

Every hook reads ``.detach()``ed tensors under ``no_grad``, gathers only the selected rows and
returns None: the model's outputs, its autograd graph and its RNG are untouched. Hooks exist only
inside ``record``; with capture off the model carries no hook at all.

Tensor parallelism: hidden states after a layer are full width and replicated on every TP
rank; logits are vocab-parallel. All TP ranks compute the teacher for all selected rows (its
collectives need the same shapes everywhere); with ``shard_across_tp`` (EAGLE-3, whose head
is replicated) each TP rank then keeps every tp-th segment, so the cache is not duplicated
and the draft trains data-parallel over the whole world. MTP layers are TP-sharded like the
policy, so every TP rank keeps all rows.

Sequence parallelism: layer, embedding and final-norm outputs are then ``[S/tp, B, H]``
shards along the sequence; the hook all-gathers the (detached) shard along the sequence before
selecting rows. megatron-core 0.16.1 builds SP only with TransformerEngine (its torch norms
assert ``not sequence_parallel``), so on CPU this path is exercised with sharded inputs in the
TP=2 test rather than through a real SP model.

Pipeline parallelism is not supported (the aux layers must live on this rank).

Devices: the rows are chosen on the host (segment runs and the byte budget need the mask's
values: one copy of the ``[B, S]`` mask per forward); the row indices then move once to the
device of the forward's ``input_ids`` (the model's), where every hook gathers its rows, so the
cache's row tensors stay on the model's device (see :class:`~megatron_spec.capture.cache.DraftCache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_spec.capture.cache import DraftCache, segment_runs
from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.capture.teacher import draft_vocab_teacher, log_mass_and_token_logprobs
from megatron_spec.dtypes import torch_dtype

HOST = torch.device("cpu")
FORWARDS = ("logprob", "train")


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """ModelOpt's default EAGLE-3 feature layers: ``sorted({1, L//2 - 1, L - 4})`` clamped at 0 (the layers
    captured when a draft names none; ``megatron_spec.draft.eagle3_config`` writes the same into its
    exports)."""
    return tuple(sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)}))


@dataclasses.dataclass(frozen=True)
class CaptureConfig:
    """What the verifier's forward records for the draft, and how much of it."""

    draft_kind: str = "eagle3"
    """``eagle3`` (aux layer outputs) or ``mtp`` (final-normed hidden states)."""
    aux_layer_ids: tuple[int, ...] | None = None
    """EAGLE-3 feature layers in ``fc`` order (the draft's ``eagle_config``); None = ModelOpt's
    default ``sorted({1, L//2 - 1, L - 4})``."""
    teacher_topk: int | None = 32
    """Keep the teacher's k most likely draft-vocabulary entries per row; None = all of them."""
    draft_target_ids: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    """``[Vd]`` target id of each draft id (``arange + d2t``) of a reduced draft vocabulary; None = full."""
    storage_dtype: str = "bfloat16"
    """dtype of the stored features (bfloat16 | float32 | float16); the teacher is float32."""
    max_bytes: int = 1 << 30
    """Bound on this rank's cache; segments beyond it are dropped (counted in ``capture/dropped_rows``)."""
    shard_across_tp: bool | None = None
    """Each TP rank keeps every tp-th segment (default: True for eagle3; mtp requires False)."""
    forward: str = "logprob"
    """Which forward the GRPO loop records: ``logprob`` (the old-log-prob recompute, default) or
    ``train`` (the policy's training forward)."""
    prompt_context: bool | None = None
    """Also capture every position before a sequence's last response token that is not a response
    token (the prompt) as a *context* row (``DraftCache.scored`` False: attended to, never scored).
    The engine's draft attends to the prompt after its prefill, so a draft trained without it
    learns a function it is never served with. None = False here; ``Eagle3Trainer.capture_config``
    turns it on (docs/draft_training.md, "Why online training lowered acceptance")."""

    def __post_init__(self) -> None:
        if self.draft_kind not in ("eagle3", "mtp"):
            raise ValueError(f"capture draft_kind must be 'eagle3' or 'mtp', got {self.draft_kind!r}")
        torch_dtype(self.storage_dtype, "capture storage_dtype")  # raises for an unknown name
        if self.teacher_topk is not None and self.teacher_topk < 1:
            raise ValueError(f"capture teacher_topk must be >= 1 or None, got {self.teacher_topk}")
        if self.max_bytes <= 0:
            raise ValueError(f"capture max_bytes must be positive, got {self.max_bytes}")
        if self.forward not in FORWARDS:
            raise ValueError(f"capture forward must be one of {FORWARDS}, got {self.forward!r}")
        if self.shard_across_tp is None:
            object.__setattr__(self, "shard_across_tp", self.draft_kind == "eagle3")
        if self.draft_kind == "mtp" and self.shard_across_tp:
            raise ValueError(
                "capture shard_across_tp=True with draft_kind 'mtp': MTP layers are tensor-parallel, "
                "every TP rank must hold the same rows"
            )
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
            if self.draft_kind != "eagle3":
                raise ValueError("capture aux_layer_ids is an EAGLE-3 setting; draft_kind is 'mtp'")
        if self.draft_target_ids is not None:
            ids = torch.as_tensor(self.draft_target_ids, dtype=torch.long, device=HOST).reshape(-1)
            if torch.unique(ids).numel() != ids.numel():
                raise ValueError("capture draft_target_ids maps two draft ids to one target id")
            object.__setattr__(self, "draft_target_ids", ids)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.storage_dtype)


class Capture:
    """Owns the cache this rank fills; ``record`` attaches hooks around one forward."""

    def __init__(self, config: CaptureConfig, *, tp_group: dist.ProcessGroup | None = None):
        self.config = config
        self._tp_group = tp_group
        self._parts: list[DraftCache] = []
        self.bytes = 0
        """Bytes held now."""
        self.peak_bytes = 0
        """Largest cache held since the last ``reset_metrics`` (what ``take`` handed out)."""
        self.dropped_rows = 0
        self.rows = 0
        self.seconds = 0.0
        self._segments_seen = 0  # round-robin position for TP sharding (same on all TP ranks)

    @classmethod
    def for_trainer(
        cls, trainer: Any, base: CaptureConfig | None = None, *, tp_group: dist.ProcessGroup | None = None
    ) -> Capture:
        """A capture recording what ``trainer`` (``Eagle3Trainer`` / ``MtpTrainer``) trains on;
        ``base`` sets the rest (top-k, dtype, budget, which forward)."""
        return cls(trainer.capture_config(base), tp_group=tp_group)

    def wants(self, forward: str) -> bool:
        """True when the GRPO loop should wrap ``forward`` (``logprob`` or ``train``) in :meth:`record`."""
        if forward not in FORWARDS:
            raise ValueError(f"forward must be one of {FORWARDS}, got {forward!r}")
        return forward == self.config.forward

    @contextlib.contextmanager
    def record(self, model: torch.nn.Module, response_mask: torch.Tensor) -> Iterator[_Recorder]:
        """Capture the next forward of ``model`` (a GPTModel, possibly DDP/Float16-wrapped).

        Args:
            response_mask: ``[B, S]`` bool, True where ``input_ids[b, t]`` is a token whose draft
                row should be kept (the response tokens). Position 0 is never captured.

        Keep the backward pass outside the block: hooks are removed on exit, so activation
        recomputation in backward never records twice.
        """
        rec = _Recorder(self, model, response_mask)
        rec.attach()
        try:
            yield rec
        finally:
            rec.detach()
        rec.check_complete()

    def take(self) -> DraftCache | None:
        """The rows captured since the last ``take`` (None if nothing was), and reset the cache."""
        parts, self._parts = self._parts, []
        self.bytes = 0
        if not parts:
            return None
        return DraftCache.concat(parts)

    def metrics(self) -> dict[str, float]:
        """Since the last :meth:`reset_metrics`: ``capture/bytes`` (peak cache size), ``capture/rows``
        (rows captured), ``capture/dropped_rows`` (turned away by the budget), ``capture/seconds``
        (time spent inside the hooks)."""
        return {
            "capture/bytes": float(max(self.peak_bytes, self.bytes)),
            "capture/rows": float(self.rows),
            "capture/dropped_rows": float(self.dropped_rows),
            "capture/seconds": self.seconds,
        }

    def reset_metrics(self) -> None:
        self.dropped_rows, self.seconds, self.rows, self.peak_bytes = 0, 0.0, 0, self.bytes

    def _append(self, part: DraftCache) -> None:
        self._parts.append(part)
        self.bytes += part.nbytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.rows += part.num_rows
        self.dropped_rows += part.dropped_rows

    def tp_group(self) -> dist.ProcessGroup | None:
        if self._tp_group is not None:
            return self._tp_group
        from megatron.core import parallel_state as ps

        if dist.is_initialized() and ps.model_parallel_is_initialized():
            return ps.get_tensor_model_parallel_group()
        return None


def response_mask_from_targets(target_mask: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` token-aligned response mask from a ``[B, S-1]`` mask aligned with the targets
    ``input_ids[:, 1:]`` (the layout of GRPO's per-token log-prob masks)."""
    out = torch.zeros(
        target_mask.shape[0], target_mask.shape[1] + 1, dtype=torch.bool, device=target_mask.device
    )
    out[:, 1:] = target_mask > 0
    return out


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    from megatron_spec.models.gpt import unwrap

    return unwrap(model)


def _seq_gather(x: torch.Tensor, group: dist.ProcessGroup | None, tp_size: int) -> torch.Tensor:
    """All-gather sequence-parallel shards ``[S/tp, B, ...]`` -> ``[S, B, ...]`` (no autograd)."""
    if tp_size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * tp_size, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=group)
    return out


class _Recorder:
    """Hooks of one ``record`` block. Row selection happens in the model's pre-forward hook;
    every later hook only gathers those rows."""

    def __init__(self, capture: Capture, model: torch.nn.Module, response_mask: torch.Tensor):
        self.capture = capture
        self.cfg = capture.config
        self.gpt = _unwrap(model)
        self.mask = response_mask
        self.handles: list[Any] = []
        self.forwards = 0
        self.part: dict[str, torch.Tensor] = {}
        gpt_cfg = self.gpt.config
        if getattr(gpt_cfg, "pipeline_model_parallel_size", 1) != 1:
            raise ValueError("capture supports pipeline_model_parallel_size 1 only")
        self.num_layers = len(self.gpt.decoder.layers)
        if self.num_layers != gpt_cfg.num_layers:
            raise ValueError(
                f"capture needs all {gpt_cfg.num_layers} decoder layers on this rank, found {self.num_layers}"
            )
        self.aux_ids: tuple[int, ...] = ()
        if self.cfg.draft_kind == "eagle3":
            self.aux_ids = self.cfg.aux_layer_ids or default_aux_layer_ids(self.num_layers)
            bad = [i for i in self.aux_ids if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(
                    f"capture aux layer ids {list(self.aux_ids)} out of range for a policy with "
                    f"{self.num_layers} layers (valid 0..{self.num_layers - 1})"
                )
        self.sp = bool(getattr(gpt_cfg, "sequence_parallel", False))
        self.group = capture.tp_group()
        self.tp_rank = dist.get_rank(self.group) if self.group is not None else 0
        self.tp_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.vocab_size = getattr(self.gpt, "true_vocab_size", None) or self.gpt.vocab_size
        if self.cfg.draft_target_ids is not None and int(self.cfg.draft_target_ids.max()) >= self.vocab_size:
            raise ValueError(
                f"capture draft_target_ids reach id {int(self.cfg.draft_target_ids.max())}, outside "
                f"the policy vocabulary of {self.vocab_size}"
            )

    # ------------------------------------------------------------------ lifecycle
    def attach(self) -> None:
        g = self.gpt
        if not (g.pre_process and g.post_process):
            raise ValueError("capture needs the embedding and the output layer on this rank")
        self.handles.append(g.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
        self.handles.append(g.embedding.register_forward_hook(self._on_embedding))
        for pos, i in enumerate(self.aux_ids):
            self.handles.append(
                g.decoder.layers[i].register_forward_hook(
                    lambda m, a, o, pos=pos: self._on_feature(f"aux{pos}", o)
                )
            )
        if self.cfg.draft_kind == "mtp":
            if g.decoder.final_layernorm is None:
                raise ValueError("capture for MTP needs the decoder's final layernorm on this rank")
            self.handles.append(
                g.decoder.final_layernorm.register_forward_hook(lambda m, a, o: self._on_feature("hidden", o))
            )
        self.handles.append(g.output_layer.register_forward_hook(self._on_logits))

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def set_mask(self, response_mask: torch.Tensor) -> None:
        """Mask for the next forward inside the same ``record`` block (micro-batches)."""
        self.mask = response_mask

    def check_complete(self) -> None:
        if self.forwards == 0:
            raise RuntimeError("capture.record block ran no forward of the model")
        if self.part:
            raise RuntimeError("capture.record: the forward never reached the output layer (no logits seen)")

    # ------------------------------------------------------------------ hooks
    def _pre_forward(self, module, args, kwargs) -> None:
        t0 = time.perf_counter()
        if self.mask is None:
            raise RuntimeError("capture.record: a second forward in one block needs set_mask(...) first")
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None:
            raise ValueError("capture.record needs the forward to receive input_ids")
        self._select(input_ids.detach(), self.mask)
        self.mask = None
        self.forwards += 1
        self.capture.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def _select(self, input_ids: torch.Tensor, mask: torch.Tensor) -> None:
        if mask.shape != input_ids.shape:
            raise ValueError(
                f"response_mask has shape {tuple(mask.shape)}, input_ids {tuple(input_ids.shape)}"
            )
        dev = input_ids.device  # the model's: where the hooks' activations live
        # host bookkeeping: segment runs and the byte budget need the mask's values
        mask = mask.to(device=HOST, dtype=torch.bool, copy=True)
        mask[:, 0] = False  # x_0 has no preceding position to draft from
        scored_mask = mask
        if self.cfg.prompt_context:  # positions 1 .. last response token of each sequence
            pos = torch.arange(mask.shape[1], device=HOST).unsqueeze(0)
            last = torch.where(mask, pos, torch.full_like(pos, -1)).amax(dim=1, keepdim=True)  # [B, 1]
            mask = (pos >= 1) & (pos <= last)
        runs = segment_runs(mask)
        empty = torch.zeros(0, dtype=torch.long, device=HOST)
        b_idx = torch.cat([torch.full((n,), b, device=HOST) for b, _, n in runs]) if runs else empty
        t_idx = torch.cat([torch.arange(s, s + n, device=HOST) for _, s, n in runs]) if runs else empty
        ids = input_ids.to(HOST)
        seq = ids.shape[1]
        nxt_t = (t_idx + 1).clamp(max=seq - 1)
        has_next = (t_idx + 1 < seq) & mask[b_idx, nxt_t]
        self.all_rows = (b_idx.to(dev), t_idx.to(dev))  # indices into the logits, on their device
        self.next_tokens_all = torch.where(has_next, ids[b_idx, nxt_t], torch.full_like(t_idx, -1)).to(dev)

        # which segments this rank keeps: TP round robin, then the byte budget
        cfg, keep, lens = self.cfg, [], []
        row_bytes = self._row_bytes()
        used = self.capture.bytes
        dropped = 0
        for j, (_, _, n) in enumerate(runs):
            owner = (self.capture._segments_seen + j) % self.tp_size if cfg.shard_across_tp else self.tp_rank
            if owner != self.tp_rank:
                continue
            if used + n * row_bytes > cfg.max_bytes:
                dropped += n
                continue
            used += n * row_bytes
            keep.append(j)
            lens.append(n)
        self.capture._segments_seen += len(runs)
        starts = torch.tensor([0] + [n for _, _, n in runs], device=HOST).cumsum(0)
        kept = [torch.arange(int(starts[j]), int(starts[j + 1]), device=HOST) for j in keep]
        kept = torch.cat(kept) if kept else empty  # into the all-rows order
        kb, kt = b_idx[kept], t_idx[kept]
        self.part = {  # row fields on the model's device; cu_seqlens is host bookkeeping (DraftCache)
            "tokens": ids[kb, kt].to(dev),
            "positions": (kt - 1).to(dev),
            "cu_seqlens": torch.tensor([0] + lens, dtype=torch.long, device=HOST).cumsum(0),
        }
        if self.cfg.prompt_context:
            self.part["scored"] = scored_mask[kb, kt].to(dev)
        self.kept = kept.to(dev)
        kb, kt = kb.to(dev), kt.to(dev)
        self.kept_feat = (kt - 1, kb)  # [S, B] layout indices of position t - 1
        self.kept_cur = (kt, kb)
        self.dropped = dropped

    def _row_bytes(self) -> int:
        cfg, h = self.cfg, self.gpt.config.hidden_size
        item = cfg.dtype.itemsize
        feats = h * (1 + (len(self.aux_ids) if cfg.draft_kind == "eagle3" else 1))
        vd = self.vocab_size if cfg.draft_target_ids is None else cfg.draft_target_ids.numel()
        teacher = cfg.teacher_topk * 12 if cfg.teacher_topk is not None else vd * 4
        mass = 4 if cfg.draft_target_ids is not None else 0  # teacher_log_mass
        return feats * item + 3 * 8 + 4 + teacher + mass

    def _rows(self, x: torch.Tensor, index: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x.detach()
        if self.sp:
            x = _seq_gather(x, self.group, self.tp_size)
        t, b = index  # on the model's device (_select)
        return x[t, b].to(self.cfg.dtype)

    @torch.no_grad()
    def _on_embedding(self, module, args, output) -> None:
        t0 = time.perf_counter()
        self.part["embeds"] = self._rows(output, self.kept_cur)
        self.capture.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def _on_feature(self, key: str, output) -> None:
        t0 = time.perf_counter()
        hidden = output[0] if isinstance(output, tuple) else output
        self.part[key] = self._rows(hidden, self.kept_feat)
        self.capture.seconds += time.perf_counter() - t0

    @torch.no_grad()
    def _on_logits(self, module, args, output) -> None:
        t0 = time.perf_counter()
        logits = (output[0] if isinstance(output, tuple) else output).detach()  # [S, B, V/tp], full sequence
        b_all, t_all = self.all_rows
        rows = logits[t_all, b_all]  # [N_all, V/tp]
        cfg = self.cfg
        ids, lps = draft_vocab_teacher(
            rows,
            vocab_size=self.vocab_size,
            target_ids=cfg.draft_target_ids,
            topk=cfg.teacher_topk,
            tp_group=self.group if self.tp_size > 1 else None,
        )
        nxt = self.next_tokens_all
        tp_group = self.group if self.tp_size > 1 else None
        mass = None  # a reduced draft vocabulary: what the teacher's renormalisation leaves out
        if cfg.draft_target_ids is not None:  # both from one pass over the logits
            mass, nlp = log_mass_and_token_logprobs(rows, nxt.clamp(min=0), vocab_size=self.vocab_size,
                                                    target_ids=cfg.draft_target_ids, tp_group=tp_group)
        else:
            nlp = vocab_parallel_token_logprobs(rows.unsqueeze(0), nxt.clamp(min=0).unsqueeze(0),
                                                vocab_size=self.vocab_size, tp_group=tp_group)[0]
        nlp = torch.where(nxt >= 0, nlp, torch.zeros_like(nlp))
        kept = self.kept
        p = self.part
        aux = [p.pop(f"aux{i}") for i in range(len(self.aux_ids))]
        part = DraftCache(
            tokens=p["tokens"],
            positions=p["positions"],
            next_tokens=nxt[kept],
            next_logprobs=nlp[kept].float(),
            teacher_logprobs=lps[kept],
            teacher_ids=ids[kept] if ids is not None else None,
            teacher_log_mass=mass[kept] if mass is not None else None,
            cu_seqlens=p["cu_seqlens"],
            embeds=p.get("embeds"),
            aux=torch.cat(aux, dim=-1) if aux else None,
            hidden=p.get("hidden"),
            scored=p.get("scored"),
            dropped_rows=self.dropped,
        )
        self.part = {}
        self.capture._append(part)
        self.capture.seconds += time.perf_counter() - t0


__all__ = ["Capture", "CaptureConfig", "default_aux_layer_ids", "response_mask_from_targets"]
