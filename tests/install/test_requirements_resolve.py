"""The GPU environments resolve: ``pip install --dry-run --report`` on requirements/gpu.txt and
requirements/modelopt.txt for CPython 3.12 on linux x86_64, from wheels only.

What this knows: what pip's resolver says, from the package index pip is configured with, today.
What it does not know: whether the wheels import or run on a GPU (nothing is installed), and how
transformer_engine_torch builds (an sdist, built on the GPU node with --no-build-isolation; here only
its declared requirements are checked against gpu.txt's resolution).

Runs from any interpreter: ``--python-version 3.12 --platform manylinux_2_*`` makes pip resolve for
the target machine, not this one (``--ignore-installed`` keeps this venv's packages out of it).
Marked ``network``; skips with a reason when PyPI is unreachable. Takes ~1-1.5 min (both run at once).
"""

from __future__ import annotations

import io
import json
import os
import pathlib
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from email.parser import Parser

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.network

ROOT = pathlib.Path(__file__).resolve().parents[2]
REQ = ROOT / "requirements"
PYPI = "https://pypi.org/simple"

# The target machine: CPython 3.12 on linux x86_64 with glibc >= 2.34 (sglang 0.5.23's wheel is
# manylinux_2_34). pip does not expand a manylinux tag to the older ones, so every one is listed.
PLATFORMS = ([f"manylinux_2_{v}_x86_64" for v in range(34, 4, -1)]
             + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"])
TARGET_ENV = {**default_environment(), "python_version": "3.12", "python_full_version": "3.12.0",
              "implementation_name": "cpython", "platform_python_implementation": "CPython",
              "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
              "os_name": "posix"}


def _pypi_unreachable() -> str | None:
    try:
        urllib.request.urlopen(f"{PYPI}/pip/", timeout=10).close()
        return None
    except (urllib.error.URLError, OSError) as e:
        return f"PyPI is unreachable ({e})"



def _dry_run(req_file: pathlib.Path, report: pathlib.Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--report", str(report), "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--abi", "cp312", "-r", str(req_file)]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                                 "PIP_NO_CACHE_DIR": "1"})


def _pinned(req_file: pathlib.Path) -> list[Requirement]:
    reqs = []
    for line in req_file.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            reqs.append(Requirement(line))
    return reqs


def _resolved(report: pathlib.Path) -> dict[str, dict]:
    data = json.loads(report.read_text())
    return {canonicalize_name(i["metadata"]["name"]): i for i in data["install"]}


def _check(req_file: pathlib.Path, resolved: dict[str, dict]) -> None:
    for req in _pinned(req_file):
        name = canonicalize_name(req.name)
        assert name in resolved, f"{req} from {req_file.name} is not in pip's resolution"
        version = Version(resolved[name]["metadata"]["version"])
        assert req.specifier.contains(version, prereleases=True), (
            f"{req_file.name}: pip resolved {req.name} {version}, the file asks for {req}")
    for name, item in resolved.items():
        url = item["download_info"]["url"]
        assert url.endswith(".whl"), f"{name} resolved to a source distribution: {url}"
        rp = item["metadata"].get("requires_python")
        if rp:
            assert SpecifierSet(rp).contains("3.12"), (
                f"{name} {item['metadata']['version']} requires Python {rp}")


@pytest.fixture(scope="module")
def resolutions(tmp_path_factory) -> dict[str, tuple[dict[str, dict] | None, str]]:
    if (why := _pypi_unreachable()) is not None:
        pytest.skip(why)
    out = tmp_path_factory.mktemp("pip_reports")
    procs = {name: (_dry_run(REQ / name, out / f"{name}.json"), out / f"{name}.json")
             for name in ("gpu.txt", "modelopt.txt")}
    result = {}
    for name, (proc, report) in procs.items():
        log, _ = proc.communicate(timeout=600)
        result[name] = (_resolved(report) if proc.returncode == 0 else None, log[-6000:])
    return result


@pytest.mark.parametrize("name", ["gpu.txt", "modelopt.txt"])
def test_requirements_resolve_for_python312_linux(resolutions, name):
    resolved, log = resolutions[name]
    assert resolved is not None, f"pip could not resolve requirements/{name}:\n{log}"
    _check(REQ / name, resolved)


def test_gpu_stack_versions(resolutions):
    resolved, log = resolutions["gpu.txt"]
    assert resolved is not None, log
    v = {n: Version(i["metadata"]["version"]) for n, i in resolved.items()}
    assert v["sglang"] == Version("0.5.23")
    assert v["megatron-core"] >= Version("0.17")
    # the torch and transformers sglang pins, whatever gpu.txt says
    for r in (Requirement(r) for r in resolved["sglang"]["metadata"]["requires_dist"]):
        name = canonicalize_name(r.name)
        if name in ("torch", "transformers") and (r.marker is None or r.marker.evaluate(TARGET_ENV)):
            assert r.specifier.contains(v[name]), f"sglang needs {r}, resolved {v[name]}"
    assert "transformer-engine-cu13" in v, "TransformerEngine's CUDA 13 core library is missing"


def test_modelopt_env_keeps_transformers_modelopt_supports(resolutions):
    resolved, log = resolutions["modelopt.txt"]
    assert resolved is not None, log
    modelopt = resolved["nvidia-modelopt"]["metadata"]
    hf = [Requirement(r) for r in modelopt["requires_dist"] if "transformers" in r and 'extra == "hf"' in r]
    assert hf, "nvidia-modelopt no longer declares its transformers range in the hf extra"
    transformers = Version(resolved["transformers"]["metadata"]["version"])
    assert all(r.specifier.contains(transformers) for r in hf), (transformers, [str(r) for r in hf])
    # and that range excludes what sglang pins: the reason for two environments
    gpu, _ = resolutions["gpu.txt"]
    if gpu is not None:
        sglang_transformers = Version(gpu["transformers"]["metadata"]["version"])
        assert not all(r.specifier.contains(sglang_transformers) for r in hf), (
            "ModelOpt now accepts sglang's transformers: requirements/modelopt.txt could merge into gpu.txt")


def _te_torch_requires(version: str) -> list[Requirement]:
    """Requires-Dist of the transformer_engine_torch sdist (PKG-INFO inside the tarball, ~0.5 MB)."""
    req = urllib.request.Request(f"{PYPI}/transformer-engine-torch/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    files = json.load(urllib.request.urlopen(req, timeout=30))["files"]
    sdist = [f for f in files if f["filename"] == f"transformer_engine_torch-{version}.tar.gz"]
    assert sdist, f"no transformer_engine_torch-{version}.tar.gz on {PYPI}"
    blob = urllib.request.urlopen(sdist[0]["url"], timeout=60).read()
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        pkg_info = tar.extractfile(f"transformer_engine_torch-{version}/PKG-INFO").read().decode()
    return [Requirement(r) for r in Parser().parsestr(pkg_info).get_all("Requires-Dist") or []]


def test_transformer_engine_torch_requirements_are_in_gpu_env(resolutions):
    # The second install step (transformer_engine_torch, --no-build-isolation) must add nothing:
    # every requirement it declares is already met by gpu.txt's resolution.
    resolved, log = resolutions["gpu.txt"]
    assert resolved is not None, log
    te_version = resolved["transformer-engine"]["metadata"]["version"]
    missing = []
    for r in _te_torch_requires(te_version):
        if r.marker is not None and not r.marker.evaluate(TARGET_ENV):
            continue
        have = resolved.get(canonicalize_name(r.name))
        if have is None or not r.specifier.contains(Version(have["metadata"]["version"]), prereleases=True):
            missing.append(f"{r} (resolved: {have['metadata']['version'] if have else 'absent'})")
    assert not missing, f"transformer_engine_torch {te_version} needs what gpu.txt lacks: {missing}"
