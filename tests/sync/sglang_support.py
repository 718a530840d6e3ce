"""Run SGLang 0.5.23's own code on CPU where its modules do not import, for the SGLang-backend tests.

Two things cannot be imported on this CPU machine (docs/design.md, "SGLang"):

* ``sglang.srt.managers.io_struct`` (the request objects): its import chain reaches model configs
  that register image processors needing torchvision, and communication kernels needing
  ``tvm_ffi``. :func:`io_struct_module` builds a module of that name from the *installed source*
  of exactly the request classes we use (``BaseReq`` and the weight-update / memory / checksum
  requests), so the objects we construct are SGLang's own msgspec Structs, field for field.
  It is installed in ``sys.modules`` only inside the tests that need it (a fixture).
* ``sglang.srt.models.{qwen3,qwen2,llama,llama_eagle3}`` (the weight loaders). :func:`loader`
  compiles the ``load_weights`` function from the installed source and runs it against
  :class:`FakeModel`, whose parameters record every ``weight_loader`` call. Any free name the
  function uses must be supplied explicitly, so a change in SGLang fails loudly here. A name the
  loader skips (``continue``, a warning, ``not in params_dict``) shows up as a tensor that
  reached no parameter.

Nothing is copied from SGLang: the source is read from the installed package at test time.
"""

from __future__ import annotations

import ast
import asyncio
import functools
import hashlib
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

_REQUESTS = ("BaseReq", "UpdateWeightsFromTensorReqInput", "UpdateWeightsFromTensorReqOutput",
             "BeginWeightUpdateReqInput", "EndWeightUpdateReqInput", "CheckWeightsReqInput",
             "ReleaseMemoryOccupationReqInput", "ResumeMemoryOccupationReqInput")


def sglang_root() -> str:
    spec = importlib.util.find_spec("sglang")
    return list(spec.submodule_search_locations)[0]


@functools.cache
def source(relpath: str) -> tuple[str, ast.Module]:
    path = os.path.join(sglang_root(), relpath)
    with open(path) as f:
        text = f.read()
    return text, ast.parse(text, filename=path)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(f"class {name} not found")


def _method(cls: ast.ClassDef, name: str) -> ast.FunctionDef:
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise LookupError(f"{cls.name}.{name} not found")


def init_attributes(relpath: str, class_name: str) -> set[str]:
    """``self.X = ...`` targets of ``class_name.__init__`` in an installed SGLang module."""
    _, tree = source(relpath)
    init = _method(_class(tree, class_name), "__init__")
    out = set()
    for node in ast.walk(init):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        flat = []
        for t in targets:
            flat += t.elts if isinstance(t, (ast.Tuple, ast.List)) else [t]
        for t in flat:
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                out.add(t.attr)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute):
                out.add(f"{ast.unparse(t.value).removeprefix('self.')}.{t.attr}")
    return out


def literal_assignment(relpath: str, class_name: str, method: str, variable: str) -> Any:
    """The literal value assigned to ``variable`` inside ``class_name.method`` (e.g. a mapping)."""
    _, tree = source(relpath)
    fn = _method(_class(tree, class_name), method)
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == variable for t in node.targets):
            return ast.literal_eval(node.value)
    raise LookupError(f"{variable} not assigned in {class_name}.{method}")


# ---------------------------------------------------------------------------- io_struct
def io_struct_module() -> types.ModuleType:
    """A ``sglang.srt.managers.io_struct`` module holding the installed source of our request classes."""
    import msgspec
    from sglang.srt.utils.msgspec_utils import Base64Bytes, msgspec_struct_pydantic_core_schema

    _, tree = source("srt/managers/io_struct.py")
    mod = types.ModuleType("sglang.srt.managers.io_struct")
    mod.__file__ = os.path.join(sglang_root(), "srt/managers/io_struct.py")
    import typing

    ns = mod.__dict__
    ns.update({n: getattr(typing, n) for n in ("Annotated", "Any", "Dict", "List", "Literal", "Optional", "Tuple",
                                               "Union")})
    ns.update(msgspec=msgspec, Base64Bytes=Base64Bytes,
              msgspec_struct_pydantic_core_schema=msgspec_struct_pydantic_core_schema)
    for name in _REQUESTS:
        cls = _class(tree, name)
        bases = {ast.unparse(b) for b in cls.bases}
        if not bases <= {"BaseReq", "msgspec.Struct"}:
            raise AssertionError(f"{name} now derives from {bases}: extend io_struct_module")
        code = compile(ast.Module(body=[cls], type_ignores=[]), mod.__file__, "exec",
                       flags=__import__("__future__").annotations.compiler_flag, dont_inherit=True)
        exec(code, ns)
    return mod


# ---------------------------------------------------------------------------- loaders
class Recorder(logging.Logger):
    def __init__(self):
        super().__init__("sglang-loader")
        self.warnings: list[str] = []

    def warning(self, msg, *args, **kwargs):
        self.warnings.append(msg % args if args else str(msg))


class FakeParam:
    """A parameter that records what SGLang's loader hands to its ``weight_loader``."""

    def __init__(self, name: str, store: dict, counts: dict):
        self.name, self.store, self.counts = name, store, counts

    def weight_loader(self, param, loaded_weight, shard_id=None):
        assert param is self
        key = (self.name, shard_id)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.store[key] = loaded_weight.detach().clone()


class FakeModel:
    """Just enough of an SGLang ``*ForCausalLM`` for its ``load_weights`` to run."""

    def __init__(self, param_names: Iterable[str], tie_word_embeddings: bool = False):
        self.store: dict[tuple[str, Any], torch.Tensor] = {}
        self.counts: dict[tuple[str, Any], int] = {}
        self._params = {n: FakeParam(n, self.store, self.counts) for n in param_names}
        self.config = types.SimpleNamespace(tie_word_embeddings=tie_word_embeddings)
        self.pp_group = types.SimpleNamespace(is_last_rank=True)
        self.model = types.SimpleNamespace()  # no start_layer: every layer is local

    def named_parameters(self):
        return iter(self._params.items())


def _default_weight_loader(param, loaded_weight):
    param.weight_loader(param, loaded_weight, None)


def _free_names(fn: ast.FunctionDef) -> set[str]:
    """Global names ``fn`` reads (loads that are neither bound inside it nor builtins)."""
    import builtins

    bound = {a.arg for a in fn.args.args + fn.args.kwonlyargs}
    loads, stores = set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (stores if isinstance(node.ctx, ast.Store) else loads).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            stores.update(a.asname or a.name.split(".")[0] for a in node.names)
    return loads - stores - bound - set(dir(builtins))


def _maybe_remap_kv_scale_name():
    """``maybe_remap_kv_scale_name`` compiled from the installed weight_utils source."""
    _, tree = source("srt/model_loader/weight_utils.py")
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "maybe_remap_kv_scale_name")
    ns: dict[str, Any] = {"Optional": __import__("typing").Optional, "print_warning_once": lambda *a, **k: None}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "weight_utils.py", "exec"), ns)
    return ns["maybe_remap_kv_scale_name"]


# Decorators that only tag the function (weight_utils.supports_quantized_rl_reload sets an attribute
# and returns the function unchanged).
_MARKER_DECORATORS = {"supports_quantized_rl_reload"}


def loader(relpath: str, class_name: str, method: str = "load_weights"):
    """SGLang's ``class_name.method`` compiled from the installed source, with its helpers.

    Returns ``(fn, logger)``: call ``fn(fake_model, weights)``; ``logger.warnings`` collects
    what the loader logged.
    """
    import copy

    from sglang.srt.layers.utils.common import get_layer_id
    from sglang.srt.utils import add_prefix

    _, tree = source(relpath)
    fn = copy.deepcopy(_method(_class(tree, class_name), method))
    decorators = {ast.unparse(d) for d in fn.decorator_list}
    if not decorators <= _MARKER_DECORATORS:
        raise AssertionError(f"{class_name}.{method} has decorators {sorted(decorators)}: check what they do")
    fn.decorator_list = []
    log = Recorder()
    import typing

    ns: dict[str, Any] = {n: getattr(typing, n) for n in ("Iterable", "Tuple", "List", "Optional", "Dict", "Any")}
    ns.update(torch=torch, logger=log, default_weight_loader=_default_weight_loader, get_layer_id=get_layer_id,
              add_prefix=add_prefix, maybe_remap_kv_scale_name=_maybe_remap_kv_scale_name())
    missing = _free_names(fn) - set(ns)
    if missing:
        raise AssertionError(f"{class_name}.{method} now uses {sorted(missing)}: supply them in tests/sync/sglang_support.py")
    exec(compile(ast.Module(body=[fn], type_ignores=[]), os.path.join(sglang_root(), relpath), "exec"), ns)
    return ns[method], log


# ---------------------------------------------------------------------------- a stand-in sglang.Engine
class FakeSGLangEngine:
    """What ``SGLangEngine`` talks to, with SGLang's own pieces where it matters.

    Payloads are read by SGLang's ``MultiprocessingSerializer`` (its allowlist unpickler) into its
    ``FlattenedTensorBucket``, and loaded by SGLang's loaders (:func:`loader`) into fake parameter
    stores, one per group, routed by the request's ``selector``. ``check_weights`` hashes a
    store (sha256 over names and bytes), standing in for SGLang's per-engine digest. Knobs:
    ``drop_draft`` acknowledges draft updates without loading them (the peers' silent bug).
    """

    def __init__(self, target_loader, target_params, draft_loader=None, draft_params=(), tie=False, **server_kwargs):
        from sglang.srt.managers import io_struct  # the module installed by the fixture

        self.io = io_struct
        self.kwargs = server_kwargs
        self.loop = asyncio.new_event_loop()
        self.requests: list[Any] = []
        self.models = {"target": FakeModel(target_params, tie)}
        self.loaders = {"target": target_loader}
        if draft_loader is not None:
            self.models["draft"] = FakeModel(draft_params)
            self.loaders["draft"] = draft_loader
        self.version = server_kwargs.get("weight_version", "default")
        if server_kwargs.get("load_format", "auto") == "auto":  # start-up load from disk, as SGLang does
            target_loader(self.models["target"], _safetensors(server_kwargs["model_path"]))
        draft_path = server_kwargs.get("speculative_draft_model_path")
        if draft_loader is not None and draft_path and server_kwargs.get("speculative_draft_load_format") in (None,
                                                                                                             "auto"):
            draft_loader(self.models["draft"], _safetensors(draft_path))  # d2t included: read once, here
        self.drop_draft = False
        self.session = None
        self.shut = False
        self.generated: list[dict] = []
        self.tokenizer_manager = _FakeTM(self)

    def get_model_info(self) -> dict:
        return {"weight_version": self.version}

    def shutdown(self) -> None:
        self.shut = True

    def digest(self, group: str, skip: Iterable[str] = ()) -> str:
        h = hashlib.sha256()
        for (name, shard), t in sorted(self.models[group].store.items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
            if any(s in name for s in skip):
                continue
            h.update(f"{name}:{shard}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def generate(self, input_ids, sampling_params, return_logprob):
        assert return_logprob is True
        outs = []
        for ids, sp in zip(input_ids, sampling_params):
            n = sp["max_new_tokens"]
            toks = [(sum(ids) + j) % 50 + 4 for j in range(n)]
            meta = {"finish_reason": {"type": "length", "length": n}, "completion_tokens": n,
                    "output_token_logprobs": [(-0.5 - 0.01 * j, t, None) for j, t in enumerate(toks)],
                    "weight_version": self.version}
            if self.kwargs.get("speculative_algorithm") and n > 1:
                # a verify step emits accepted drafts + 1; the prefill emitted the first token
                k = self.kwargs["speculative_num_steps"]
                left, hist = n - 1, [0] * (k + 1)
                while left > 0:
                    acc = min(k, left - 1, 2)
                    hist[acc] += 1
                    left -= acc + 1
                meta.update(spec_verify_ct=sum(hist), spec_correct_drafts_histogram=hist)
            outs.append({"output_ids": toks, "meta_info": meta})
        self.generated.append({"input_ids": input_ids, "sampling_params": sampling_params})
        return outs


class _FakeTM:
    def __init__(self, eng: FakeSGLangEngine):
        self.eng = eng

    async def begin_weight_update(self, obj, request):
        assert isinstance(obj, self.eng.io.BeginWeightUpdateReqInput)
        self.eng.requests.append(obj)
        if self.eng.session is not None:
            return False, "a weight-update session is already open"
        self.eng.session = obj.selector
        return True, "Success"

    async def end_weight_update(self, obj, request):
        assert isinstance(obj, self.eng.io.EndWeightUpdateReqInput)
        self.eng.requests.append(obj)
        if self.eng.session is None:
            return False, "no weight-update session is open"
        self.eng.session = None
        return True, "Success"

    async def update_weights_from_tensor(self, obj, request):
        from sglang.srt.utils.common import MultiprocessingSerializer
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

        eng = self.eng
        assert isinstance(obj, eng.io.UpdateWeightsFromTensorReqInput)
        eng.requests.append(obj)
        if eng.session is None:
            return False, "update_weights_from_tensor must run between begin and end"
        data = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[0])  # rank 0's own payload
        bucket = FlattenedTensorBucket(flattened_tensor=data["flattened_tensor"], metadata=data["metadata"])
        named = bucket.reconstruct_tensors()
        groups = ["target", "draft"] if obj.selector == "all" else [obj.selector]
        for g in groups:
            if g == "draft" and eng.drop_draft:
                continue
            if g in eng.models:
                eng.loaders[g](eng.models[g], named)
        if obj.weight_version is not None:
            eng.version = obj.weight_version
        return True, "Success"

    async def check_weights(self, obj, request):
        assert isinstance(obj, self.eng.io.CheckWeightsReqInput) and obj.action == "checksum"
        return True, "Success.", [], self.eng.digest(obj.selector, obj.skip_tensor_list or ())

    async def release_memory_occupation(self, obj, request):
        assert isinstance(obj, self.eng.io.ReleaseMemoryOccupationReqInput)
        if "weights" in obj.tags:  # the memory is handed back: contents are gone
            for m in self.eng.models.values():
                for key, t in m.store.items():
                    m.store[key] = torch.full_like(t, 7) if t.is_floating_point() else t

    async def resume_memory_occupation(self, obj, request):
        assert isinstance(obj, self.eng.io.ResumeMemoryOccupationReqInput)


def _safetensors(path: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    out = []
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out += sorted(load_file(os.path.join(path, f)).items())
    return out


def install_io_struct(monkeypatch) -> types.ModuleType:
    mod = io_struct_module()
    monkeypatch.setitem(sys.modules, "sglang.srt.managers.io_struct", mod)
    from sglang.srt import managers

    monkeypatch.setattr(managers, "io_struct", mod, raising=False)
    return mod
