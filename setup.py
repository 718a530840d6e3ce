"""Build and install megatron-spec.

The extension ``megatron_spec._C`` is built from ``csrc/`` with torch's cpp_extension:

* C++ CPU kernels (``csrc/*.cpp``, ``csrc/cpu/*.cpp``) always, for every x86-64 CPU at once: the
  hot loops are compiled for the baseline, AVX2 and AVX-512 and picked at run time from cpuid
  (``csrc/cpu/kernels.h``), so one binary runs, fast, on the CPU it is built on and any other;
* CUDA kernels (``csrc/cuda/*.cu`` plus the torch binding ``csrc/cuda/*_binding.cpp``) only
  when torch was built with CUDA and ``CUDA_HOME`` is found.

Environment switches (flash-attention / extension-cpp style):

* ``MEGATRON_SPEC_SKIP_CUDA_BUILD=1``  build the CPU kernels only, even on a CUDA machine.
* ``MEGATRON_SPEC_SKIP_EXTENSION=1``   build no extension at all (pure-PyTorch fallbacks).
* ``MEGATRON_SPEC_CUDA_ARCHS="90;100"`` CUDA architectures (default ``80;90``).
* ``MAX_JOBS=N``                       parallel compile jobs (read by torch's ninja builder).

Install with ``pip install --no-build-isolation -e .``: the build needs the torch that is
already installed (an isolated build environment would download a different torch).
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _extensions():
    if _env_flag("MEGATRON_SPEC_SKIP_EXTENSION"):
        print("megatron-spec: MEGATRON_SPEC_SKIP_EXTENSION set, building no extension", file=sys.stderr)
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        print("megatron-spec: torch not importable at build time; building no extension "
              "(install torch first and use --no-build-isolation)", file=sys.stderr)
        return [], {}

    cpu_sources = sorted(
        glob.glob(os.path.join("csrc", "*.cpp")) + glob.glob(os.path.join("csrc", "cpu", "*.cpp"))
    )
    if not cpu_sources:
        return [], {}
    # -ffp-contract=off: GCC otherwise fuses a*b+c into FMAs (even in an ISO -std mode), and the kernels
    # must round every operation exactly as their pure-PyTorch references do (csrc/ms_math.h).
    # -fno-trapping-math: lets GCC if-convert (vectorise) float selects; it changes no result bits.
    # No -std: torch's cpp_extension adds the standard it is built for (C++20 in torch 2.13 and 2.14;
    # torch 2.14's ATen.h, the torch sglang 0.5.23 pins, refuses anything older than C++20).
    cxx_flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math",
                 "-DMEGATRON_SPEC_CPU"]
    # No -march=native: the build machine's ISA says nothing about the machine that runs the
    # binary. The AVX2 and AVX-512 loops are compiled in their own files under target pragmas.
    extra_link = ["-fopenmp"]
    include_dirs = [os.path.join(ROOT, "csrc")]

    want_cuda = (
        not _env_flag("MEGATRON_SPEC_SKIP_CUDA_BUILD")
        and torch.version.cuda is not None
        and cpp_extension.CUDA_HOME is not None
    )
    if want_cuda:
        cu_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cu")))
        binding_sources = sorted(glob.glob(os.path.join("csrc", "cuda", "*.cpp")))
        archs = os.environ.get("MEGATRON_SPEC_CUDA_ARCHS", "80;90").replace(",", ";").split(";")
        nvcc_flags = ["-O3", "--use_fast_math", "-DMEGATRON_SPEC_CUDA"]  # -std: as for cxx
        for arch in filter(None, (a.strip() for a in archs)):
            nvcc_flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
        ext = cpp_extension.CUDAExtension(
            name="megatron_spec._C",
            sources=cpu_sources + binding_sources + cu_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags + ["-DMEGATRON_SPEC_WITH_CUDA"], "nvcc": nvcc_flags},
            extra_link_args=extra_link,
        )
        print(f"megatron-spec: building CPU + CUDA kernels for sm {archs}", file=sys.stderr)
    else:
        ext = cpp_extension.CppExtension(
            name="megatron_spec._C",
            sources=cpu_sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=extra_link,
        )
        print("megatron-spec: building CPU kernels only", file=sys.stderr)
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="megatron-spec",
    version="0.1.0",
    description="Verifier-exact speculative decoding for GRPO rollouts on megatron-core",
    packages=find_packages(include=["megatron_spec", "megatron_spec.*"]),
    package_data={"megatron_spec": ["sim/data/*.json"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1",
        "safetensors>=0.4",
        "numpy",
        "tqdm",
        "pyyaml",
    ],
    extras_require={
        # The CPU stack known to work is pinned in requirements/cpu.txt.
        # modelopt.torch.utils imports requests without declaring it
        "modelopt": ["nvidia-modelopt==0.47.0", "transformers>=4.57,<5.15", "requests"],
        "rl": ["datasets>=3.0", "math-verify>=0.7", "tensorboard", "matplotlib"],
        # The GPU stack is pinned in requirements/gpu.txt (docs/gpu_cluster.md). TransformerEngine's
        # PyTorch extension is not listed: it is an sdist that must be built with
        # --no-build-isolation against the installed torch (an extra would build it against another).
        "gpu": ["sglang==0.5.23", "transformer-engine[core_cu13]==2.20.2"],
        "dev": ["pytest>=8", "hypothesis", "scipy", "ninja", "transformers>=4.57,<5.15"],
    },
    entry_points={"console_scripts": ["megatron-spec=megatron_spec.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
