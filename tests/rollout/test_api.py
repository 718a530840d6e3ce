"""Both engines implement ``RolloutEngine`` member by member (signatures included), both online
draft trainers ``DraftLearner``, and the weight path's stand-ins ``WeightReceiver``; and no library
code probes an engine or a draft learner with ``getattr``/``hasattr``."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from megatron_spec.draft.mtp import MtpTrainer
from megatron_spec.draft.trainer import Eagle3Trainer
from megatron_spec.interfaces import DraftLearner, RolloutEngine, WeightReceiver
from megatron_spec.rollout.native.client import NativeEngine
from megatron_spec.rollout.sglang_backend import SGLangEngine
from megatron_spec.rollout.vllm_backend import VllmEngine
from megatron_spec.sync.forward import PayloadForwarder, PayloadGather

ROOT = Path(__file__).resolve().parents[2]


def protocol_methods(proto: type) -> dict[str, inspect.Signature]:
    """Every method a Protocol declares (its own and its bases'), with its signature."""
    out = {}
    for klass in reversed(proto.__mro__):
        if klass is object or not getattr(klass, "_is_protocol", False):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_"):
                continue
            fn = value.fget if isinstance(value, property) else value
            if inspect.isfunction(fn):
                out[name] = inspect.signature(fn)
    return out


def protocol_attributes(proto: type) -> set[str]:
    return {name for klass in proto.__mro__ if getattr(klass, "_is_protocol", False)
            for name in getattr(klass, "__annotations__", {})}


def test_protocol_methods_reads_the_declared_members():
    names = set(protocol_methods(RolloutEngine))
    assert {"generate", "set_speculation", "release_memory", "resume_memory", "shutdown", "is_alive",
            "begin_weight_update", "update_weights_from_tensor", "end_weight_update", "abort_weight_update",
            "remember_draft", "startup_fingerprint", "lent_panel_names", "health"} == names
    assert {"backend", "config", "info", "checksum_kind", "tp_size", "digest_ledger"} <= protocol_attributes(
        RolloutEngine)
    assert {"module", "capture_config", "train_step", "evaluate", "named_update_tensors", "export",
            "state_dict", "load_state_dict"} == set(protocol_methods(DraftLearner))


@pytest.mark.parametrize("engine", [NativeEngine, SGLangEngine, VllmEngine])
def test_engine_implements_the_protocol_member_by_member(engine):
    assert RolloutEngine in engine.__mro__  # declared, not just shaped alike
    for name, sig in protocol_methods(RolloutEngine).items():
        mine = getattr(engine, name)
        assert inspect.signature(mine) == sig, f"{engine.__name__}.{name}{inspect.signature(mine)} != {sig}"
    # what has no default in the Protocol, the engine writes itself
    for name in ("generate", "set_speculation", "release_memory", "resume_memory", "shutdown", "is_alive",
                 "begin_weight_update", "update_weights_from_tensor", "end_weight_update",
                 "abort_weight_update", "health"):
        owner = next(k for k in engine.__mro__ if name in vars(k))  # itself, or ProcessEngine's shared calls
        assert not getattr(owner, "_is_protocol", False), (
            f"{engine.__name__} inherits {name} from the Protocol"
        )
    assert engine.backend in ("native", "sglang", "vllm")


def test_the_engines_differ_only_where_they_should():
    assert NativeEngine.checksum_kind == "fingerprint" and SGLangEngine.checksum_kind == "digest"
    assert VllmEngine.checksum_kind == "fingerprint"  # what vLLM's worker loaded, fingerprinted there
    for name in ("remember_draft", "startup_fingerprint"):  # SGLang loses its draft on a release
        assert name in vars(SGLangEngine) and name not in vars(NativeEngine) and name not in vars(VllmEngine)


@pytest.mark.parametrize("learner", [Eagle3Trainer, MtpTrainer])
def test_draft_trainer_implements_the_protocol_member_by_member(learner):
    for name, sig in protocol_methods(DraftLearner).items():
        assert name in dir(learner), f"{learner.__name__} lacks {name}"
        value = inspect.getattr_static(learner, name)
        if name == "module":
            assert isinstance(value, property)
            continue
        mine = list(inspect.signature(value).parameters.values())
        theirs = list(sig.parameters.values())
        # the Protocol's parameters (names, kinds, defaults), then only optional ones
        assert [(p.name, p.kind, p.default) for p in mine[:len(theirs)]] == \
            [(p.name, p.kind, p.default) for p in theirs], f"{learner.__name__}.{name}"
        assert all(p.default is not inspect.Parameter.empty for p in mine[len(theirs) :]), (
            f"{learner.__name__}.{name}"
        )


@pytest.mark.parametrize("receiver", [PayloadGather, PayloadForwarder])
def test_weight_path_stand_ins_are_receivers(receiver):
    assert WeightReceiver in receiver.__mro__
    for name, sig in protocol_methods(WeightReceiver).items():
        mine = inspect.signature(getattr(receiver, name))
        assert [p.name for p in mine.parameters.values()] == [p.name for p in sig.parameters.values()], name


PROBED = {"engine", "draft_trainer", "receiver"}


def probes(path: Path) -> list[str]:
    """``getattr``/``hasattr`` calls whose first argument is an engine or a draft learner
    (``self.engine``, ``engine``, ``self.draft_trainer``, ...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
        ):
            target = node.args[0] if node.args else None
            name = (
                target.attr
                if isinstance(target, ast.Attribute)
                else target.id
                if isinstance(target, ast.Name)
                else None
            )
            if name in PROBED or (isinstance(target, ast.Attribute) and target.attr.endswith("engine")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_library_code_probes_engines_or_draft_learners():
    hits = [h for p in sorted((ROOT / "megatron_spec").rglob("*.py")) for h in probes(p)]
    assert hits == []


def test_probes_finds_a_probe(tmp_path):
    src = tmp_path / "x.py"
    src.write_text(
        "def f(self):\n    return getattr(self.engine, 'tp_size', 1) + hasattr(draft_trainer, 'x')\n"
    )
    global ROOT
    old, ROOT = ROOT, tmp_path
    try:
        assert probes(src) == ["x.py:2", "x.py:2"]
    finally:
        ROOT = old
