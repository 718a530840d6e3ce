"""The CPU probe and the one dtype choice (megatron_spec.isa), and the no-native-bf16 switch.

The switch makes this machine behave as an AVX2 CPU (oneDNN and ATen capped at AVX2), so the
subprocess tests below reproduce, on any x86 machine, the crash an AVX2 user hit when an engine
was asked for bf16 (oneDNN refusing to pack bf16 weights) and check it is gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_spec import isa

ZEN3_FLAGS = frozenset("fpu sse sse2 avx avx2 fma f16c bmi2 sha_ni vaes".split())
ZEN4_FLAGS = ZEN3_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"}
SKYLAKE_X_FLAGS = ZEN3_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}  # AVX-512 without bf16
SPR_FLAGS = SKYLAKE_X_FLAGS | {"avx512_bf16", "amx_bf16", "amx_tile"}


@pytest.mark.parametrize("arch,flags,want", [
    ("x86_64", ZEN3_FLAGS, False),           # the user's AMD EPYC Zen 3: AVX2 only
    ("x86_64", SKYLAKE_X_FLAGS, False),      # oneDNN packs bf16 there but emulates the arithmetic
    ("x86_64", ZEN4_FLAGS, True),
    ("x86_64", SPR_FLAGS, True),
    ("x86_64", ZEN3_FLAGS | {"avx_ne_convert"}, True),
    ("aarch64", frozenset({"fp", "asimd", "sve", "bf16"}), True),
    ("aarch64", frozenset({"fp", "asimd", "sve"}), False),
])
def test_bf16_arithmetic_from_flags(arch, flags, want):
    assert isa._bf16_arith(arch, flags) is want


def _info(**kw) -> isa.CpuInfo:
    base = dict(model="test cpu", arch="x86_64", torch_capability="AVX512", flags=ZEN4_FLAGS, bf16_arith=True,
                onednn_bf16=True, forced_off=False)
    return isa.CpuInfo(**{**base, **kw})


def test_native_bf16_needs_every_part():
    assert _info().native_bf16 and _info().why_not_bf16() == ""
    assert (
        not _info(bf16_arith=False).native_bf16
        and "no bf16 arithmetic" in _info(bf16_arith=False).why_not_bf16()
    )
    assert not _info(onednn_bf16=False).native_bf16 and "oneDNN" in _info(onednn_bf16=False).why_not_bf16()
    forced = _info(forced_off=True)
    assert not forced.native_bf16 and isa.NO_NATIVE_BF16_ENV in forced.why_not_bf16()
    assert forced.capability == "AVX2" and _info().capability == "AVX512"


@pytest.fixture
def native(monkeypatch):
    """Pretend the probe found native bf16 (``True``) or not (``False``), and reset the warn-once state."""
    def set_native(value: bool) -> None:
        monkeypatch.setattr(isa, "probe", lambda: _info(bf16_arith=value))
    monkeypatch.setattr(isa, "_warned", set())
    return set_native


def test_resolve_dtype_with_native_bf16(native, capsys):
    native(True)
    assert isa.resolve_dtype("auto") == "bfloat16" and isa.resolve_dtype(None) == "bfloat16"
    assert isa.resolve_dtype("bfloat16") == "bfloat16" and isa.resolve_dtype("bf16") == "bfloat16"
    assert isa.resolve_dtype("float32") == "float32" and isa.resolve_dtype("fp32") == "float32"
    assert capsys.readouterr().err == ""


def test_resolve_dtype_without_native_bf16_never_picks_bf16(native, capsys):
    native(False)
    assert isa.resolve_dtype("auto") == "float32"
    assert capsys.readouterr().err == ""  # auto choosing fp32 is no surprise: no warning
    assert isa.resolve_dtype("bfloat16") == "float32"
    assert isa.resolve_dtype("bfloat16") == "float32"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, once per process
    assert "warning: bfloat16 asked for" in err[0] and "float32" in err[0] and "no bf16 arithmetic" in err[0]


def test_resolve_dtype_on_a_gpu_keeps_bf16(native):
    native(False)
    assert isa.resolve_dtype("auto", device="cuda") == "bfloat16"
    assert isa.resolve_dtype("bfloat16", device="cuda") == "bfloat16"
    assert isa.resolve_dtype("float32", device="cuda") == "float32"


def test_resolve_dtype_rejects_unknown_names():
    with pytest.raises(ValueError, match="auto"):
        isa.resolve_dtype("float16")


def test_switch_is_read_at_every_probe(monkeypatch):
    monkeypatch.setenv(isa.NO_NATIVE_BF16_ENV, "1")
    assert isa.probe().forced_off and not isa.probe().native_bf16
    assert isa.resolve_dtype("auto") == "float32"
    monkeypatch.setenv(isa.NO_NATIVE_BF16_ENV, "0")
    assert not isa.probe().forced_off


def test_probe_agrees_with_onednn_on_this_machine():
    """Where the probe says bf16 is native, oneDNN packs a bf16 weight and the packed matmul matches
    fp32 to bf16 precision; where it says not, auto is fp32. Which of the two ran is in the name of
    the assertion that runs (the other path runs under the switch, in the subprocess tests)."""
    info = isa.probe()
    if not info.native_bf16:
        assert isa.resolve_dtype("auto") == "float32", info
        return
    w = torch.randn(256, 128)
    x = torch.randn(4, 128)
    packed = torch.ops.mkldnn._reorder_linear_weight(w.to(torch.bfloat16), 4)
    y = torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), packed, None, "none", [], "")
    torch.testing.assert_close(y.float(), x @ w.t(), atol=0.3, rtol=0.05)


def _run_switched(code: str) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with the switch on and every variable it sets left to it."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CACHE_DIR")}
    env[isa.NO_NATIVE_BF16_ENV] = "1"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_switch_runs_this_machine_as_an_avx2_cpu():
    """With the switch, importing megatron_spec caps oneDNN and ATen at AVX2: a bf16 weight then
    cannot be packed, exactly the error an AVX2 user met (so the tests below are the real thing)."""
    res = _run_switched(
        "import megatron_spec, json, torch\n"
        "from megatron_spec import isa\n"
        "try:\n"
        "    torch.ops.mkldnn._reorder_linear_weight(torch.zeros(64, 64, dtype=torch.bfloat16), 4); err = "
        "None\n"
        "except RuntimeError as e:\n"
        "    err = str(e)\n"
        "print(json.dumps({'err': err, 'cap': torch.backends.cpu.get_cpu_capability(), "
        "**isa.probe().as_dict()}))\n"
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["native_bf16"] is False and out["cpu_capability"] == "AVX2" and out["no_native_bf16_forced"]
    if isa._probe_hardware()[1] == "x86_64":
        assert out["cap"] in ("AVX2", "DEFAULT") and out["err"] and "bf16 path needs" in out["err"], out


def test_switch_gives_inductor_a_cache_of_its_own():
    """Inductor's cache does not key on the ISA the switch caps: a graph compiled natively and reused
    under the switch gave NaN logits. The switched mode compiles into its own directory, unless the
    user named one."""
    code = ("import megatron_spec, os\n"
            "from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir\n"
            "print(cache_dir() + '|' + default_cache_dir())\n")
    res = _run_switched(code)
    assert res.returncode == 0, res.stderr
    switched, default = res.stdout.strip().splitlines()[-1].split("|")
    assert switched != default and switched.endswith("_no_native_bf16"), (switched, default)
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env[isa.NO_NATIVE_BF16_ENV] = "0"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    native, default = res.stdout.strip().splitlines()[-1].split("|")
    assert native == default


def test_engine_asked_for_bf16_without_native_bf16_runs_fp32(setup):
    """The AVX2 user's crash: an engine asked for bfloat16 (the demo's old config) died in
    ``Linear.pack``. Now it runs in fp32 with one warning line, and its greedy output equals an
    fp32 engine's."""
    code = (
        "import json\n"
        "from megatron_spec.rollout.config import EngineConfig\n"
        "from megatron_spec.rollout.native.server import EngineServer\n"
        "from megatron_spec.rollout.types import GenerateRequest, SamplingParams\n"
        f"kw = dict(model_path={setup.target!r}, draft_kind='eagle3', draft_path={setup.eagle3!r}, "
        "max_batch_size=2, context_length=64, num_threads=1)\n"
        "reqs = [GenerateRequest(f'r{i}', [5 + i, 9, 11], SamplingParams(temperature=0.0, max_new_tokens=8, "
        "ignore_eos=True)) for i in range(2)]\n"
        "a = EngineServer(EngineConfig(dtype='bfloat16', **kw))\n"
        "b = EngineServer(EngineConfig(dtype='float32', **kw))\n"
        "print(json.dumps({'dtype': a.config.dtype, 'param': str(a.target.embed_tokens.weight.dtype),\n"
        "                  'same': [x.output_ids == y.output_ids for x, y in zip(a.generate(reqs)[0], "
        "b.generate(reqs)[0])]}))\n"
    )
    res = _run_switched(code)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out == {"dtype": "float32", "param": "torch.float32", "same": [True, True]}
    warnings = [ln for ln in res.stderr.splitlines() if "warning: bfloat16 asked for" in ln]
    assert len(warnings) == 1 and isa.NO_NATIVE_BF16_ENV in warnings[0], res.stderr[-2000:]


@pytest.mark.parametrize("switched", [False, True])
def test_info_prints_the_cpu_and_the_dtype_auto_picks(switched):
    env = {k: v for k, v in os.environ.items()
           if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY", isa.NO_NATIVE_BF16_ENV)}
    if switched:
        env[isa.NO_NATIVE_BF16_ENV] = "1"
    res = subprocess.run(
        [sys.executable, "-m", "megatron_spec", "info", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    facts = json.loads(res.stdout)
    assert facts["cpu_model"] and facts["cpu_capability"]
    assert facts["rollout_dtype_auto"] == ("bfloat16" if facts["native_bf16"] else "float32")
    if switched:
        assert facts["native_bf16"] is False and facts["cpu_capability"] == "AVX2"
        assert isa.NO_NATIVE_BF16_ENV in facts["native_bf16_why_not"]
    else:
        assert facts["native_bf16"] is (facts["native_bf16_why_not"] is None)
        here = isa.probe()
        # this process may itself run under the switch (scripts/test.sh's second pass)
        if not here.forced_off:
            assert facts["native_bf16"] is here.native_bf16


def test_the_cpu_kind_names_amx_avx512_bf16_and_avx2():
    amx = ZEN4_FLAGS | {"amx_tile", "amx_bf16"}
    assert _info(flags=amx).kind == "AMX" and _info(flags=amx).amx_bf16
    assert _info().kind == "AVX-512-BF16" and not _info().amx_bf16
    assert _info(flags=amx, forced_off=True).kind == "AVX2" and not _info(flags=amx, forced_off=True).amx_bf16
    assert _info(bf16_arith=False).kind == "AVX-512"


def test_amx_runs_where_the_cpu_has_it_unless_switched_off():
    """The bf16 linear kernel's AMX tiles: on where the CPU and OS allow them, off with
    ``MEGATRON_SPEC_NO_AMX=1``
    (the AVX512-BF16 dot products then) or ``MEGATRON_SPEC_NO_NATIVE_BF16=1`` (no bf16 engine at all)."""
    from megatron_spec import _ext

    if not _ext.compiled_ops_available():
        pytest.skip("megatron_spec._C not built")
    code = (
        "import json; from megatron_spec import _ext; from megatron_spec.isa import probe\n"
        "print(json.dumps({'active': _ext.amx_active(), 'kernel': _ext.bf16_linear_kernel(), 'kind': "
        "probe().kind}))"
    )
    # the switches, and the caps the package sets from the switch on import (run under it: scripts/test.sh's
    # second run)
    env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in ("MEGATRON_SPEC_NO_AMX", isa.NO_NATIVE_BF16_ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    }
    runs = {}
    for name, extra in (("default", {}), ("no_amx", {"MEGATRON_SPEC_NO_AMX": "1"}),
                        ("no_bf16", {isa.NO_NATIVE_BF16_ENV: "1"})):
        res = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env={**env, **extra}
        )
        assert res.returncode == 0, res.stderr
        runs[name] = json.loads(res.stdout.strip().splitlines()[-1])
    assert runs["default"]["active"] == _ext.amx_supported() == (runs["default"]["kernel"] == "amx")
    assert runs["default"]["kind"] == ("AMX" if _ext.amx_supported() else runs["default"]["kind"])
    assert not runs["no_amx"]["active"] and runs["no_amx"]["kernel"] in ("avx512bf16", "onednn")
    assert not runs["no_bf16"]["active"] and runs["no_bf16"]["kind"] == "AVX2"
