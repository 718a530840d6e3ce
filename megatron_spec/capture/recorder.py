"""The hooks of one ``Capture.record`` block: row selection before the forward, row gathering in it.

:class:`Recorder` chooses the rows in the model's pre-forward hook (from the response mask) and
gathers only those rows in the hooks on the embedding, the aux decoder layers (EAGLE-3) or the
final layernorm (MTP) and the output layer (the teacher), then hands the finished
:class:`~megatron_spec.capture.cache.DraftCache` part to its ``Capture``. What is recorded, and
why, is in :mod:`megatron_spec.capture.hooks`; this module does not own the cache or its budget
counters (the ``Capture`` does).

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

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megatron_spec.capture.cache import DraftCache, segment_runs
from megatron_spec.capture.config import default_aux_layer_ids
from megatron_spec.capture.logprobs import vocab_parallel_token_logprobs
from megatron_spec.capture.teacher import draft_vocab_teacher, log_mass_and_token_logprobs

if TYPE_CHECKING:
    from megatron_spec.capture.hooks import Capture

HOST = torch.device("cpu")
"""Where the rows are chosen (segment runs and the byte budget read the mask's values)."""


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


class Recorder:
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


__all__ = ["Recorder"]
