"""The packed linears' panels on huge pages (``layers.panel_memory``, ``host_memory.huge_page_memory``): the
mapping is new, 2 MiB aligned and backed by huge pages where the kernel's setting allows; the panels moved
there compute the same numbers bit for bit; a weight update re-packs into them in place; a release frees them
and the next placement moves the new ones; lent panels stay where they are; ``MEGATRON_SPEC_NO_HUGE_PAGES=1``
moves nothing; the engine reports what it moved."""

from __future__ import annotations

import pytest
import torch

from megatron_spec import host_memory
from megatron_spec.host_memory import HUGE_PAGE, NO_HUGE_PAGES_ENV, huge_page_memory, huge_pages
from megatron_spec.layers import linear
from megatron_spec.layers.linear import Linear, pack_linears
from megatron_spec.layers.panel_memory import place_panels, placeable

advised = pytest.mark.skipif(huge_pages() != "advised", reason=f"no huge pages here ({huge_pages()})")
panels = pytest.mark.skipif(not linear.small_linear_available(), reason="the panel kernels are not built")


def _huge_kb(ptr: int) -> int:
    """AnonHugePages of the mapping holding ``ptr`` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if not head[0].endswith(":") and "-" in head[0]:
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            inside = lo <= ptr < hi
        elif inside and head[0] == "AnonHugePages:":
            return int(head[1])
    raise AssertionError("no mapping holds the pointer")


@advised
def test_huge_page_memory_is_new_aligned_zeroed_and_backed_by_huge_pages():
    m = huge_page_memory(5 * HUGE_PAGE + 123)
    assert m.dtype == torch.uint8 and m.numel() == 5 * HUGE_PAGE + 123
    assert m.data_ptr() % HUGE_PAGE == 0
    assert int(m.max()) == 0
    m.fill_(7)
    assert _huge_kb(m.data_ptr()) >= 4 * HUGE_PAGE // 1024  # whole huge pages for the first 5 (4 at least)


def test_huge_page_memory_none_when_turned_off_or_empty(monkeypatch):
    assert huge_page_memory(0) is None
    monkeypatch.setenv(NO_HUGE_PAGES_ENV, "1")
    assert huge_pages() == "off asked"
    assert huge_page_memory(HUGE_PAGE) is None


def test_huge_pages_reads_the_kernels_setting(monkeypatch, tmp_path):
    monkeypatch.delenv(NO_HUGE_PAGES_ENV, raising=False)
    for text, want in (("always [madvise] never\n", "advised"), ("[always] madvise never\n", "advised"),
                       ("always madvise [never]\n", "never")):
        (tmp_path / "enabled").write_text(text)
        monkeypatch.setattr(host_memory, "THP_SETTING", str(tmp_path / "enabled"))
        assert huge_pages() == want
    monkeypatch.setattr(host_memory, "THP_SETTING", str(tmp_path / "missing"))
    assert huge_pages() == "no THP"


def _model(dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 48), Linear(48, 96, bias=False), Linear(96, 32)).to(dtype)
    pack_linears(model)
    return model


@advised
@panels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_placed_panels_compute_the_same_and_stay_placed_through_a_weight_update(dtype):
    if dtype == torch.bfloat16 and not linear.bf16_small_linear_available():
        pytest.skip("no bf16 panel kernel here")
    model = _model(dtype)
    x = torch.randn(3, 64).to(dtype)
    with torch.inference_mode():
        before = model(x)
    layers = placeable(model)
    assert len(layers) == 3
    epoch = linear.PACK_EPOCH
    moved = place_panels([model, None])
    assert moved >= sum(m._small.numel() * m._small.element_size() for m in layers)
    assert linear.PACK_EPOCH == epoch + 1  # cached lists of the old panels are stale
    assert placeable(model) == [] and place_panels([model]) == 0  # placed once
    at = [m._small.data_ptr() for m in layers]
    assert all(p % 4096 == 0 for p in at) and _huge_kb(at[0]) > 0
    with torch.inference_mode():
        assert torch.equal(model(x), before)  # the same numbers, bit for bit
    # a weight update: unpack keeping the panels' memory, new weights, pack: written where they were
    pack_linears(model, enable=False, keep=True)
    with torch.no_grad():
        for m in layers:
            m.weight.mul_(-0.5)
    pack_linears(model)
    assert [m._small.data_ptr() for m in layers] == at
    fresh = _model(dtype)
    with torch.no_grad():
        for m, f in zip(layers, placeable(fresh)):
            f.weight.copy_(m.weight)
    pack_linears(fresh)
    with torch.inference_mode():
        assert torch.equal(model(x), fresh(x))
    # released (the main job, while it trains): the next pack allocates anew; placing moves those
    pack_linears(model, enable=False)
    pack_linears(model)
    assert len(placeable(model)) == 3 and place_panels([model]) > 0
    with torch.inference_mode():
        assert torch.equal(model(x), fresh(x))


@panels
def test_lent_panels_and_unpacked_layers_stay_where_they_are():
    model = _model(torch.float32)
    held = model[0]
    held.weight.data = held._small.reshape(-1, held.in_features).clone()  # memory holding panels: "lent"
    held.hold_panels(True)
    held.pack()
    model[1].unpack()
    assert placeable(model) == [model[2]]


@panels
def test_nothing_moves_when_turned_off(monkeypatch):
    monkeypatch.setenv(NO_HUGE_PAGES_ENV, "1")
    model = _model(torch.float32)
    ptrs = [m._small.data_ptr() for m in placeable(model)]
    assert place_panels([model]) == 0
    assert [m._small.data_ptr() for m in placeable(model)] == ptrs


@advised
@panels
def test_the_engine_moves_its_target_and_draft_panels_and_samples_the_same(setup, monkeypatch):
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer
    from megatron_spec.rollout.types import GenerateRequest, SamplingParams

    def run(off: bool):
        monkeypatch.setenv(NO_HUGE_PAGES_ENV, "1" if off else "0")
        srv = EngineServer(EngineConfig(model_path=setup.target, draft_kind="eagle3", draft_path=setup.eagle3,
                                        num_draft_tokens=3, context_length=96, max_batch_size=4, seed=3))
        reqs = [GenerateRequest(f"r{i}", [5 + i, 9, 17, 4 + 2 * i], SamplingParams(
            temperature=float(i % 2), max_new_tokens=24, ignore_eos=True)) for i in range(6)]
        samples, _ = srv.core.generate(reqs, seed=7)
        return srv, [(s.output_ids, s.logprobs, s.accepted_per_step) for s in samples]

    on, got = run(off=False)
    off, want = run(off=True)
    assert on.info()["panels_on_huge_pages_mb"] > 0 and off.info()["panels_on_huge_pages_mb"] == 0
    for module in (on.target, on._draft_module()):
        assert placeable(module) == []  # every panel of the target and of the draft moved
    assert got == want
    on.release_memory()  # the main job, while it trains: the panels go, and the engine says so
    assert on.info()["panels_on_huge_pages_mb"] == 0
