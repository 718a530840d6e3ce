"""The whole ``megatron_spec._C`` builds with CUDA, links and loads, against the torch the GPU
environment pins (requirements/gpu.txt), on a machine without a GPU.

What this does: installs that torch (the CUDA build from PyPI, with its CUDA libraries) into a
temporary directory, runs this repository's ``setup.py build_ext`` with it (the CUDAExtension branch
a GPU user's ``pip install --no-build-isolation -e .`` takes: every CPU source, the torch binding and
the ``.cu`` kernels through torch's ninja builder and nvcc, for sm_90), then loads the built shared
object with ``torch.ops.load_library`` and checks that every op has a CUDA kernel registered.
Loading resolves every symbol against libtorch_cuda, libc10_cuda and libcudart; nothing runs on a
GPU, so the kernels' results are not checked here (tests/ops/test_ops_cuda.py does that on a GPU).

What it does not know: other CUDA architectures than sm_90, the Python 3.12 of the GPU environment
(this runs with the test interpreter), and anything about a GPU at run time.

Cost: ~5.4 GB in a temporary directory that is removed afterwards (nothing cached); 1.5-6 min in
all on 2 shared cores, with the load (measured 1.5, 3.3 and 5.6 min).
Marked ``network`` and ``slow``; skips with a reason without PyPI, without a CUDA toolkit (nvcc and
cuda_runtime.h) of torch's CUDA major version, or with less than ``NEEDS_GB`` free in the temporary directory
(a full disk is the machine's state, not the build's: CI's ran out here once, mid-install).

It also skips, saying so, when nothing it depends on has changed since it last passed: a passing run
writes ``cuda_build_verified.json`` beside this file with the SHA-256 of ``setup.py``, every file under
``csrc/``, ``requirements/gpu.txt`` and this file (commit it with the change that made it); while those
are byte-identical the build would be the same build of the same sources against the same torch wheel.
It was ~7 minutes of a ~37-minute suite. ``MEGATRON_SPEC_CUDA_BUILD_CHECK=always`` runs it regardless.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request

import pytest

pytestmark = [pytest.mark.network, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parents[2]
ARCH = "90"
RECORD = pathlib.Path(__file__).with_name("cuda_build_verified.json")
NEEDS_GB = 7.0  # the CUDA torch, its CUDA libraries and the build: 5.4 GB measured, and a margin


def _inputs_digest() -> str:
    """SHA-256 over the names and bytes of everything the build and this test depend on in the tree."""
    files = [ROOT / "setup.py", ROOT / "requirements" / "gpu.txt", pathlib.Path(__file__).resolve()]
    files += sorted(p for p in (ROOT / "csrc").rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _verified() -> dict | None:
    """The record of the last passing run, where it was made from these very inputs."""
    try:
        record = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("inputs_sha256") == _inputs_digest() else None


def _gpu_torch_pin() -> str:
    for line in (ROOT / "requirements" / "gpu.txt").read_text().splitlines():
        if re.match(r"torch==", line.strip()):
            return line.split("#", 1)[0].strip()
    raise AssertionError("requirements/gpu.txt pins no torch==")


def _cuda_home() -> tuple[pathlib.Path, int] | None:
    """A CUDA toolkit with nvcc and the runtime headers, and its major version."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(pathlib.Path(nvcc).resolve().parent.parent))
    for c in filter(None, candidates):
        home = pathlib.Path(c)
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists():
            version = subprocess.run([str(home / "bin" / "nvcc"), "--version"], capture_output=True,
                                     text=True)
            m = re.search(r"release (\d+)\.", version.stdout)
            if m:
                return home, int(m.group(1))
    return None


def _skip_reason() -> str | None:
    if shutil.which("g++") is None:
        return "needs g++"
    if _cuda_home() is None:
        return "needs a CUDA toolkit (nvcc and include/cuda_runtime.h; set CUDA_HOME)"
    free_gb = shutil.disk_usage(tempfile.gettempdir()).free / 1e9
    if free_gb < NEEDS_GB:
        return f"needs {NEEDS_GB:.0f} GB free in {tempfile.gettempdir()}, has {free_gb:.1f} GB"
    try:
        urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=10).close()
    except (urllib.error.URLError, OSError) as e:
        return f"PyPI is unreachable ({e})"
    return None


def _run(cmd: list[str], timeout: int, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def test_whole_extension_builds_with_cuda_and_loads():
    if os.environ.get("MEGATRON_SPEC_CUDA_BUILD_CHECK") != "always" and (done := _verified()) is not None:
        pytest.skip(
            "setup.py, csrc/, requirements/gpu.txt and this test are byte-identical to what built and "
            "loaded "
            f"with {done['torch']} on {done['date']} ({RECORD.name}); MEGATRON_SPEC_CUDA_BUILD_CHECK=always "
            f"runs it again"
        )
    if (why := _skip_reason()) is not None:
        pytest.skip(why)
    t0 = time.time()
    cuda_home, cuda_major = _cuda_home()
    pin = _gpu_torch_pin()
    with tempfile.TemporaryDirectory(prefix="megatron_spec_cuda_build_") as tmp:
        tmp = pathlib.Path(tmp)
        site, src = tmp / "site", tmp / "src"
        # The CUDA torch from PyPI and its CUDA libraries (import torch loads them), beside this venv's.
        res = _run([sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir",
                    "--only-binary=:all:", "--target", str(site), pin, "ninja"], timeout=900,
                   env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
        assert res.returncode == 0, f"pip install {pin} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        env = {**os.environ, "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1", "PATH":
               f"{site / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
        probe = _run([sys.executable, "-c",
                      "import torch; print(torch.__version__, torch.version.cuda, torch.__file__)"],
                     timeout=300, env=env)
        assert probe.returncode == 0, probe.stderr[-3000:]
        version, torch_cuda, torch_file = probe.stdout.split()
        assert torch_file.startswith(str(site)), f"the build would use {torch_file}, not the CUDA torch"
        assert torch_cuda != "None", f"{pin} from the index is not a CUDA build ({version})"
        if int(torch_cuda.split(".")[0]) != cuda_major:
            pytest.skip(f"{version} is built for CUDA {torch_cuda}, "
                        f"the toolkit at {cuda_home} is CUDA {cuda_major}")

        # setup.py as a GPU user runs it, on a copy (the worktree's own build and _C stay untouched).
        src.mkdir()
        shutil.copy(ROOT / "setup.py", src)
        shutil.copytree(ROOT / "csrc", src / "csrc")
        (src / "megatron_spec").mkdir()
        build = _run([sys.executable, "setup.py", "build_ext", "--build-temp", str(tmp / "obj"),
                      "--build-lib", str(tmp / "lib")], timeout=1800, cwd=src,
                     env={**env, "CUDA_HOME": str(cuda_home), "MEGATRON_SPEC_CUDA_ARCHS": ARCH,
                          "MAX_JOBS": os.environ.get("MAX_JOBS", "2")})
        log = build.stdout + build.stderr
        assert build.returncode == 0, f"setup.py build_ext against {version} failed:\n{log[-6000:]}"
        assert f"building CPU + CUDA kernels for sm ['{ARCH}']" in log, log[-3000:]
        assert re.search(r"nvcc .*verify_kernels\.cu", log) and f"arch=compute_{ARCH},code=sm_{ARCH}" in log
        so = list((tmp / "lib" / "megatron_spec").glob("_C*.so"))
        assert len(so) == 1, so

        # Load it: every undefined symbol must resolve, the registrations run, no GPU is touched.
        binding = (ROOT / "csrc" / "cuda" / "ops_binding.cpp").read_text()
        ops = re.findall(r'm\.impl\("(\w+)"', binding.split("TORCH_LIBRARY_IMPL(megatron_spec, CUDA, m)")[-1])
        assert {"verify_chain", "fp8_block_quantize", "fp8_block_dequantize"} <= set(ops), ops
        check = textwrap.dedent(f"""
            import torch
            torch.ops.load_library({str(so[0])!r})
            for op in {ops!r}:
                for key in ("CUDA", "CPU"):
                    has = torch._C._dispatch_has_kernel_for_dispatch_key("megatron_spec::" + op, key)
                    assert has, (op, key)
            print("registered for CUDA and CPU:", *{ops!r})
        """)
        loaded = _run([sys.executable, "-c", check], timeout=300, env=env)
        assert loaded.returncode == 0, loaded.stderr[-4000:]
        assert "registered for CUDA and CPU: " + " ".join(ops) in loaded.stdout, loaded.stdout
    RECORD.write_text(
        json.dumps(
            {
                "inputs_sha256": _inputs_digest(),
                "torch": version,
                "cuda_toolkit": cuda_major,
                "arch": f"sm_{ARCH}",
                "ops": ops,
                "date": time.strftime("%Y-%m-%d"),
                "seconds": round(time.time() - t0),
            },
            indent=1,
        )
        + "\n"
    )
