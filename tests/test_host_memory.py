"""``megatron_spec.host_memory.keep_heap``: a large tensor comes from the heap, not a fresh mmap, and the
memory a freed one held stays with the process; ``MEGATRON_SPEC_DEFAULT_MALLOC=1`` keeps glibc's defaults;
the native engine's process keeps its heap. Each case runs in its own process: the allocator's settings are
a process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from megatron_spec.host_memory import DEFAULT_MALLOC_ENV, is_glibc

glibc_only = pytest.mark.skipif(not is_glibc(), reason="glibc's allocator only")

# 96 MiB: above glibc's largest dynamic mmap threshold (32 MiB), so by default a fresh mmap every time
_PROBE = textwrap.dedent("""
    import ctypes, json, sys
    import torch
    from megatron_spec import host_memory

    class Mallinfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Mallinfo2
    setting = host_memory.setting()
    did = host_memory.keep_heap() if sys.argv[1] == "keep" else None
    x = torch.ones(96 << 18)  # 96 MiB of float32, written
    live = libc.mallinfo2()
    del x
    freed = libc.mallinfo2()
    print(json.dumps({"did": did, "state": host_memory.state(), "setting": setting,
                      "mmapped_live": live.hblkhd, "heap_live": live.arena, "heap_after_free": freed.arena,
                      "mmapped_after_free": freed.hblkhd}))
""")


def _run(code: str, arg: str, **env):
    """``code`` in a new Python process with ``arg``, the default-allocator switch off unless ``env`` sets it;
    the JSON of its last line."""
    base = {k: v for k, v in os.environ.items() if k != DEFAULT_MALLOC_ENV}
    proc = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=300,
                          env={**base, **env})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _probe(mode: str, **env) -> dict:
    return _run(_PROBE, mode, **env)


@glibc_only
def test_keep_heap_puts_a_large_tensor_on_the_heap_and_keeps_its_memory_after_it_is_freed():
    mib = 1 << 20
    default = _probe("default")
    assert default["state"] is None and default["setting"] == "kept"  # what keep_heap would do, not called
    assert default["mmapped_live"] >= 96 * mib  # glibc's default: a fresh mapping ...
    assert default["mmapped_after_free"] < 96 * mib  # ... unmapped at free: the next one faults its pages in
    kept = _probe("keep")
    assert kept["did"] == kept["state"] == "kept"
    assert kept["mmapped_live"] < 96 * mib <= kept["heap_live"]
    assert kept["heap_after_free"] >= 96 * mib  # not trimmed: the next forward reuses these pages


@glibc_only
def test_the_default_allocator_switch_keeps_glibcs_settings():
    out = _probe("keep", **{DEFAULT_MALLOC_ENV: "1"})
    assert out["did"] == out["state"] == out["setting"] == "default asked"
    assert out["mmapped_live"] >= 96 << 20


_ENGINE = textwrap.dedent("""
    import json, sys
    from megatron_spec import host_memory
    from megatron_spec.models.tiny import make_hf_checkpoint
    from megatron_spec.rollout.config import EngineConfig
    from megatron_spec.rollout.native.server import EngineServer

    path = make_hf_checkpoint(sys.argv[1], family="qwen3", num_layers=2, hidden_size=64,
                              intermediate_size=128, num_attention_heads=4, num_kv_heads=2, seed=3)
    before = host_memory.state()
    EngineServer(EngineConfig(model_path=str(path), max_batch_size=2, context_length=32, warm_up=False))
    print(json.dumps([before, host_memory.state()]))
""")


@glibc_only
def test_the_native_engine_keeps_its_heap_once_built(tmp_path):
    for extra, after in (({}, "kept"), ({DEFAULT_MALLOC_ENV: "1"}, "default asked")):
        assert _run(_ENGINE, str(tmp_path / after.replace(" ", "_")), **extra) == [None, after]
