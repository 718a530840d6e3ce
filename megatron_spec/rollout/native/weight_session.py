"""The native engine's weight-update sessions, SGLang's protocol: ``begin_weight_update(selector)``, any
number of ``update_weights_from_tensor`` (one bucket payload each), then ``end_weight_update`` (complete,
one version, re-packed, checksummed) or ``abort_weight_update``.

A mixin of :class:`~megatron_spec.rollout.native.server.EngineServer`, which holds the state it reads and
writes (the modules, versions, checksums, mapped buckets; ``config``, ``device``, ``dtype``) and provides
``_draft_module()`` and ``health()``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from megatron_spec.layers.linear import linear_layers, pack_linears
from megatron_spec.sync.fingerprint import Fingerprint

LOAD_THREADS = 1
"""torch threads of the CPU engine while it copies a bucket into its parameters, or packs the layers a lent
bucket holds. The trainer packs the next bucket on one thread meanwhile (``WeightStreamer(cpu_threads=1)``);
the copies are memory-bound, and two OpenMP threads here beside it stall each other: SmolLM2's fp32 sync on
a 2-core AVX2 EPYC took 0.22 / 0.22 / 0.27 s with one against 0.23 / 0.25 / 0.28 s with two, alternated
(docs/weight_sync.md). The re-pack after the last bucket, with the trainer idle, keeps the engine's
threads."""

SYNC_TIMINGS = ("engine_map_s", "engine_load_s", "engine_pack_s", "engine_repack_s", "engine_checksum_s")
"""Seconds of one weight-update session in the engine: mapping the payloads, copying them into the parameters
(or taking lent ones as views), packing the layers whose weights a lent bucket held whole as it arrives
(during the stream; a layer lent as panels is only read, for its checksum), re-packing the other changed
linear layers at the end, computing the changed groups' checksums (``end_weight_update`` reports them)."""


class WeightSession:
    """``begin/update/end/abort`` of a weight update, over the engine's state (set by ``EngineServer``)."""

    target: torch.nn.Module
    versions: dict[str, str | None]
    _updating: dict[str, set[str]] | None
    _session_groups: set[str]
    _mapped: list[torch.Tensor]
    _keep_mapped: bool
    _released: set[str]
    _checksums: dict[str, dict]
    _load_fingerprints: dict[str, Fingerprint | None]
    _linears: dict[str, list]
    """Per group, its linear layers and their weights' names (``linear_layers``), found once a session."""
    _owed: dict[str, set[str]]
    """Per group, the parameters taken as views of lent buckets this session: the re-pack adds their sums."""
    _timings: dict[str, float]

    def _has_group(self, group: str) -> bool:
        return group == "target" or self._draft_module() is not None

    def begin_weight_update(self, selector: str = "all") -> None:
        """Open an update session for ``selector`` (``target``, ``draft`` or both: ``all``); updates
        to a group outside it are refused (SGLang's session semantics)."""
        if self._updating is not None:
            raise RuntimeError("begin_weight_update called twice without end_weight_update")
        if selector not in ("target", "draft", "all"):
            raise ValueError(
                f"begin_weight_update selector must be 'target', 'draft' or 'all', got {selector!r}"
            )
        self._session_groups = {"target", "draft"} if selector == "all" else {selector}
        for group in self._session_groups:
            module = self.target if group == "target" else self._draft_module()
            if module is not None:
                # stale until the update ends, re-packed in place
                pack_linears(module, enable=False, keep=True)
        self._updating = {}
        self._load_fingerprints = {}
        self._owed = {}
        self._linears = {}
        self._timings = dict.fromkeys(SYNC_TIMINGS, 0.0)

    def update_weights_from_tensor(
        self,
        payloads: list[bytes],
        selector: str,
        weight_version: str | None = None,
        flush_cache: bool = True,
    ) -> dict[str, Any]:
        from megatron_spec.sync.transport import read_bucket

        if self._updating is None:
            raise RuntimeError("update_weights_from_tensor outside begin_weight_update/end_weight_update")
        if selector not in ("target", "draft"):
            raise ValueError(
                f"selector must be 'target' or 'draft' (never 'all': it overwrites the draft with "
                f"target tensors), got {selector!r}"
            )
        if selector not in self._session_groups:
            raise ValueError(f"update for {selector!r} in a weight-update session opened for "
                             f"{sorted(self._session_groups)}")
        if len(payloads) != 1:
            raise ValueError(f"the native engine has one TP rank; got {len(payloads)} payloads")
        module = self.target if selector == "target" else self._draft_module()
        if module is None:
            raise ValueError(f"selector 'draft' but the engine has no draft weights (draft_kind "
                             f"{self.config.draft_kind!r})")
        t0 = time.perf_counter()
        named, lent, panels = read_bucket(payloads[0])
        if panels and (selector != "target" or self.config.fp8_weights or self.device.type != "cpu"):
            raise ValueError(f"tensors in the panel layout for {selector!r}: only the target of a CPU engine "
                             f"without FP8 weights takes them")
        t1 = time.perf_counter()
        if named:  # keep the sender's two bucket buffers mapped: its next payloads name the same
            self._mapped = (self._mapped + [named[0][1]])[-2:]  # buffers, found in torch's cache
        if self.config.fp8_weights and selector == "target":
            from megatron_spec.sync.fp8 import dequantize_named

            named, lent = dequantize_named(named, self.dtype), False  # fresh tensors, not views of the bucket
        # a lent bucket of the target: its parameters become views of it (HFWeights.load_weights)
        lent_kw = {"lent": True} if lent and selector == "target" and self.device.type == "cpu" else {}
        self._checksums.pop(selector, None)
        # what is written is fingerprinted in the same pass (the checksum end_weight_update reports)
        fp = self._load_fingerprints.setdefault(selector, Fingerprint())
        threads = torch.get_num_threads()
        if self.device.type == "cpu":
            torch.set_num_threads(LOAD_THREADS)
        try:
            owed = self._owed.setdefault(selector, set())
            if lent_kw:  # the views' sums are taken while they are re-packed (or, held as panels, read)
                lent_kw.update(owed=owed, panels=panels)
            elif panels:
                lent_kw["panels"] = panels  # copied as rows
            before = set(owed)
            loaded = module.load_weights(named, strict_complete=False, fingerprint=fp, **lent_kw)
            t2 = time.perf_counter()
            seen = self._updating.setdefault(selector, set())
            if seen & loaded:  # a tensor written twice: its first values are in the sums, and layers packed
                self._load_fingerprints[selector] = fp = None  # early may hold them: all afresh at the end
                pack_linears(module, enable=False, keep=True)
            elif owed != before:  # whole parameters lent: packed now, while the sender fills the next bucket
                self._repack(selector, module, fp, owed, only=owed - before)
        finally:
            torch.set_num_threads(threads)
        self._timings["engine_map_s"] += t1 - t0
        self._timings["engine_load_s"] += t2 - t1
        self._timings["engine_pack_s"] += time.perf_counter() - t2
        seen.update(loaded)
        self._updating.setdefault(f"{selector}:version", set()).add(str(weight_version))
        return {"loaded": len(loaded)}

    def end_weight_update(self) -> dict[str, Any]:
        """Close the session: check it is complete, re-pack what changed, then report ``health()`` with the
        checksums of the updated groups computed afresh and ``sync_timings`` (seconds spent in this
        process)."""
        if self._updating is None:
            raise RuntimeError("end_weight_update without begin_weight_update")
        updating, self._updating = self._updating, None
        timings = self._timings
        if not self._keep_mapped:
            self._mapped = []
        t0 = time.perf_counter()
        for group in ("target", "draft"):
            names = updating.get(group)
            if names is None:
                continue
            module = self.target if group == "target" else self._draft_module()
            missing = module.expected_hf_names() - names
            if missing:
                self.versions[group] = None
                raise RuntimeError(f"{group} weight update incomplete: {len(missing)} tensors never arrived, "
                                   f"e.g. {sorted(missing)[:3]}")
            versions = updating[f"{group}:version"]
            if len(versions) != 1:
                raise RuntimeError(f"{group} weight update mixed versions {sorted(versions)}")
            self.versions[group] = versions.pop()
            fp = self._load_fingerprints.get(group)
            self._repack(group, module, fp, self._owed.pop(group, set()))
            # every parameter written once (names complete, none twice, every element): the sums taken while
            # loading are the checksum of what the group holds; otherwise health() counts them afresh
            if fp is not None and fp.numel == sum(p.numel() for p in module.parameters()):
                self._checksums[group] = fp.to_dict()
        for group in self._session_groups:  # groups opened but not sent keep their weights
            module = self.target if group == "target" else self._draft_module()
            if module is not None and group not in updating and self.versions[group] is not None:
                pack_linears(module)
        if "weights" in self._released and all(self.versions[g] is not None for g in ("target", "draft")
                                               if self._has_group(g)):
            self._released.discard("weights")
        t1 = time.perf_counter()
        out = self.health()  # the updated groups' checksums are computed here, the others' were kept
        timings["engine_repack_s"] = t1 - t0
        timings["engine_checksum_s"] = time.perf_counter() - t1
        out["sync_timings"] = timings
        return out

    def _repack(self, group: str, module: torch.nn.Module, fp: Fingerprint | None, owed: set[str],
                only: set[str] | None = None) -> None:
        """Pack ``module``'s linear layers not packed yet in this session (with ``only``: those whose weight
        is named there). A layer whose weight is ``owed`` (a view of a lent bucket, not summed while loading)
        adds its sums to ``fp`` on the way and leaves ``owed``; at the end of the session (``only`` None) what
        is still owed is summed in a pass of its own (a norm, a table no layer packs)."""
        layers = self._linears.get(group)
        if layers is None:
            layers = self._linears[group] = linear_layers(module)
        for layer, name in layers:
            if layer.is_packed or (only is not None and name not in only):
                continue
            if fp is not None and name in owed:
                owed.discard(name)
                layer.pack(sums=fp)
            else:
                layer.pack()
        if only is None and fp is not None and owed:
            for name, p in module.named_parameters():
                if name in owed:
                    fp.add(p.detach())

    def abort_weight_update(self) -> None:
        """Close a session whose update failed part-way: every group it touched is left without a
        version (``generate`` refuses until it is pushed again); groups it did not touch keep theirs."""
        if self._updating is None:
            return
        updating, self._updating = self._updating, None
        if not self._keep_mapped:
            self._mapped = []
        for group in self._session_groups:
            module = self.target if group == "target" else self._draft_module()
            if module is None:
                continue
            if group in updating:
                self.versions[group] = None
            elif self.versions[group] is not None:
                pack_linears(module)
