"""How the native engine's decoder takes weights by HF name: into its fused parameters, by copy or, from a
lent bucket, as views of it.

q/k/v arrive as three HF tensors and load into one ``qkv_proj``, gate/up into ``gate_up_proj`` (the layout
SGLang and vLLM use); an unknown or missing name is an error, never skipped. A weight update's bucket that the
sender lends for good (:mod:`megatron_spec.sync.fused_pieces`) becomes the parameters themselves where a
parameter's pieces lie in it side by side: the engine then neither copies nor allocates, and computes from the
trainer's shared memory until the next update of the same weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_spec.sync.fused_pieces import FUSED, joined_view

if TYPE_CHECKING:
    from megatron_spec.models.hf_config import DecoderConfig
    from megatron_spec.sync.fingerprint import Fingerprint

# HF name pieces that load into a fused parameter: (hf piece, fused piece, shard index)
STACKED = tuple((piece, fused, idx) for fused, pieces in FUSED.items() for idx, piece in enumerate(pieces))


class HFWeights:
    """The weights half of :class:`~megatron_spec.rollout.native.model.CausalLM` (a mixin over its ``cfg``,
    ``lm_head`` and parameters)."""

    cfg: DecoderConfig
    lm_head: nn.Module | None

    def expected_hf_names(self) -> set[str]:
        from megatron_spec.models.convert import expected_hf_shapes

        return set(expected_hf_shapes(self.cfg))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], *, strict_complete: bool = True,
        fingerprint: Fingerprint | None = None, lent: bool = False, owed: set[str] | None = None,
    ) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the names loaded. ``fingerprint``:
        accumulate what was written, in the same pass as the copy (:meth:`Fingerprint.copy_in`).

        ``lent``: the tensors are views of a buffer lent for good (a weight update's bucket, rewritten only
        by the next complete update of these weights): a parameter whose pieces all lie in it side by side, in
        its own dtype and device, becomes a view of the buffer instead of a copy (:meth:`_lent_views`). A
        parameter in shared memory (such a view) that is written by copy gets its own memory first. ``owed``:
        the names of parameters that became views are added to it instead of their sums to ``fingerprint``
        (the caller sums them in a pass it makes anyway: the engine's re-pack of the layers, from the weights
        it computes with; ``weight_session.WeightSession._repack``).

        Raises:
            KeyError: a name this model does not have (never skipped silently).
            ValueError: a shape that does not fit; with ``strict_complete``, names missing.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.cfg
        sizes = {"qkv_proj": (cfg.q_size, cfg.kv_size, cfg.kv_size),
                 "gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
        views: dict[str, torch.Tensor] = {}
        if lent:
            weights = list(weights)
            views = self._lent_views(weights, params, sizes)
            for target, view in views.items():
                params[target].data = view
        with torch.no_grad():
            for name, tensor in weights:
                if name == "lm_head.weight" and self.lm_head is None:
                    raise KeyError(
                        f"lm_head.weight sent to a model with tied embeddings ({cfg.architecture})"
                    )
                target, shard = self._target(name)
                if target not in params:
                    raise KeyError(f"unknown weight {name} for {cfg.architecture} (no parameter {target})")
                param = params[target]
                # a view of a buffer lent before, which its sender will rewrite: own memory before a copy
                if target not in views and param.is_shared():
                    param.data = param.data.clone()
                if shard is None:
                    dst = param
                else:
                    piece, idx = shard
                    offset = sum(sizes[piece][:idx])
                    dst = param.narrow(0, offset, sizes[piece][idx])
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"weight {name} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}"
                    )
                loaded.add(name)
                if target in views:  # held as sent, where it was sent
                    if owed is not None:
                        owed.add(target)
                    elif fingerprint is not None:
                        fingerprint.add(tensor)
                    continue
                if fingerprint is None:
                    dst.copy_(tensor)  # one copy, cast on the way: the parameters are stored as sent
                else:
                    fingerprint.copy_in(dst, tensor)
        if strict_complete:
            missing = self.expected_hf_names() - loaded
            if missing:
                raise ValueError(f"weights missing after load: {sorted(missing)[:3]} ({len(missing)} in all)")
        return loaded

    def _lent_views(self, weights: list[tuple[str, torch.Tensor]], params: dict[str, nn.Parameter],
                    sizes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """The parameters that ``weights`` (views of one lent buffer) cover whole, each as a view of the
        buffer (:func:`~megatron_spec.sync.fused_pieces.joined_view`: every piece there once)."""
        pieces: dict[str, dict[int, torch.Tensor | None]] = {}
        fused_of: dict[str, str] = {}
        for name, tensor in weights:
            target, shard = self._target(name)
            got = pieces.setdefault(target, {})
            idx = 0 if shard is None else shard[1]
            got[idx] = None if idx in got else tensor  # sent twice: copied, in order
            if shard is not None:
                fused_of[target] = shard[0]
        out = {}
        for target, got in pieces.items():
            param = params.get(target)
            if param is not None and param.dim():
                rows = sizes[fused_of[target]] if target in fused_of else (param.shape[0],)
                view = joined_view([got.get(i) for i in range(len(rows))], param, rows) \
                    if len(got) == len(rows) else None
                if view is not None:
                    out[target] = view
        return out

    @staticmethod
    def _target(hf_name: str) -> tuple[str, tuple[str, int] | None]:
        name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
        for piece, fused, idx in STACKED:
            token = f".{piece}."
            if token in name:
                return name.replace(token, f".{fused}."), (fused, idx)
        return name, None
