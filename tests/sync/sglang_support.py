"""Run SGLang 0.5.23's own code on CPU for the SGLang-backend tests.

* :func:`srt` imports SGLang's server-args resolution, model configs, request objects
  (``io_struct``), the scheduler's weight updater, the weight checker and model classes for real
  (what their import chain needs on CPU: below).
* ``sglang.srt.models.{qwen3,qwen2,llama,llama_eagle3}``'s weight loaders need built models
  (CUDA layers). :func:`loader` compiles the ``load_weights`` function from the installed source
  and runs it against :class:`FakeModel`, whose parameters record every ``weight_loader`` call.
  Any free name the function uses must be supplied explicitly, so a change in SGLang fails loudly
  here. A name the loader skips (``continue``, a warning, ``not in params_dict``) shows up as a
  tensor that reached no parameter.
* :class:`FakeSGLangEngine` stands in for ``sglang.Engine`` (it needs a GPU) and runs SGLang's
  code for what the backend depends on: the launch arguments go through SGLang's resolution
  (``ServerArgs.resolve_once``: a refused combination raises as at launch), the target's and the
  draft's load formats come from SGLang's ``build_load_config``, release/resume go through the
  scheduler's ``SchedulerWeightUpdaterManager`` and checksums are SGLang's ``WeightChecker`` digests.

Nothing is copied from SGLang: the source is read from the installed package at test time.

The import chain of ``sglang.srt`` needs torchvision, and no CPU torchvision is on PyPI (its Linux
wheels link ``libtorch_cuda``; with a CPU torch, torchvision 0.28 then fails at import registering
``torchvision::nms``). :func:`srt` imports the modules with a stand-in ``torchvision`` on the import path
(only multimodal
config modules name it, at import time) and with ``sglang.srt.configs.utils.register_image_processor``
a no-op (it registers SGLang's multimodal image processors with transformers, which asks for
torchvision). The rest of the chain is installed on CPU (requirements/sglang-cpu-deps.txt).
"""

from __future__ import annotations

import ast
import asyncio
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from collections.abc import Iterable
from typing import Any

import torch


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
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == variable for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise LookupError(f"{variable} not assigned in {class_name}.{method}")


# ---------------------------------------------------------------------------- importing sglang.srt on CPU
class _Absent:
    """What a torchvision name stands for while SGLang's multimodal modules are imported."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        return _Absent(f"{self._name}()")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self) -> str:
        return f"<torchvision stand-in {self._name}>"


class _AbsentModule(types.ModuleType):
    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self.__name__}.{attr}")


class _TorchvisionStandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _AbsentModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module) -> None:
        pass


_SRT_MODULES = ("sglang.srt.server_args", "sglang.srt.arg_groups.pipeline", "sglang.srt.arg_groups.overrides",
                "sglang.srt.configs.model_config", "sglang.srt.managers.io_struct",
                "sglang.srt.managers.scheduler_components.weight_updater",
                "sglang.srt.model_executor.model_runner_components.load_model_utils",
                "sglang.srt.models.qwen3", "sglang.srt.models.qwen2", "sglang.srt.models.llama",
                "sglang.srt.models.llama_eagle3")


@functools.cache
def srt() -> dict[str, types.ModuleType]:
    """SGLang's own modules the contract tests drive, imported for real (see the module docstring)."""
    # before the stand-in: its import-time transformers patches must see no torchvision
    importlib.import_module("sglang")

    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        raise AssertionError("a torchvision is installed: import SGLang with it and drop the stand-in")
    if "sglang.srt.configs" not in sys.modules:
        path = os.path.join(sglang_root(), "srt/configs/utils.py")
        spec = importlib.util.spec_from_file_location("sglang.srt.configs.utils", path)
        utils = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(utils)
        utils.register_image_processor = lambda *args, **kwargs: None
        sys.modules["sglang.srt.configs.utils"] = utils
    finder = _TorchvisionStandIn()
    sys.meta_path.insert(0, finder)
    try:
        mods = {name: importlib.import_module(name) for name in _SRT_MODULES}
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]  # SGLang's modules keep their references; nothing else sees a torchvision
        from transformers.utils import import_utils

        import_utils.is_torchvision_available.cache_clear()
    return mods


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
    fn = next(
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "maybe_remap_kv_scale_name"
    )
    ns: dict[str, Any] = {
        "Optional": __import__("typing").Optional,
        "print_warning_once": lambda *a, **k: None,
    }
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "weight_utils.py", "exec"), ns)
    return ns["maybe_remap_kv_scale_name"]


# Decorators that only tag the function (weight_utils.supports_quantized_rl_reload sets an attribute
# and returns the function unchanged).
_MARKER_DECORATORS = {"supports_quantized_rl_reload"}


def loader(relpath: str, class_name: str, method: str = "load_weights", *, weight_loader=None):
    """SGLang's ``class_name.method`` compiled from the installed source, with its helpers.

    Returns ``(fn, logger)``: call ``fn(fake_model, weights)``; ``logger.warnings`` collects
    what the loader logged. ``weight_loader`` replaces the ``default_weight_loader`` the loader
    uses for parameters without one (SGLang's own for real parameters: :class:`ShardedQwen3`).
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

    ns: dict[str, Any] = {
        n: getattr(typing, n) for n in ("Iterable", "Tuple", "List", "Optional", "Dict", "Any")
    }
    ns.update(torch=torch, logger=log, default_weight_loader=weight_loader or _default_weight_loader,
              get_layer_id=get_layer_id,
              add_prefix=add_prefix, maybe_remap_kv_scale_name=_maybe_remap_kv_scale_name())
    missing = _free_names(fn) - set(ns)
    if missing:
        raise AssertionError(
            f"{class_name}.{method} now uses {sorted(missing)}: supply them in tests/sync/sglang_support.py"
        )
    exec(compile(ast.Module(body=[fn], type_ignores=[]), os.path.join(sglang_root(), relpath), "exec"), ns)
    return ns[method], log


# ---------------------------------------------------------------------------- a stand-in sglang.Engine
class SchedulerDied(RuntimeError):
    """What SGLang's scheduler does on an exception in a control request: it sends SIGQUIT to
    its parent (the trainer) and the run is gone."""


class _MemorySaver:
    """The GPU part of ``TorchMemorySaverAdapter``: pause drops what a tag holds, resume re-maps it."""

    def __init__(self, eng: FakeSGLangEngine):
        self.eng = eng
        self.paused: set[str] = set()
        self.calls: list[tuple[str, str]] = []

    def pause(self, tag: str) -> None:
        assert tag not in self.paused, f"{tag} paused twice"
        self.paused.add(tag)
        self.calls.append(("pause", tag))
        if tag == "weights":  # the memory is handed back: contents are gone
            for m in self.eng.models.values():
                for key, t in m.store.items():
                    m.store[key] = torch.full_like(t, 7) if t.is_floating_point() else t

    def resume(self, tag: str) -> None:
        assert tag in self.paused, f"{tag} resumed without a pause"
        self.paused.discard(tag)
        self.calls.append(("resume", tag))


def _module_from_store(model: FakeModel) -> torch.nn.Module:
    """An ``nn.Module`` with SGLang's parameter layout for what ``model``'s loader received:
    stacked shards (q, k, v / gate, up) concatenated in shard order, as TP=1 weight loaders do."""
    order = {"q": 0, "k": 1, "v": 2, 0: 0, 1: 1, None: 0}
    grouped: dict[str, list[tuple[Any, torch.Tensor]]] = {}
    for (name, shard), t in model.store.items():
        grouped.setdefault(name, []).append((shard, t))
    root = torch.nn.Module()
    for name, parts in grouped.items():
        t = (
            torch.cat([t for _, t in sorted(parts, key=lambda st: order[st[0]])])
            if len(parts) > 1
            else parts[0][1]
        )
        *path, leaf = name.split(".")
        mod = root
        for piece in path:
            if not hasattr(mod, piece):
                mod.add_module(piece, torch.nn.Module())
            mod = getattr(mod, piece)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root


class FakeSGLangEngine:
    """What ``SGLangEngine`` talks to, with SGLang's own code wherever SGLang decides.

    * Launch: the keyword arguments go through ``ServerArgs(**kw).resolve_once()`` (SGLang's
      validation; ``device`` defaults to "cuda", the GPU SGLang would detect) and are published as
      the process's runtime config, as SGLang's scheduler does.
    * Start-up load: the target and the draft runner each get SGLang's ``build_load_config``
      (the draft with ``speculative_draft_load_format``, as ``ModelRunner._resolve_draft_load_format``
      reads it); "dummy" fills the draft with random values and no ``d2t`` (its ``hot_token_id``
      stays None, as SGLang's EAGLE worker then sees it), anything else runs the loader on the
      checkpoint.
    * Weight updates: payloads are read by SGLang's ``MultiprocessingSerializer`` (its allowlist
      unpickler) into its ``FlattenedTensorBucket`` and loaded by SGLang's loaders (:func:`loader`)
      into fake parameter stores, one per group, routed by the request's ``selector``.
    * ``release/resume_memory_occupation``: SGLang's ``SchedulerWeightUpdaterManager`` with a
      stand-in memory saver; an exception there is :class:`SchedulerDied`.
    * ``check_weights`` (checksum): SGLang's ``WeightChecker`` digest of the group's parameters.

    ``drop_draft`` acknowledges draft updates without loading them (the peers' silent bug).
    """

    def __init__(
        self, target_loader, target_params, draft_loader=None, draft_params=(), tie=False, **server_kwargs
    ):
        mods = srt()
        from sglang.srt.runtime_context import SpawnRanks, get_spec, publish

        self.io = mods["sglang.srt.managers.io_struct"]
        self.kwargs = server_kwargs
        self.server_args = mods["sglang.srt.server_args"].ServerArgs(**{"device": "cuda", **server_kwargs})
        self.server_args.resolve_once()  # what sglang.Engine runs first: refuses what SGLang refuses
        publish(self.server_args, role="scheduler", ranks=SpawnRanks(world_rank=0))
        self.loop = asyncio.new_event_loop()
        self.requests: list[Any] = []
        self.models = {"target": FakeModel(target_params, tie)}
        self.loaders = {"target": target_loader}
        if draft_loader is not None:
            self.models["draft"] = FakeModel(draft_params)
            self.loaders["draft"] = draft_loader
        self.version = server_kwargs.get("weight_version", "default")
        self.load_formats = {"target": self._load_format(None)}
        if self.load_formats["target"] != "dummy":
            target_loader(self.models["target"], _safetensors(server_kwargs["model_path"]))
        draft_path = server_kwargs.get("speculative_draft_model_path")
        if draft_loader is not None and draft_path:
            self.load_formats["draft"] = self._load_format(get_spec().speculative_draft_load_format)
            weights = _safetensors(draft_path)
            if self.load_formats["draft"] == "dummy":  # random values, and no d2t
                g = torch.Generator().manual_seed(0)
                weights = [
                    (n, torch.rand(t.shape, generator=g).to(t.dtype)) for n, t in weights if n != "d2t"
                ]
            draft_loader(self.models["draft"], weights)  # d2t (if read) sets hot_token_id: once, here
        self.memory_saver = _MemorySaver(self)
        self.updater = self._weight_updater(mods["sglang.srt.managers.scheduler_components.weight_updater"])
        self.drop_draft = False
        self.payload_counts: list[int] = []  # len(serialized_named_tensors) per update
        self.session = None
        self.shut = False
        self.dead: BaseException | None = None
        self.generated: list[dict] = []
        self.tokenizer_manager = _FakeTM(self)

    def _load_format(self, runner_format: str | None) -> str:
        """The load format SGLang's ``build_load_config`` gives a runner launched with ``runner_format``."""
        lmu = srt()["sglang.srt.model_executor.model_runner_components.load_model_utils"]
        fmt = lmu.build_load_config(server_args=self.server_args, tp_rank=0, load_format=runner_format,
                                    remote_instance_weight_transporter_engine=None,
                                    remote_instance_weight_transporter_session_id="", draft_model_idx=None,
                                    weight_cache_mode="off", weight_cache_socket=None).load_format
        return str(getattr(fmt, "value", fmt))

    def _weight_updater(self, wu):
        """SGLang's scheduler-side manager; its TP group is a one-rank gloo group on CPU."""
        from unittest import mock

        import torch.distributed as dist

        self._own_group = not dist.is_initialized()
        if self._own_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        parallel = types.SimpleNamespace(tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD))
        runner = types.SimpleNamespace(model=torch.nn.Module())
        with mock.patch.object(wu, "get_parallel", lambda: parallel):
            return wu.SchedulerWeightUpdaterManager(
                tp_worker=types.SimpleNamespace(model_runner=runner), draft_worker=None,
                memory_saver_adapter=self.memory_saver, flush_cache=lambda **kw: True,
                is_fully_idle=lambda **kw: True)

    def get_model_info(self) -> dict:
        return {"weight_version": self.version}

    def shutdown(self) -> None:
        import torch.distributed as dist

        self.shut = True
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_group = False

    def digest(self, group: str, skip: Iterable[str] = ()) -> str:
        """SGLang's checksum of ``group`` (``WeightChecker``, merged as the scheduler merges roles)."""
        from sglang.srt.managers.scheduler_components.weight_updater import _merge_checksum_payloads
        from sglang.srt.utils.weight_checker import WeightChecker

        module = _module_from_store(self.models[group])
        payload = WeightChecker(get_model=lambda: module).handle(
            "checksum", skip_tensor_list=list(skip) or None, role=group
        )
        return _merge_checksum_payloads([(group, payload)])["per_gpu_checksum"]

    def generate(self, input_ids, sampling_params, return_logprob):
        assert return_logprob is True
        if self.dead is not None:
            raise SchedulerDied(f"the SGLang scheduler is gone: {self.dead!r}")
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
        tp_size = self.eng.server_args.tp_size
        # SGLang: IndexError in a rank's scheduler, which dies
        if len(obj.serialized_named_tensors) < tp_size:
            eng.dead = IndexError(f"serialized_named_tensors has {len(obj.serialized_named_tensors)} entries")
            raise SchedulerDied(
                f"SGLang scheduler of TP rank {len(obj.serialized_named_tensors)} died: {eng.dead!r}"
            )
        per_rank = []  # each TP rank deserialises its own entry (TpModelWorker.deserialize_own_rank)
        for rank in range(tp_size):
            data = MultiprocessingSerializer.deserialize(obj.serialized_named_tensors[rank])
            bucket = FlattenedTensorBucket(
                flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
            )
            per_rank.append(bucket.reconstruct_tensors())
        eng.payload_counts.append(len(obj.serialized_named_tensors))
        named = per_rank[0]  # TP=1 loaders and stores: every rank must have received the same tensors
        for rank, other in enumerate(per_rank[1:], 1):
            assert [n for n, _ in other] == [n for n, _ in named] and all(
                torch.equal(a, b) for (_, a), (_, b) in zip(other, named)
            ), f"TP rank {rank} got other tensors"
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

    def _scheduler(self, method: str, obj):
        eng = self.eng
        if eng.dead is not None:
            raise SchedulerDied(f"the SGLang scheduler is gone: {eng.dead!r}")
        try:
            return getattr(eng.updater, method)(obj)
        except Exception as exc:  # the scheduler's event loop dies, and takes its parent with it
            eng.dead = exc
            raise SchedulerDied(f"SGLang scheduler died in {method}: {exc!r}") from exc

    async def release_memory_occupation(self, obj, request):
        assert isinstance(obj, self.eng.io.ReleaseMemoryOccupationReqInput)
        self.eng.requests.append(obj)
        return self._scheduler("release_memory_occupation", obj)

    async def resume_memory_occupation(self, obj, request):
        assert isinstance(obj, self.eng.io.ResumeMemoryOccupationReqInput)
        self.eng.requests.append(obj)
        return self._scheduler("resume_memory_occupation", obj)


def _safetensors(path: str) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    out = []
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out += sorted(load_file(os.path.join(path, f)).items())
    return out


def install_io_struct(monkeypatch=None) -> types.ModuleType:
    """SGLang's ``io_struct`` (imported for real by :func:`srt`)."""
    return srt()["sglang.srt.managers.io_struct"]


# ---------------------------------------------------------------------------- one SGLang TP rank on CPU
def publish_tp_rank(server_args, tp_rank: int, gpu_id: int) -> None:
    """Make this process SGLang's scheduler of ``tp_rank`` (``get_parallel().tp_rank`` etc.), as
    SGLang's launcher does for each spawned scheduler (``runtime_context.publish``)."""
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank

    world_rank = spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0)
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank, gpu_id=gpu_id))


def _compiled_methods(relpath: str, names: Iterable[tuple[str, str]], ns: dict[str, Any]) -> dict[str, Any]:
    """``(class, method)`` of an installed SGLang module compiled from its source with the globals in
    ``ns``."""
    _, tree = source(relpath)
    out = {}
    for class_name, name in names:
        fn = _method(_class(tree, class_name), name)
        missing = _free_names(fn) - set(ns)
        if missing:
            raise AssertionError(
                f"{class_name}.{name} now uses {sorted(missing)}: supply them in sglang_support.py"
            )
        scope = dict(ns)
        exec(
            compile(ast.Module(body=[fn], type_ignores=[]), os.path.join(sglang_root(), relpath), "exec"),
            scope,
        )
        out[name] = scope[name]
    return out


class CountingSerializer:
    """SGLang's ``MultiprocessingSerializer``, recording which payload each call deserialised."""

    def __init__(self):
        from sglang.srt.utils.common import MultiprocessingSerializer

        self._real = MultiprocessingSerializer
        self.calls: list[bytes] = []

    def deserialize(self, data, *args, **kwargs):
        self.calls.append(data)
        return self._real.deserialize(data, *args, **kwargs)


def tp_worker_class(serializer: CountingSerializer) -> type:
    """SGLang's ``TpModelWorker`` for weight updates: its own ``deserialize_own_rank`` and
    ``weight_update_runners``, compiled from srt/managers/tp_worker.py (the module's import chain
    needs ``setproctitle`` / ``uvloop``, which the CPU install lacks)."""
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    ns = {"MultiprocessingSerializer": serializer, "get_parallel": get_parallel,
          "monkey_patch_torch_reductions": monkey_patch_torch_reductions, "List": list, "Tuple": tuple,
          "ModelRunner": object}
    methods = _compiled_methods("srt/managers/tp_worker.py", (("BaseTpWorker", "deserialize_own_rank"),
                                                              ("TpModelWorker", "weight_update_runners")), ns)

    def __init__(self, model_runner):
        self._model_runner = model_runner

    return type("TpModelWorkerWeights", (), {"__init__": __init__, **methods})


class ShardedQwen3(torch.nn.Module):
    """SGLang's ``Qwen3ForCausalLM`` parameters at the published TP rank, built from SGLang's own
    parallel layers (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
    ``VocabParallelEmbedding``, ``ParallelLMHead``, ``RMSNorm``) with their own ``weight_loader``s;
    ``load_weights`` is SGLang's Qwen3 loader. Attention kernels and rotary embeddings (no
    parameters, GPU code) are left out: the whole model cannot be built on CPU (its rotary
    embedding asks for vLLM's kernel there)."""

    def __init__(self, hf_config: dict, dtype: torch.dtype = torch.float32):
        super().__init__()
        from sglang.srt.layers.layernorm import RMSNorm
        from sglang.srt.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
        from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
        from sglang.srt.model_loader.weight_utils import default_weight_loader

        c = hf_config
        h, head_dim, heads, kv = (
            c["hidden_size"],
            c["head_dim"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
        )
        inter, vocab = c["intermediate_size"], c["vocab_size"]
        self.config = types.SimpleNamespace(tie_word_embeddings=c["tie_word_embeddings"])
        self.pp_group = types.SimpleNamespace(is_last_rank=True)
        self.model = torch.nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(vocab, h, params_dtype=dtype)
        self.model.layers = torch.nn.ModuleList()
        for _ in range(c["num_hidden_layers"]):
            layer = torch.nn.Module()
            layer.self_attn = torch.nn.Module()
            layer.self_attn.qkv_proj = QKVParallelLinear(
                h, head_dim, heads, kv, bias=False, params_dtype=dtype
            )
            layer.self_attn.o_proj = RowParallelLinear(heads * head_dim, h, bias=False, params_dtype=dtype)
            layer.self_attn.q_norm = RMSNorm(head_dim, weight_dtype=dtype)
            layer.self_attn.k_norm = RMSNorm(head_dim, weight_dtype=dtype)
            layer.mlp = torch.nn.Module()
            layer.mlp.gate_up_proj = MergedColumnParallelLinear(
                h, [inter, inter], bias=False, params_dtype=dtype
            )
            layer.mlp.down_proj = RowParallelLinear(inter, h, bias=False, params_dtype=dtype)
            layer.input_layernorm = RMSNorm(h, weight_dtype=dtype)
            layer.post_attention_layernorm = RMSNorm(h, weight_dtype=dtype)
            self.model.layers.append(layer)
        self.model.norm = RMSNorm(h, weight_dtype=dtype)
        if not c["tie_word_embeddings"]:
            self.lm_head = ParallelLMHead(vocab, h, params_dtype=dtype)
        for p in self.parameters():  # SGLang allocates with torch.empty: make unloaded values visible
            p.data.fill_(float("nan"))
        self.received: list[tuple[str, torch.Tensor]] = []  # what load_weights was handed
        fn, self.log = loader("srt/models/qwen3.py", "Qwen3ForCausalLM", weight_loader=default_weight_loader)
        self._load = fn

    def load_weights(self, weights):
        weights = list(weights)
        self.received += weights
        return self._load(self, weights)


class TpRank:
    """One SGLang TP rank's weight-update path, SGLang's code from the request to the layers:
    the scheduler's ``SchedulerWeightUpdaterManager`` -> ``TpModelWorker.deserialize_own_rank``
    (:func:`tp_worker_class`) -> the model runner's ``WeightUpdater.update_weights_from_tensor``
    (flattened bucket: ``FlattenedTensorBucket.reconstruct_tensors``) -> :class:`ShardedQwen3`.

    Stand-ins: the TP CPU group is a one-process gloo group (the ranks run one after another
    here, so its barrier has no one to wait for), cache flushing always succeeds, the scheduler
    only records weight versions, and the model-runner fields a CPU load does not read
    (model config, CUDA-graph recapture) are None.
    """

    def __init__(self, server_args, tp_rank: int, gpu_id: int, hf_config: dict,
                 dtype: torch.dtype = torch.float32):
        import torch.distributed as dist
        from sglang.srt.managers.scheduler_components.weight_updater import SchedulerWeightUpdaterManager
        from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater
        from sglang.srt.runtime_context import get_parallel

        publish_tp_rank(server_args, tp_rank, gpu_id)
        self.tp_rank, self.gpu_id = tp_rank, gpu_id
        self.model = ShardedQwen3(hf_config, dtype)
        self.serializer = CountingSerializer()
        runner = types.SimpleNamespace()
        runner.weight_updater = WeightUpdater(
            tp_rank=tp_rank, device="cpu", gpu_id=gpu_id, model_config=None, custom_weight_loaders={},
            get_model=lambda: self.model, update_model_fields=None, recapture_cuda_graph=None,
            get_model_runner=lambda: runner)
        self.versions: list[str | None] = []
        self._own_group = not dist.is_initialized()
        if self._own_group:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        with get_parallel().override(tp_group=types.SimpleNamespace(cpu_group=dist.group.WORLD)):
            self.manager = SchedulerWeightUpdaterManager(
                tp_worker=tp_worker_class(self.serializer)(runner),
                draft_worker=None,
                memory_saver_adapter=None,
                flush_cache=lambda **kw: True,
                is_fully_idle=lambda **kw: True,
                scheduler=types.SimpleNamespace(
                    record_weight_version_change=lambda new_version: self.versions.append(new_version)
                ),
            )

    def handle(self, obj):
        """What this rank's scheduler does with a request object (as ``_request_dispatcher`` routes it)."""
        io = srt()["sglang.srt.managers.io_struct"]
        # the tokenizer -> scheduler hop (sock_send / sock_recv)
        obj = io.msgpack_decode(io.msgpack_encode(obj))
        method = {"BeginWeightUpdateReqInput": "begin_weight_update",
                  "UpdateWeightsFromTensorReqInput": "update_weights_from_tensor"}[type(obj).__name__]
        return getattr(self.manager, method)(obj)

    def close(self) -> None:
        import torch.distributed as dist

        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()
        self._own_group = False


def undo_torch_reduction_patch() -> None:
    """Undo SGLang's ``monkey_patch_torch_reductions`` in this process (its TP worker code applies
    it, for good): afterwards every CPU tensor pickled by a plain ``ForkingPickler`` fails, which
    would break unrelated tests later in the session."""
    import torch.multiprocessing.reductions as reductions

    if hasattr(reductions, "_reduce_tensor_original"):
        reductions.reduce_tensor = reductions._reduce_tensor_original
        reductions.rebuild_cuda_tensor = reductions._rebuild_cuda_tensor_original
        del reductions._reduce_tensor_original, reductions._rebuild_cuda_tensor_original
        reductions.init_reductions()
