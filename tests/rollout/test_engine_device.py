"""The native engine on the device it is given (issue 27, defect 2: it was CPU-only).

On this machine the engine runs on the CPU while :class:`~tests.device_utils.OtherDefaultDevice` sends
every tensor the package makes without a device to ``meta``: a step that mixed a device-less tensor with
the model's would fail here as it would on a GPU, in every drafter and every kind of step (prefill
riding along a step, plain, chain, history-only, tree, packed verify). The rollouts must be the same
tokens as without the check. The GPU tests run the same engines on CUDA: greedy speculative output
equal to autoregressive output and to the CPU engine's, and sampled output following the target.
"""

from __future__ import annotations

import pytest
import torch

from megatron_spec.rollout.config import EngineConfig
from megatron_spec.rollout.native.server import EngineServer
from megatron_spec.rollout.types import GenerateRequest, SamplingParams
from tests.device_utils import OtherDefaultDevice

CONFIGS = {
    "none": dict(draft_kind="none"),
    "ngram": dict(draft_kind="ngram", num_draft_tokens=3),
    "model": dict(draft_kind="model", num_draft_tokens=3),
    "eagle3": dict(draft_kind="eagle3", num_draft_tokens=3),
    "mtp": dict(draft_kind="mtp", num_draft_tokens=3, mtp_num_layers=2),
    "history": dict(draft_kind="history", num_draft_tokens="auto", max_draft_tokens=4),
    "eagle3-auto-history-tree": dict(draft_kind="eagle3", num_draft_tokens="auto", max_draft_tokens=3,
                                     history=True, history_max_draft_tokens=6),  # trees by the test hook
    "model-auto-history": dict(draft_kind="model", num_draft_tokens="auto", max_draft_tokens=3, history=True,
                               history_max_draft_tokens=6, history_tree="off"),
}


@pytest.fixture(scope="module")
def mtp_export(setup, tmp_path_factory) -> str:
    """Two random MTP heads for the target, as an export the engine loads."""
    from megatron_spec.draft.mtp_head import MtpHead
    from megatron_spec.draft.mtp_io import save_mtp

    torch.manual_seed(0)
    head = MtpHead(setup.cfg, 2)
    path = tmp_path_factory.mktemp("mtp") / "mtp"
    save_mtp(path, {n: t.detach().clone() for n, t in head.named_export_tensors()}, setup.cfg, 2)
    return str(path)


@pytest.fixture(autouse=True)
def _mtp_path(setup, mtp_export):
    setup.__dict__.setdefault("mtp", mtp_export)


def server_for(setup, name: str, device: str = "cpu", **kw) -> EngineServer:
    cfg = dict(CONFIGS[name], **kw)
    path = {"eagle3": setup.eagle3, "model": setup.draft_model, "mtp": getattr(setup, "mtp", None)}.get(
        cfg["draft_kind"])
    with pytest.MonkeyPatch.context() as mp:  # the controller reads the test hook when the server builds it
        if name.endswith("-tree"):
            mp.setenv("MEGATRON_SPEC_TEST_HOOKS", "history_tree_always")
        return EngineServer(EngineConfig(model_path=setup.target, draft_path=path, context_length=96,
                                         max_batch_size=6, device=device, seed=3, **cfg))


def requests(cfg, seed: int = 5) -> list[GenerateRequest]:
    """Greedy and sampled rows together; more samples than slots, so prompts are admitted while others run
    (their prefill rides along a step) and rows retire mid-batch."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(6):
        prompt = torch.randint(4, cfg.vocab_size, (3 + i,), generator=g).tolist()
        temperature = 0.0 if i % 2 else 1.0
        out.append(
            GenerateRequest(
                f"r{i}",
                prompt * 2,
                SamplingParams(temperature=temperature, top_k=8, top_p=0.9, max_new_tokens=18 + 3 * i),
                n=1 + i % 3,
            )
        )
    return out


def tokens(samples) -> list[tuple[str, int, list[int]]]:
    return [(s.request_id, s.sample_index, s.output_ids) for s in samples]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_tensor_a_step_makes_is_on_the_engines_device(setup, name):
    reqs = requests(setup.cfg)
    plain = server_for(setup, name)
    # the second call drafts from history too
    want = [tokens(plain.generate(reqs, seed=7)[0]) for _ in range(2)]
    server = server_for(setup, name)  # built outside the check: its modules are made, then moved
    mode = OtherDefaultDevice()
    with mode:  # raises at the first tensor made off the engine's device
        got = [tokens(server.generate(reqs, seed=7)[0]) for _ in range(2)]
    assert mode.redirected == [], f"tensors made without a device at {sorted(set(mode.redirected))}"
    if CONFIGS[name].get("num_draft_tokens") == "auto":
        # adaptive k follows measured step times, and a sampled row's draws follow the steps it ran: only
        # greedy rows are the same tokens whatever the steps (odd request ids are greedy)
        greedy = lambda calls: [[t for t in c if int(t[0][1:]) % 2] for c in calls]
        got, want = greedy(got), greedy(want)
    assert got == want


def test_device_is_checked_and_reported(setup):
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
        EngineConfig(model_path=setup.target, device="gpu0")
    with pytest.raises(ValueError, match="device must be cpu, cuda or cuda:N"):
        EngineConfig(model_path=setup.target, device="cpu:1")
    assert EngineConfig(model_path=setup.target, device="cuda:1").device_type == "cuda"
    assert server_for(setup, "none").info()["device"] == "cpu"


# ------------------------------------------------------------------ on a GPU

cuda = pytest.mark.gpu


def greedy_requests(cfg, n: int = 8) -> list[GenerateRequest]:
    g = torch.Generator().manual_seed(11)
    return [GenerateRequest(f"g{i}", torch.randint(4, cfg.vocab_size, (4 + i % 5,), generator=g).tolist(),
                            SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True), n=1 + i % 2)
            for i in range(n)]


@cuda
@pytest.mark.parametrize("name", ["ngram", "model", "eagle3", "mtp", "eagle3-auto-history-tree"])
def test_cuda_greedy_speculative_equals_autoregressive_and_the_cpu_engine(setup, name):
    reqs = greedy_requests(setup.cfg)
    ar = tokens(server_for(setup, "none", device="cuda", dtype="float32").generate(reqs)[0])
    spec_server = server_for(setup, name, device="cuda", dtype="float32")
    assert next(spec_server.target.parameters()).is_cuda and spec_server.core.cache.k[0].is_cuda
    for _ in range(2):
        samples, stats = spec_server.generate(reqs)
        assert tokens(samples) == ar
    assert stats.spec_steps > 0
    cpu = tokens(server_for(setup, name, device="cpu", dtype="float32").generate(reqs)[0])
    assert cpu == ar


@cuda
def test_cuda_engine_runs_the_cuda_verify_kernel(setup, monkeypatch):
    """The CUDA verify kernel is on the engine's hot path (it had no run-time caller)."""
    from megatron_spec import ops

    if not ops.compiled_kernel_for("verify_chain", torch.device("cuda")):
        pytest.skip("megatron_spec._C was built without CUDA kernels")
    calls = []
    real = torch.ops.megatron_spec.verify_chain

    class Spy:
        def __call__(self, *args):
            calls.append(args[0].device.type)
            return real(*args)

    monkeypatch.setattr(torch.ops.megatron_spec, "verify_chain", Spy())
    server_for(setup, "eagle3", device="cuda").generate(requests(setup.cfg))
    assert calls and set(calls) == {"cuda"}
