"""MTP depths beside a policy GPTModel, built from megatron-core's own modules, run on detached inputs.

Why not ``GPTModel(mtp_block_spec=...)`` as is: in megatron-core 0.16.1 the MTP block runs inside
``GPTModel._postprocess`` on the *live* decoder output, with the policy's embedding and output
layer, and its loss is attached to the policy's hidden states by ``MTPLossAutoScaler``: its
gradient reaches the backbone, the embedding and the output layer, and the forward fails
without ``labels`` (``labels.clone()``), i.e. on the log-prob recompute. So the policy is built
without MTP and :class:`MtpDraft` holds a ``MultiTokenPredictionBlock`` of its own (the spec from
``get_gpt_mtp_block_spec`` with the policy's layer spec, sequence parallelism off), run by
:meth:`MtpDraft.forward` on cached, detached inputs with the detach placed explicitly:

* ``h_0`` = the captured final-normed decoder output (``capture`` hook on ``final_layernorm``);
* the embeddings of ``x_{p+k}`` = the captured embedding rows (no lookup into the policy);
* each depth is megatron-core's ``MultiTokenPredictionLayer._proj_and_transformer_layer``
  (enorm/hnorm, ``eh_proj`` + TP gather, the transformer layer, ``final_layernorm``), skipping only
  its ``roll``/embedding lookup, which the cache replaces (tests check it against the layer's
  public ``forward``);
* logits use the policy's output-layer weight *detached* (column-parallel,
  ``copy_to_tensor_model_parallel_region`` so input gradients are reduced over TP), so no
  gradient reaches the policy.

It knows no loss, optimizer or HF names (``megatron_spec.draft.mtp`` trains it,
``megatron_spec.draft.mtp_convert`` names its parameters for export).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from megatron_spec.models.hf_config import DecoderConfig


class MtpDraft(torch.nn.Module):
    """``num_layers`` megatron-core MTP depths beside (not inside) a policy GPTModel."""

    def __init__(self, policy: torch.nn.Module, num_layers: int, *, use_te: bool | None = None):
        super().__init__()
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
        from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionBlock

        from megatron_spec.compat import ensure_megatron_compat
        from megatron_spec.models.gpt import te_available, unwrap

        ensure_megatron_compat()
        if num_layers < 1:
            raise ValueError(f"mtp_num_layers must be >= 1, got {num_layers}")
        gpt = unwrap(policy)
        if getattr(gpt, "mtp_process", False):
            raise ValueError(
                "the policy was built with MTP layers inside it (build_gpt_model(mtp_num_layers=...)); "
                "build it without and let MtpDraft hold them (their loss would reach the policy)"
            )
        tcfg = dataclasses.replace(gpt.config, mtp_num_layers=num_layers, sequence_parallel=False)
        use_te = te_available() if use_te is None else use_te
        spec = get_gpt_mtp_block_spec(tcfg, gpt.transformer_layer_spec, use_transformer_engine=use_te)
        self.block = MultiTokenPredictionBlock(config=tcfg, spec=spec)
        # megatron-core makes the local spec's norms on the CPU whatever the device: beside the policy
        self.block.to(next(gpt.parameters()).device)
        self.config = tcfg
        self.__dict__["_policy"] = gpt  # referenced, not owned: its parameters are not ours
        self.decoder_config: DecoderConfig = gpt.decoder_config
        self.vocab_size = gpt.decoder_config.vocab_size

    @property
    def num_layers(self) -> int:
        return len(self.block.layers)

    @property
    def policy(self) -> torch.nn.Module:
        return self.__dict__["_policy"]

    def rotary(self, seq_len: int) -> torch.Tensor:
        with torch.no_grad():
            return self.policy.rotary_pos_emb(seq_len)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor) -> list[torch.Tensor]:
        """Run every depth on detached inputs.

        Args:
            hidden: ``[S, B, H]`` final-normed verifier hidden state of each row (``h_0``).
            embeds: ``[S, B, H]`` embedding of each row's token ``x_t``; depth k reads row ``q + k``.
        Returns:
            per depth, ``h_k`` ``[S, B, H]`` (post ``final_layernorm``).
        """
        s = hidden.shape[0]
        rope = self.rotary(s)
        h, e = hidden.detach(), embeds.detach()
        outs = []
        for k, layer in enumerate(self.block.layers):
            ek = e if k == 0 else torch.cat([e[k:], e.new_zeros(min(k, s), *e.shape[1:])])[:s]
            h = layer._proj_and_transformer_layer(
                hidden_states=h, decoder_input=ek, attention_mask=None, rotary_pos_emb=rope
            )
            outs.append(h)
        return outs

    def output_weight(self) -> torch.Tensor:
        g = self.policy
        w = (
            g.shared_embedding_or_output_weight()
            if g.share_embeddings_and_output_weights
            else g.output_layer.weight
        )
        return w.detach()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits ``[B, S, V/tp]`` of ``h [S, B, H]`` (the policy's output layer, detached)."""
        from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

        if self.config.tensor_model_parallel_size > 1:
            h = copy_to_tensor_model_parallel_region(h)
        return F.linear(h, self.output_weight()).transpose(0, 1)

    def megatron_named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """Parameters under GPTModel's naming (``mtp.layers.{k}.*``; a depth's transformer layer is
        ``transformer_layer`` as megatron-core 0.16 names it, ``mtp_model_layer`` from 0.19 on)."""
        for name, p in self.block.named_parameters():
            yield "mtp." + name.replace(".mtp_model_layer.", ".transformer_layer."), p


__all__ = ["MtpDraft"]
