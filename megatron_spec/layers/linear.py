"""The linear layer of the native engine's decoder and its draft heads, with prepacked copies for inference.

:class:`Linear` stores its weight ``[out, in]`` as a weight sync writes it and can keep oneDNN-packed and
kernel-panel copies for inference; :func:`pack_linears` (re)packs every one in a module after its weights
change and :func:`warm_linears` builds oneDNN's primitives for every row count a speculative engine meets.

It does not know about models, caches, requests or sampling.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

if TYPE_CHECKING:
    from megatron_spec.sync.fingerprint import Fingerprint


def _mkldnn_packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


SMALL_MAX_ROWS = 128
"""Inputs of at most this many rows run through ``megatron_spec::linear_small_f32`` (fp32, when the
extension is built): decode and verify batches. More rows (prefills) go to oneDNN (see :class:`Linear`).
Measured over SmolLM2-135M's 121 projections and its head on a 2-core AVX2 EPYC, kernel vs oneDNN
(ms, best of 5; ``benchmarks/bench_linear_rows.py``): 21 vs 30 at 1 row, 26 vs 43 at 4, 44 vs 67 at 16,
75 vs 97 at 32, 134 vs 161 at 64, 259 vs 285 at 128, 488 vs 520 at 256. On a 2-core Ice Lake Xeon
(``AVX-512``; the kernel's two-panel AVX-512 tiles, bf16 panels, vs oneDNN): 12.9 vs 36.4 at 1 row, 23.7 vs
56.2 at 16, 69.1 vs 101.5 at 64, 139.1 vs 160.0 at 128; ``F.linear`` on the weight took 0.97x the kernel's
time at 128 rows, 0.63x against the one-panel tiles before them. The limit stays where the kernel keeps the
batch invariance (a verify's rows are bitwise those of the decode steps it replaces)."""


BF16_WEIGHT_PANELS = True
"""Keep the kernel's panels in bf16 where every weight of a matrix is a bf16 number (checkpoints stored in
bf16 and loaded in fp32, weights streamed in bf16): widening is exact, so the products, their order and the
results are the same bits as with fp32 panels, and a step streams half the bytes. Measured over SmolLM2's 211
matrices on a 2-core AVX2 EPYC (``benchmarks/bench_linear_rows.py``): 1.8x the fp32 panels at 1 row, 1.7x at
4, 1.2x at 16, 1.1x at 64, 1.06x at 128. False keeps fp32 panels (benchmarks compare both)."""


def bf16_candidate(w: torch.Tensor) -> bool:
    """Whether the fp32 tensor ``w`` may hold bfloat16 numbers only (its first values' low 16 bits are
    zero): a checkpoint stored in bf16, weights streamed in bf16. An fp32 trainer's weights (streamed after
    every update) fail here in ~3 us; the bf16 panels' pack checks every value in its own pass
    (``linear_pack_bf16w``), where a separate scan cost 0.12 s of SmolLM2's bf16 re-pack (0.19 s) on a 2-core
    AVX2 EPYC."""
    if w.dtype != torch.float32 or w.numel() == 0:
        return False
    return not any(v & 0xFFFF for v in w.detach().reshape(-1)[:8].view(torch.int32).tolist())


def small_linear_available() -> bool:
    """Whether the fp32 decode/verify kernel of ``csrc/linear_cpu.cpp`` can run (``megatron_spec._C``
    built)."""
    from megatron_spec._ext import compiled_ops_available

    return compiled_ops_available() and hasattr(torch.ops.megatron_spec, "linear_small_f32")


SMALL_MAX_ROWS_BF16 = 128
"""bf16 inputs of at most this many rows run through ``megatron_spec::linear_small_bf16`` (CPUs with
AVX512-BF16 dot products): decode and verify batches; prefills go to oneDNN. Measured over SmolLM2-135M's 211
matrices on a 2-core Zen 4, kernel vs oneDNN's packed bf16 matmul (ms, best of 5;
``benchmarks/bench_linear_rows.py``, with the kernel's panel prefetch): 9.5 vs 16.1 at 1 row, 10.1 vs 14.9 at
4, 14.8 vs 24.4 at 16, 42.5 vs 50.4 at 64, 82.8 vs 90.8 at 128. The kernel's rows do not depend on the batch
(oneDNN's do), so it is used up to here, where it is still faster. On a CPU with AMX the same op runs on AMX
tiles (``csrc/linear_amx_cpu.cpp``, ``megatron_spec._ext.amx_active``), over a 2-core Xeon with AMX (ms,
kernel on tiles / on AVX512-BF16 dot products / oneDNN's packed bf16 matmul, itself on AMX tiles): 15.3 / 16.5
/ 20.7 at 1 row, 15.0 / 30.1 / 21.2 at 16, 24.8 / 91.9 / 28.2 at 64, 42.1 / 174.8 / 39.4 at 128: the limit
stays (a verify of up to 128 rows keeps the batch invariance, at oneDNN's speed where it stops paying)."""


ONEDNN_COPY_F32 = False
"""Keep oneDNN's blocked copy of an fp32 weight that has the kernel's panels. Without it (the default) inputs
of more than :data:`SMALL_MAX_ROWS` rows (prefills, verifies of many rows) run ``F.linear`` on the
``[out, in]`` weight itself, and a weight sync re-packs the panels only. Measured on a 2-core AVX2 EPYC over
SmolLM2-135M's 30 layers of projections and its head (ms, best of 5, oneDNN's copy / the plain weight):
240 / 270 at 129 rows, 474 / 471 at 256, 928 / 992 at 512, 1902 / 2070 at 1024; a whole engine prefill of
16 chat prompts took 0.92x the time (median of 6 alternated calls), 64-token calls 1.03x (noise: 0.90-1.14);
building the copy took 0.23 s of every SmolLM2 sync (the panels 0.05 s) and held the weights' size once more
in memory. bf16 weights keep oneDNN's copy (``F.linear`` re-lays a bf16 weight out on every call)."""


def bf16_small_linear_available() -> bool:
    """Whether the bf16 decode/verify kernel of ``csrc/linear_bf16_cpu.cpp`` runs its bf16 dot products
    here."""
    from megatron_spec._ext import bf16_dot_available

    return bf16_dot_available() and hasattr(torch.ops.megatron_spec, "linear_small_bf16")


PACK_EPOCH = 0
"""Counts :meth:`Linear.pack` and :meth:`Linear.unpack` calls in this process: what was read from the packed
copies (``layers.fused_layers.fused_stack``'s lists, cached by ``CausalLM``) is current while it has not
moved."""


def packed_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    small: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
) -> torch.Tensor:
    """``x [M, in] -> [M, out_features]`` through the prepacked weights of a :class:`Linear`: the
    extension kernel's panels ``small`` for ``M <= SMALL_MAX_ROWS`` (fp32; bf16 panels of pairs, 4-D:
    ``SMALL_MAX_ROWS_BF16``) when there are some, else ``packed``: oneDNN's blocked copy, or the ``[out, in]``
    weight itself (a dense tensor: :data:`ONEDNN_COPY_F32`). A 3-D ``packed`` is the panels themselves (a
    weight that lives only as panels, :meth:`Linear.hold_panels`): the kernel at every row count."""
    if packed.dim() == 3:  # the weight held as the kernel's panels (Linear.hold_panels): every row count
        return torch.ops.megatron_spec.linear_small_f32(x, packed, bias, out_features)
    if small is not None:
        if small.dim() == 4:
            if x.shape[0] <= SMALL_MAX_ROWS_BF16:
                return torch.ops.megatron_spec.linear_small_bf16(x, small, bias, out_features)
        elif x.shape[0] <= SMALL_MAX_ROWS:
            return torch.ops.megatron_spec.linear_small_f32(x, small, bias, out_features)
    if not packed.is_mkldnn:
        return F.linear(x, packed, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class HeldPanels:
    """A module whose ``weight`` ``[rows, cols]`` may live as the panel kernel's fp32 panels instead of rows:
    memory a lent bucket holds, written by the trainer in that layout
    (``megatron_spec.sync.bucket_stream.pack``; the parameter then holds the same values in another order, so
    its fingerprint is unchanged).

    Why: the engine's own pack of SmolLM2's linear weights, one more pass over 400 MB beside the trainer's,
    slowed both by a third on a 2-core AVX2 EPYC; with the trainer writing the panels the engine packs nothing
    (docs/weight_sync.md, 'Lent as panels')."""

    weight: torch.Tensor
    _panels_at: int | None = None  # the weight's address while its memory holds panels

    def hold_panels(self, panels: bool) -> None:
        """Whether the weight's memory, as it is now, holds panels (``out[p, c, j] = w[16 p + j, c]``); a
        weight given other memory later (a copy, a release) is rows again."""
        w = self.weight
        if panels and not (w.dtype == torch.float32 and w.dim() == 2 and w.shape[0] % 16 == 0
                           and w.is_contiguous() and small_linear_available()):
            raise ValueError(f"a weight {tuple(w.shape)} {w.dtype} cannot be held as fp32 panels of 16 rows")
        self._panels_at = w.data_ptr() if panels else None

    @property
    def holds_panels(self) -> bool:
        """Whether the weight's memory holds panels (:meth:`hold_panels`, and the memory is still that)."""
        return self._panels_at is not None and self._panels_at == self.weight.data_ptr() \
            and self.weight.numel() > 0

    def panels(self) -> torch.Tensor:
        """The weight's memory as its ``[rows / 16, cols, 16]`` panels (where :attr:`holds_panels`)."""
        w = self.weight.detach()
        return w.view(w.shape[0] // 16, w.shape[1], 16)


class PanelEmbedding(HeldPanels, nn.Embedding):
    """The token table; where it holds panels (a tied table lent in the head's layout, so that the engine's
    head computes with it as it lies: :class:`TiedLinear`) a lookup gathers each row from its panel."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.holds_panels:
            return super().forward(ids)
        return self.panels()[ids // 16, :, ids % 16]


class Linear(HeldPanels, nn.Module):
    """``y = x W^T + b`` with W stored ``[out, in]``, contiguous (the layout HF checkpoints and weight
    syncs carry: a loaded tensor is one straight copy, and packing reads it as it is), and optional
    prepacked copies for inference.

    Why: at decode sizes (1-64 rows) a plain ``F.linear`` on CPU re-lays-out the weight on every call (bf16,
    oneDNN) or takes MKL's slow small-M path (fp32 on this AMD CPU); a weight packed once into oneDNN's
    blocked format runs 2-12x faster and gives the same fp32 result as ``x @ W^T`` (measured:
    benchmarks/bench_rollout.py). In fp32 a copy in 16-output panels serves inputs of up to
    :data:`SMALL_MAX_ROWS` rows through the extension's kernel (larger ones run ``F.linear`` on the weight,
    with no oneDNN copy: :data:`ONEDNN_COPY_F32`), 1.4-1.9x faster than oneDNN at 1-16 rows and
    1.2x at 64 on a 2-core AVX2 EPYC (``csrc/linear_cpu.cpp``); it costs the weights' size once more in
    memory, half of it where the weights are all bf16 numbers (:data:`BF16_WEIGHT_PANELS`: bf16 panels, the
    same results, up to 1.9x faster again). :meth:`pack` builds them after weights change (the engine calls it
    after every load); it is used only when autograd is off, so training the same module (the EAGLE-3 head)
    takes the plain path. (The weight was stored transposed, ``weight_t [in, out]``, until a weight sync
    measured the transposing copies as its slowest piece; state dicts with ``weight_t`` still load.)
    """

    round_bf16 = False
    """Compute with the fp32 weight rounded to bf16 (set per module: an engine's draft, whose precision the
    samples do not depend on, verification being exact; its panels read half the bytes): :meth:`pack` rounds a
    copy, the weight and its fingerprint stay as loaded."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        init = torch.empty(in_features, out_features)
        nn.init.normal_(init, std=0.02)  # drawn [in, out]: the values of the earlier transposed storage
        self.weight = nn.Parameter(init.t().contiguous())
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self._packed: torch.Tensor | None = None
        self._small: torch.Tensor | None = None
        self._spare: torch.Tensor | None = None  # the panels' memory kept between an unpack and the next pack

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        old = state_dict.pop(prefix + "weight_t", None)
        if old is not None and prefix + "weight" not in state_dict:
            state_dict[prefix + "weight"] = old.t()  # a state dict of the transposed storage
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def pack(self, batch_hint: int = 16, sums: Fingerprint | None = None) -> bool:
        """Prepack the weight for inference (CPU, fp32/bf16): the kernel's panels where the kernel runs, and
        oneDNN's blocked copy for more rows (an fp32 weight with panels keeps none: :data:`ONEDNN_COPY_F32`);
        returns whether it is packed. ``sums``: add the weight's fingerprint sums to it, taken while
        re-packing the panels where the compiled op can (one pass over the weight: a weight sync's checksum of
        what the engine computes with), else in a pass of their own."""
        global PACK_EPOCH
        PACK_EPOCH += 1
        w = self.weight
        if self.holds_panels:  # nothing to pack: the weight's memory is the panels (a lent bucket's); every
            self._small = self._packed = self.panels()  # row count runs through the kernel on them
            self._spare = None
            if sums is not None:
                sums.add(w.detach())
            return True
        if (w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) or w.numel() == 0
                or not _mkldnn_packing_available()):
            self._packed = self._small = self._spare = None
            if sums is not None:
                sums.add(w.detach())
            return False
        with torch.no_grad():
            w = exact = w.detach().contiguous()  # a view already (a tied table too): no copy
            if self.round_bf16 and w.dtype == torch.float32 and not bf16_candidate(w):
                w = w.to(torch.bfloat16).float()  # every row count computes with it (F.linear too)
            self._packed = None  # freed first: the new copy can take its place in the heap
            old = self._small if self._small is not None else self._spare
            self._small, summed = self._pack_panels(w, old, sums if w is exact else None)
            self._spare = None
            if sums is not None and not summed:
                sums.add(exact)
            plain = w.dtype == torch.float32 and self._small is not None and not ONEDNN_COPY_F32
            self._packed = w if plain else torch.ops.mkldnn._reorder_linear_weight(w, batch_hint)
        return True

    @staticmethod
    def _pack_panels(w: torch.Tensor, old: torch.Tensor | None, sums: Fingerprint | None
                     ) -> tuple[torch.Tensor | None, bool]:
        """The kernel's panels of ``w`` for its dtype (None where the kernel cannot run), written into
        ``old`` where it has their layout (a weight sync: no allocation, no page faults), and whether ``w``'s
        sums were added to ``sums`` on the way."""
        ops = torch.ops.megatron_spec
        n, k = w.shape
        if w.dtype == torch.bfloat16:
            if not bf16_small_linear_available():
                return None, False
            return Linear._pack_as(w, old, sums, ops.linear_pack_bf16, torch.bfloat16,
                                   (-(-n // 16), -(-k // 2), 16, 2))
        if not small_linear_available():
            return None, False
        layout = (-(-n // 16), k, 16)
        if BF16_WEIGHT_PANELS and bf16_candidate(w):
            try:
                return Linear._pack_as(w, old, sums, ops.linear_pack_bf16w, torch.bfloat16, layout)
            except RuntimeError as exc:  # a value that is not a bf16 number, found by the pack's own pass
                if "not bfloat16 numbers" not in str(exc):
                    raise
        return Linear._pack_as(w, old, sums, ops.linear_pack_f32, torch.float32, layout)

    @staticmethod
    def _pack_as(w: torch.Tensor, old: torch.Tensor | None, sums: Fingerprint | None, pack,
                 dtype: torch.dtype, layout: tuple) -> tuple[torch.Tensor, bool]:
        """``pack(w)``, or ``w``'s panels written into ``old`` where it has that pack's ``dtype`` and
        ``layout`` (with ``sums``: summed in the same pass, into fresh panels where ``old`` does not fit: the
        main job releases the engine's weights while it trains, panels included, so every sync packs afresh);
        and whether ``sums`` got ``w``'s sums."""
        fused = sums is not None and hasattr(torch.ops.megatron_spec, "linear_pack_into_sums")
        if old is None or old.dtype != dtype or tuple(old.shape) != layout:
            if not fused:
                return pack(w), False
            old = torch.empty(layout, dtype=dtype, device=w.device)
        if fused:
            sums.add_sums(w.dtype, w.numel(), torch.ops.megatron_spec.linear_pack_into_sums(w, old))
            return old, True
        torch.ops.megatron_spec.linear_pack_into(w, old)
        return old, False

    @property
    def is_packed(self) -> bool:
        """Whether :meth:`pack` ran since the last :meth:`unpack` (and could pack)."""
        return self._packed is not None

    def unpack(self, keep: bool = False) -> None:
        """Drop the packed copies (the weights are about to change, or are released); ``keep``: keep the
        panels' memory, unused, for the next :meth:`pack` to write into."""
        global PACK_EPOCH
        PACK_EPOCH += 1
        if not keep or (self._small is not None and self._small is self._packed):  # held panels: not spare
            self._spare = None
        elif self._small is not None:
            self._spare = self._small
        self._packed = self._small = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self._packed is not None and not torch.is_grad_enabled() and x.dtype == self.weight.dtype
                and x.device.type == "cpu"):
            y = packed_matmul(
                x.reshape(-1, x.shape[-1]), self._packed, self._small, self.bias, self.out_features
            )
            return y.view(*x.shape[:-1], self.out_features)
        if self.holds_panels:
            raise RuntimeError("this layer's weight is held as panels: pack() it before calling it")
        y = F.linear(x, self.weight)
        return y + self.bias if self.bias is not None else y


class TiedLinear(Linear):
    """``y = x E^T`` over the weight ``E [out, in]`` of a module it does not own (a tied LM head over the
    embedding table), packed for oneDNN as :class:`Linear` is; it holds no parameter of its own.

    Why: the LM head is the largest matrix of a small model (SmolLM2-135M: 49152 x 576, a fifth of its
    weights), and ``F.linear`` over the unpacked table ran 1.3x (1 row) to 4x (16 rows) slower than
    the packed copy on this 2-core AVX2 CPU (fp32: 12 -> 9.6 ms at 1 row, 60 -> 15 ms at 16 rows).
    The packed copy costs the table's size once more in memory.
    """

    def __init__(self, owner: nn.Module, name: str = "weight"):
        nn.Module.__init__(self)
        self._owner = [owner]  # a list, so that the table is not registered as this module's submodule
        self._name = name
        self.out_features, self.in_features = getattr(owner, name).shape
        self.bias = None
        self._packed = self._small = self._spare = None

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        return getattr(self._owner[0], self._name)

    @property
    def holds_panels(self) -> bool:  # type: ignore[override]
        """Whether the table holds the head's panels (its owner, a :class:`PanelEmbedding`, says)."""
        return getattr(self._owner[0], "holds_panels", False)

    def hold_panels(self, panels: bool) -> None:
        raise TypeError("a tied head's table is held as panels by its owner (PanelEmbedding.hold_panels)")


def pack_linears(module: nn.Module, enable: bool = True, keep: bool = False) -> int:
    """(Re)pack every :class:`Linear` in ``module`` (or drop the packed copies, with ``keep``: keeping the
    panels' memory for the next pack, as a weight update does); returns how many."""
    n = 0
    for m in module.modules():
        if isinstance(m, Linear):
            n += m.pack() if enable else (m.unpack(keep) or 0)
    return n


def linear_layers(module: nn.Module) -> list[tuple[Linear, str | None]]:
    """Every :class:`Linear` in ``module`` with the name of its weight among ``module``'s parameters (a tied
    head: its table's; None for a weight from outside ``module``)."""
    names = {id(p): n for n, p in module.named_parameters()}
    return [(m, names.get(id(m.weight))) for m in module.modules() if isinstance(m, Linear)]


def warm_linears(modules: Iterable[nn.Module], max_rows: int, max_primitives: int | None = None) -> int:
    """Call every distinct packed :class:`Linear` shape once per input row count ``1..max_rows``.

    Why: oneDNN builds a primitive for each input shape on the first call with it (0.3-0.9 ms
    per linear on this CPU, against 0.05-0.2 ms for a call) and caches it by shape, across
    weight updates and modules. A speculative engine meets many row counts (B for a decode,
    B(k+1) for a verify, B x pending tokens for a draft extend), so without this its first
    generate calls pay for building them: the GRPO demo's first three rollouts ran up to 25%
    slower than the later ones. ``max_primitives`` (default: 3/4 of oneDNN's primitive cache,
    ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` or 1024) caps the rows so warming evicts nothing.
    Returns the number of calls made.
    """
    shapes: dict[tuple, Linear] = {}
    for module in modules:
        for m in module.modules():
            if isinstance(m, Linear) and m._packed is not None and m._packed.is_mkldnn:
                shapes.setdefault((m.in_features, m.out_features, m.weight.dtype, m.bias is None), m)
    if not shapes:
        return 0
    if max_primitives is None:
        max_primitives = 3 * int(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")) // 4
    rows = min(max_rows, max_primitives // len(shapes))
    with torch.inference_mode():
        for m in shapes.values():
            for r in range(1, rows + 1):
                m(torch.zeros(r, m.in_features, dtype=m.weight.dtype, device=m.weight.device))
    return rows * len(shapes)
