"""How the native engine's decoder takes weights by HF name: into its fused parameters, by copy or, from a
lent bucket, as views of it.

q/k/v arrive as three HF tensors and load into one ``qkv_proj``, gate/up into ``gate_up_proj`` (the layout
SGLang and vLLM use); an unknown or missing name is an error, never skipped. A weight update's bucket that the
sender lends for good (:mod:`megatron_spec.sync.fused_pieces`) becomes the parameters themselves where a
parameter's pieces lie in it side by side: the engine then neither copies nor allocates, and computes from the
trainer's shared memory until the next update of the same weights.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import nn

from megatron_spec.sync.fused_pieces import FUSED, joined_view, siblings

if TYPE_CHECKING:
    from megatron_spec.models.hf_config import DecoderConfig
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.sync.fingerprint import Fingerprint

# HF name pieces that load into a fused parameter: (hf piece, fused piece, shard index)
STACKED = tuple((piece, fused, idx) for fused, pieces in FUSED.items() for idx, piece in enumerate(pieces))
_LINEAR_WEIGHTS = tuple(f".{p}.weight" for p in
                        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def panel_names(shapes: Mapping[str, tuple[int, ...]]) -> frozenset[str]:
    """The HF names of ``shapes`` whose tensors the decoder can hold as the kernel's panels
    (:class:`~megatron_spec.layers.linear.HeldPanels`): the projections' and the head's 2-D weights of whole
    panels (rows a multiple of 16; a tied head's: the embedding table, whose lookups then gather from them), a
    fused parameter's pieces all or none (its panels are its pieces' panels side by side only then)."""
    tied = "lm_head.weight" not in shapes  # the table is the head too: lent in its layout
    ok = {n for n, s in shapes.items() if len(s) == 2 and s[0] % 16 == 0
          and (n.endswith(_LINEAR_WEIGHTS) or n == "lm_head.weight"
               or (tied and n.endswith("embed_tokens.weight")))}
    return frozenset(n for n in ok if all(p in ok for p in siblings(n)))


def lent_panel_names(config: EngineConfig, shapes: Mapping[str, tuple[int, ...]]) -> frozenset[str]:
    """:meth:`~megatron_spec.interfaces.WeightReceiver.lent_panel_names` of a native engine with ``config``:
    :func:`panel_names` where it computes in fp32 on the CPU through the panel kernel, without FP8 weights."""
    from megatron_spec.layers.linear import small_linear_available

    if config.dtype != "float32" or config.device_type != "cpu" or config.fp8_weights \
            or not small_linear_available():
        return frozenset()
    return panel_names(shapes)


def rows_of_panels(t: torch.Tensor) -> torch.Tensor:
    """The ``[out, in]`` rows of a tensor whose memory holds their panels (``[out / 16, in, 16]``)."""
    n, k = t.shape
    return t.reshape(n // 16, k, 16).permute(0, 2, 1).reshape(n, k)


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
        panels: frozenset[str] = frozenset(),
    ) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the names loaded. ``fingerprint``:
        accumulate what was written, in the same pass as the copy (:meth:`Fingerprint.copy_in`).

        ``lent``: the tensors are views of a buffer lent for good (a weight update's bucket, rewritten only
        by the next complete update of these weights): a parameter whose pieces all lie in it side by side, in
        its own dtype and device, becomes a view of the buffer instead of a copy (:meth:`_lent_views`). A
        parameter in shared memory (such a view) that is written by copy gets its own memory first. ``owed``:
        the names of parameters that became views are added to it instead of their sums to ``fingerprint``
        (the caller sums them in a pass it makes anyway: the engine's re-pack of the layers, from the weights
        it computes with; ``weight_session.WeightSession._repack``). ``panels``: names of lent tensors written
        in the linear kernel's panel layout (:func:`panel_names`): a linear layer whose parameter is a view of
        such pieces holds its weight as panels (:meth:`~megatron_spec.layers.linear.Linear.hold_panels`); one
        copied instead gets their rows.

        Raises:
            KeyError: a name this model does not have (never skipped silently).
            ValueError: a shape that does not fit; with ``strict_complete``, names missing.
        """
        weights = list(weights)
        params = self._params_named(weights)
        loaded: set[str] = set()
        cfg = self.cfg
        sizes = {"qkv_proj": (cfg.q_size, cfg.kv_size, cfg.kv_size),
                 "gate_up_proj": (cfg.intermediate_size, cfg.intermediate_size)}
        views: dict[str, torch.Tensor] = {}
        if lent:
            views = self._lent_views(weights, params, sizes)
            in_panels = {self._target(n)[0] for n in panels}
            for target in in_panels & {self._target(n)[0] for n, _ in weights if n not in panels}:
                views.pop(target, None)  # pieces in both layouts: copied, as rows
            self._hold_panels(views, in_panels, params)
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
                # a view of a buffer lent before, which its sender will rewrite: own memory before a copy (as
                # rows: the pieces not written again must be rows too)
                if target not in views and param.is_shared():
                    held = getattr(self, "_panel_holders", {}).get(target)
                    param.data = rows_of_panels(param.data) if held is not None and held.holds_panels \
                        else param.data.clone()
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
                if name in panels:
                    tensor = rows_of_panels(tensor)
                if fingerprint is None:
                    dst.copy_(tensor)  # one copy, cast on the way: the parameters are stored as sent
                else:
                    fingerprint.copy_in(dst, tensor)
        if strict_complete:
            missing = self.expected_hf_names() - loaded
            if missing:
                raise ValueError(f"weights missing after load: {sorted(missing)[:3]} ({len(missing)} in all)")
        return loaded

    def _params_named(self, weights: list[tuple[str, torch.Tensor]]) -> dict[str, nn.Parameter]:
        """The parameters ``weights`` name (by :meth:`_target`), found one by one: a bucket names a few dozen
        of a model's hundreds, and walking every module for each bucket of a sync cost 0.2-0.6 ms a bucket
        (SmolLM2, 30 layers, 64 MiB buckets) on the engine's side of the stream."""
        params: dict[str, nn.Parameter] = {}
        for name, _ in weights:
            target = self._target(name)[0]
            if target not in params:
                try:
                    params[target] = self.get_parameter(target)
                except AttributeError:
                    pass  # not a parameter here: load_weights raises the KeyError that names it
        return params

    def _hold_panels(self, views: dict[str, torch.Tensor], in_panels: set[str],
                     params: dict[str, nn.Parameter]) -> None:
        """Make the parameters views of the lent bucket; each linear layer among them holds its weight as
        panels or rows as sent (a parameter whose pieces came in both is copied, not viewed)."""
        from megatron_spec.layers.linear import HeldPanels, TiedLinear

        holders = getattr(self, "_panel_holders", None)  # found once: the modules and their parameters stay
        if holders is None:
            holders = self._panel_holders = {
                f"{name}.weight" if name else "weight": m for name, m in self.named_modules()
                if isinstance(m, HeldPanels) and not isinstance(m, TiedLinear)}  # a tied head: its table's
        for target, view in views.items():
            params[target].data = view
            holder = holders.get(target)
            if holder is not None:
                holder.hold_panels(target in in_panels)
            elif target in in_panels:
                raise ValueError(f"{target} arrived in the panel layout; nothing here computes with it so")

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
