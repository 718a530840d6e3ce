"""The GPU check kit (issue 27): one command on a borrowed GPU machine proves the GPU path, step by step.

    scripts/gpu_check.sh --prepare      # here (CPU): fill .gpu_kit/ (megatron-core wheels, test models)
    scripts/gpu_check.sh                # on the GPU machine: one device call, carrying .gpu_kit
    scripts/gpu_check.sh --dry-run      # the same steps here, on the CPU (tests/install/test_gpu_check.py)

The GPU machine has Python 3.12 with torch (CUDA), transformers, safetensors, tokenizers, pytest and nvcc, no
network, and neither megatron-core nor NVIDIA ModelOpt: ``--prepare`` downloads megatron-core's wheels
(0.19.2, 0.16.1 as the fallback) and makes the small models the tests and the GRPO runs use with the
project's own code (a target, a second target, a draft model, the target's EAGLE-3 draft trained and
exported by ModelOpt, an MTP head: ``tests/model_factory.py``), at most 20 MB in all.

The steps (each with its own time limit, each logged; a failure does not stop the steps after it; a
deadline for the whole run leaves time for the summary):

1. ``env``: nvidia-smi, torch and CUDA, nvcc, ``megatron-spec info``;
2. ``install``: megatron-core from the carried wheels into a temporary folder (no network);
3. ``build``: ``megatron_spec._C`` for sm_90 (``build_ext --inplace``, every core);
4. ``ops``: the gpu-marked op tests (every CUDA kernel against its reference, bit for bit, and the device
checks);
5. ``forward_costs``: seconds of verify forwards and EAGLE-3 passes for real model shapes
   (``benchmarks/measure_forward_costs.py``), the points ``megatron-spec simulate`` reads;
6. ``smoke``: the gpu-marked tests of the trainer and the engine (GPTModel on CUDA against transformers,
   the HF round trip, the CUDA RNG in checkpoints, device fingerprints, streaming over CUDA IPC into the
   native engine on CUDA, greedy speculative == autoregressive on CUDA, the sampled statistics at a
   small N) and the trainer-piece tests, which run on the GPU when there is one (every tensor on the
   model's device, ``--bf16`` steps moving the weights as fp32 steps do, the colocated offload round trip);
7. ``grpo_fp8`` / ``grpo_bf16_mtp``: two GRPO runs of a few steps on the native engine (fp32 trainer with
   FP8 streaming, ``--colocate-offload all``, EAGLE-3 with online draft training; ``--bf16`` with MTP online);
8. the summary: ``summary.json`` (each step: status, seconds, the end of its log), ``forward_costs.json``
   and ``logs.tar.gz`` in ``$OUT`` (or ``--out``).

The dry run runs every step on the CPU where CUDA is absent: the wheels are checked but not installed
(they are for Python 3.12), the extension already built here is used, GPU tests skip, and the models,
step counts and measurement grid are small. It exists so the kit cannot rot between GPU loans.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu_kit"
WHEELS = ("0.19.2", "0.16.1")  # megatron-core: the newest first, the project's CPU version as the fallback
KIT_LIMIT_BYTES = 20 << 20
DEADLINE_S = 460  # the whole GPU run: a device call of 480 s leaves room for a second run in 15 minutes
SMOKE_TESTS = [
    "tests/models/test_gpt_cuda.py", "tests/rl/test_checkpoint_rng.py", "tests/sync/test_fingerprint.py",
    "tests/sync/test_streamer_cuda.py", "tests/rollout/test_engine_device.py",
    "tests/rollout/test_generate_distribution.py::test_first_two_tokens_follow_the_target_on_cuda",
    "tests/rl/test_trainer_pieces.py", "tests/rl/test_colocate_offload.py",
]


# ---------------------------------------------------------------------- prepare (CPU machine)
def prepare(kit: Path) -> int:
    """Fill ``kit`` with megatron-core's cp312 wheels and the test models; idempotent."""
    wheels = kit / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for version in WHEELS:
        if not list(wheels.glob(f"megatron_core-{version}-*.whl")):
            print(f"[prepare] downloading megatron-core {version} (cp312, no dependencies)", flush=True)
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--only-binary=:all:",
                    "--python-version",
                    "3.12",
                    "--implementation",
                    "cp",
                    "--platform",
                    "manylinux_2_28_x86_64",
                    "--platform",
                    "manylinux_2_24_x86_64",
                    "--platform",
                    "manylinux_2_17_x86_64",
                    "-d",
                    str(wheels),
                    f"megatron-core=={version}",
                ],
                check=True,
            )
    models = kit / "models"
    if not (models / "setup.json").is_file():
        print(
            "[prepare] making the test models (ModelOpt trains the EAGLE-3 draft; about a minute)", flush=True
        )
        if models.exists():
            shutil.rmtree(models)
        models.mkdir(parents=True)
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        subprocess.run(
            [sys.executable, "-m", "tests.model_factory", str(models)], check=True, cwd=ROOT, env=env
        )
    if not (models / "mtp" / "config.json").is_file():
        _make_mtp(models)
    size = sum(f.stat().st_size for f in kit.rglob("*") if f.is_file())
    print(f"[prepare] {kit}: {size / 2**20:.1f} MiB (limit {KIT_LIMIT_BYTES >> 20} MiB)")
    if size > KIT_LIMIT_BYTES:
        print(f"[prepare] error: the kit is over {KIT_LIMIT_BYTES >> 20} MiB", file=sys.stderr)
        return 1
    return 0


def _make_mtp(models: Path) -> None:
    """An MTP export for the test target (random heads; the engine and the trainer load it)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from megatron_spec.draft.mtp_head import MtpHead
    from megatron_spec.draft.mtp_io import save_mtp
    from tests.model_factory import load_setup

    setup = load_setup(str(models))
    torch.manual_seed(0)
    head = MtpHead(setup.cfg, 1)
    save_mtp(models / "mtp", {n: t.detach().clone() for n, t in head.named_export_tensors()}, setup.cfg, 1)


# ---------------------------------------------------------------------- the run
class Run:
    """Runs steps as subprocesses with time limits, logging each, until a deadline."""

    def __init__(self, out: Path, deadline_s: float, env: dict[str, str]):
        self.out, self.env = out, env
        self.logs = out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + deadline_s
        self.steps: list[dict] = []

    def step(
        self, name: str, cmd: list[str] | str, limit_s: float, *, env: dict[str, str] | None = None
    ) -> bool:
        left = self.deadline - time.monotonic()
        limit = min(limit_s, left)
        log = self.logs / f"{name}.log"
        rec = {
            "step": name,
            "limit_s": round(limit, 1),
            "command": cmd if isinstance(cmd, str) else " ".join(cmd),
        }
        if limit < 5:
            rec.update(status="skipped", seconds=0.0, why="the run's deadline has passed")
            self.steps.append(rec)
            print(f"[gpu-check] {name}: skipped (deadline)", flush=True)
            return False
        print(f"[gpu-check] {name} (at most {limit:.0f} s) ...", flush=True)
        t = time.monotonic()
        with open(log, "w") as f:
            try:
                proc = subprocess.run(
                    cmd,
                    shell=isinstance(cmd, str),
                    cwd=ROOT,
                    env=dict(self.env, **(env or {})),
                    stdout=f,
                    stderr=subprocess.STDOUT,
                    timeout=limit,
                    executable="/bin/bash" if isinstance(cmd, str) else None,
                )
                status = "passed" if proc.returncode == 0 else f"failed (exit {proc.returncode})"
            except subprocess.TimeoutExpired:
                status = f"timed out after {limit:.0f} s"
        rec.update(status=status, seconds=round(time.monotonic() - t, 1), tail=_tail(log))
        self.steps.append(rec)
        print(f"[gpu-check] {name}: {status} in {rec['seconds']} s", flush=True)
        return status == "passed"


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run(args) -> int:
    out = Path(args.out or os.environ.get("OUT") or ROOT / "gpu_check_out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    kit = Path(args.kit).resolve()
    dry = args.dry_run
    py = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1", MEGATRON_SPEC_TEST_MODELS=str(kit / "models"))
    env.pop("OUT", None)
    site = Path(args.site)
    inherited = [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []
    env["PYTHONPATH"] = os.pathsep.join(([] if dry else [str(site)]) + [str(ROOT)] + inherited)
    r = Run(out, args.deadline_s, env)
    models = kit / "models"
    if not (models / "setup.json").is_file():
        print(
            f"[gpu-check] {models}: no prepared models; run scripts/gpu_check.sh --prepare first",
            file=sys.stderr,
        )
        return 2

    # 1. the environment
    r.step(
        "env",
        "nvidia-smi || true; nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem "
        "--format=csv || true; "
        f'{py} -c \'import torch, sys; print(sys.version); print("torch", torch.__version__, "cuda", '
        "torch.version.cuda, torch.cuda.is_available(), torch.cuda.get_device_name() if "
        'torch.cuda.is_available() else "-")\'; nvcc --version || true; nproc; free -g; '
        f"{py} -m megatron_spec info",
        60,
    )
    # 2. megatron-core from the carried wheels
    if dry:  # the wheels are for Python 3.12: check them, use the environment's megatron-core
        code = ("import sys, zipfile, glob\n"
                f"w = sorted(glob.glob('{kit}/wheels/megatron_core-*.whl'))\n"
                f"assert len(w) == {len(WHEELS)}, w\n"
                "for f in w: assert zipfile.ZipFile(f).testzip() is None, f\n"
                "import megatron.core; print('dry run: wheels', w, '; using', megatron.core.__version__)\n")
        r.step("install", [py, "-c", code], 60)
    else:
        tries = " || ".join(
            f"(rm -rf {site} && {py} -m pip install -q --no-index --no-deps --no-compile --target {site} "
            f"{kit}/wheels/megatron_core-{v}-*.whl && PYTHONPATH={site} {py} -c 'import megatron.core as m; "
            f"from megatron.core.models.gpt import GPTModel; print(\"megatron-core\", m.__version__)')"
            for v in WHEELS)
        r.step("install", tries, 90)
    # 3. the extension, for sm_90
    if dry:
        r.step(
            "build",
            [
                py,
                "-c",
                "from megatron_spec import _ext; assert _ext.compiled_ops_available(); "
                "print('dry run: the CPU extension built by setup_env:', _ext.kernel_isa())",
            ],
            60,
        )
    else:
        r.step(
            "build",
            f"MAX_JOBS=$(nproc) MEGATRON_SPEC_CUDA_ARCHS=90 {py} setup.py build_ext --inplace && "
            f'{py} -c "import torch; from megatron_spec import ops; '
            f"assert ops.compiled_kernel_for('verify_chain', torch.device('cuda')), 'no CUDA kernels'; "
            f"print('CUDA kernels: yes')\"",
            240,
        )
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--durations=10"]
    # 4. the ops against their references
    r.step("ops", pytest + ["-m", "gpu", "tests/ops", "tests/ops/test_ops_devices.py"], 120)
    # 5. what the simulator assumes
    costs = out / "forward_costs.json"
    r.step("forward_costs", [py, "benchmarks/measure_forward_costs.py", "--out", str(costs)]
           + (["--quick", "--device", "cpu"] if dry else ["--device", "cuda"]), 150)
    # 6. the trainer and the engine on the GPU
    # (the dry run collects every smoke test and runs the gpu-marked ones, which skip here: the suite runs the
    # rest of these files anyway, and twice would cost CI a minute)
    r.step("smoke", pytest + (["-m", "gpu"] if dry else []) + SMOKE_TESTS, 200)
    # 7. two short GRPO runs on the native engine
    steps = 2 if dry else 6
    grpo = [
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "1",
        "--master_port",
        str(args.port),
        "launch/pretrain_grpo_spec.py",
        "--hf-checkpoint",
        str(models / "target"),
        "--prompt-data",
        "synthetic:sum",
        "--reward",
        "synthetic",
        "--rollout-backend",
        "native",
        "--prompts-per-step",
        "4",
        "--grpo-group-size",
        "4",
        "--micro-batch-size",
        "8",
        "--rollout-max-new-tokens",
        "24",
        "--max-prompt-length",
        "32",
        "--train-iters",
        str(steps),
        "--log-interval",
        "1",
        "--make-vocab-size-divisible-by",
        "8",
    ]
    setup = json.loads((models / "setup.json").read_text())
    r.step("grpo_fp8", [py] + grpo + [
        "--rollout-weight-dtype", "fp8", "--colocate-offload", "all", "--spec-draft-kind", "eagle3",
        "--spec-draft-path", str(models / setup["eagle3"]), "--spec-online-draft-training",
        "--spec-num-draft-tokens", "3", "--save", str(out / "runs" / "grpo_fp8")], 110)
    r.step("grpo_bf16_mtp", [py] + grpo + [
        "--bf16", "--spec-draft-kind", "mtp", "--spec-online-draft-training", "--spec-num-draft-tokens", "2",
        "--seed", "7", "--save", str(out / "runs" / "grpo_bf16")], 110)
    return finish(r, out, costs, dry)


def finish(r: Run, out: Path, costs: Path, dry: bool) -> int:
    for name in ("grpo_fp8", "grpo_bf16"):  # the runs' metrics travel in the logs' archive
        src = out / "runs" / name / "metrics.jsonl"
        if src.is_file():
            shutil.copy(src, r.logs / f"{name}_metrics.jsonl")
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    summary = {"kit": "scripts/gpu_check.sh", "dry_run": dry, "commit": commit or None,
               "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "seconds": round(time.monotonic() - r.t0, 1),
               "passed": sum(s["status"] == "passed" for s in r.steps), "steps": r.steps,
               "forward_costs": costs.name if costs.is_file() else None}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(r.logs, arcname="logs")
    shutil.rmtree(r.logs)
    shutil.rmtree(out / "runs", ignore_errors=True)  # checkpoints stay behind: at most 8 files come back
    print("\n[gpu-check] step             status                          seconds")
    for s in r.steps:
        print(f"[gpu-check] {s['step']:<16} {s['status']:<31} {s['seconds']:>7}")
    print(
        f"[gpu-check] {summary['passed']}/{len(r.steps)} passed in {summary['seconds']} s; {out}/summary.json"
    )
    return 0 if summary["passed"] == len(r.steps) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="fill the kit folder (CPU machine)")
    p.add_argument("--kit", default=str(KIT))
    p = sub.add_parser("run", help="run the steps (GPU machine; --dry-run on the CPU)")
    p.add_argument("--kit", default=str(KIT))
    p.add_argument("--out", default=None, help="where the summary goes (default $OUT, else gpu_check_out/)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--deadline-s", type=float, default=None)
    p.add_argument("--site", default="/tmp/megatron_spec_site", help="where megatron-core is installed")
    p.add_argument("--port", type=int, default=29531)
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        return prepare(Path(args.kit))
    if args.deadline_s is None:
        args.deadline_s = 1800.0 if args.dry_run else DEADLINE_S
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
