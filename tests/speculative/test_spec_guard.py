"""check_lossless: lossy engine settings are refused with messages that name them."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from megatron_spec.speculative import LossyConfigError, SamplingTensors, check_lossless


def sglang_args(**overrides) -> SimpleNamespace:
    """The ServerArgs fields the guard reads, at SGLang 0.5.23's defaults, for an EAGLE-3 engine."""
    base = dict(
        speculative_algorithm="EAGLE3",
        speculative_num_steps=3,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=4,
        speculative_accept_threshold_single=1.0,
        speculative_accept_threshold_acc=1.0,
        speculative_use_rejection_sampling=True,
        device="cuda",
    )
    base.update(overrides)
    return SimpleNamespace(**base)


SAMPLED = SamplingTensors.from_values([0.7, 1.0], top_p=[0.9, 1.0])
GREEDY = SamplingTensors.from_values([0.0, 0.0])


def test_exact_settings_pass():
    check_lossless(sglang_args(), sampling=SAMPLED, environ={}, is_rocm=False)
    check_lossless(sglang_args(speculative_algorithm="NGRAM", speculative_use_rejection_sampling=False),
                   sampling=SAMPLED, environ={}, is_rocm=False)
    check_lossless({"num_draft_tokens": 3, "accept_threshold_single": 1.0}, environ={}, is_rocm=False)


@pytest.mark.parametrize("field,value", [
    ("speculative_accept_threshold_single", 0.9),
    ("speculative_accept_threshold_acc", 0.5),
    ("speculative_accept_threshold_acc", 1.5),
])
def test_thresholds_other_than_one_are_refused(field, value):
    with pytest.raises(LossyConfigError, match=f"{field} = {value}"):
        check_lossless(sglang_args(**{field: value}), sampling=SAMPLED, environ={}, is_rocm=False)


def test_lossy_config_error_is_a_value_error():
    assert issubclass(LossyConfigError, ValueError)


def test_our_nested_dataclass_config():
    @dataclasses.dataclass
    class Spec:
        num_draft_tokens: int = 3
        accept_threshold_single: float = 1.0
        acceptance_method: str = "rejection"

    @dataclasses.dataclass
    class Rollout:
        backend: str = "native"
        spec: Spec = dataclasses.field(default_factory=Spec)

    check_lossless(Rollout(), sampling=SAMPLED, environ={}, is_rocm=False)
    with pytest.raises(LossyConfigError, match=r"spec\.accept_threshold_single = 0\.8"):
        check_lossless(Rollout(spec=Spec(accept_threshold_single=0.8)), environ={}, is_rocm=False)
    with pytest.raises(LossyConfigError, match="typical"):
        check_lossless(Rollout(spec=Spec(acceptance_method="typical")), environ={}, is_rocm=False)


def test_run_config_shape_with_sampling_inside():
    """Our RunConfig layout: rollout.rollout_* sampling fields, draft.spec_draft_kind."""

    @dataclasses.dataclass
    class Rollout:
        rollout_backend: str = "sglang"
        rollout_temperature: float = 1.0
        rollout_min_p: float = 0.0

    @dataclasses.dataclass
    class Spec:
        spec_draft_kind: str = "eagle3"
        spec_num_draft_tokens: int = 3

    @dataclasses.dataclass
    class Run:
        rollout: Rollout = dataclasses.field(default_factory=Rollout)
        spec: Spec = dataclasses.field(default_factory=Spec)

    check_lossless(Run(), environ={}, is_rocm=False)
    with pytest.raises(LossyConfigError, match="min_p = 0.05"):
        check_lossless(Run(rollout=Rollout(rollout_min_p=0.05)), environ={}, is_rocm=False)
    # greedy rows ignore min_p; the native engine applies it; no speculation, no SGLang verify
    check_lossless(
        Run(rollout=Rollout(rollout_min_p=0.05, rollout_temperature=0.0)), environ={}, is_rocm=False
    )
    check_lossless(
        Run(rollout=Rollout(rollout_backend="native", rollout_min_p=0.05)), environ={}, is_rocm=False
    )
    check_lossless(Run(rollout=Rollout(rollout_min_p=0.05), spec=Spec(spec_draft_kind="none")), environ={},
                   is_rocm=False)


def test_other_engines_lossy_acceptance():
    with pytest.raises(LossyConfigError, match="typical"):
        check_lossless(
            {"spec_decoding_acceptance_method": "typical_acceptance_sampler"}, environ={}, is_rocm=False
        )
    with pytest.raises(LossyConfigError, match="relaxed"):
        check_lossless({"use_relaxed_acceptance_for_thinking": True}, environ={}, is_rocm=False)


def test_simulated_acceptance_env():
    with pytest.raises(LossyConfigError, match="SGLANG_SIMULATE_ACC_LEN"):
        check_lossless(
            sglang_args(), sampling=SAMPLED, environ={"SGLANG_SIMULATE_ACC_LEN": "3.2"}, is_rocm=False
        )
    check_lossless(sglang_args(), sampling=SAMPLED, environ={"SGLANG_SIMULATE_ACC_LEN": "-1"}, is_rocm=False)


def test_greedy_verification_devices():
    # SGLang's EAGLE verify takes the argmax on CPU / XPU: exact only for temperature 0.
    with pytest.raises(LossyConfigError, match="argmax on device 'cpu'"):
        check_lossless(sglang_args(device="cpu"), sampling=SAMPLED, environ={}, is_rocm=False)
    with pytest.raises(LossyConfigError, match="unknown"):
        check_lossless(sglang_args(device="xpu"), environ={}, is_rocm=False)
    check_lossless(sglang_args(device="cpu"), sampling=GREEDY, environ={}, is_rocm=False)
    # ROCm: greedy unless rejection sampling routes verify through the Triton sampler
    with pytest.raises(LossyConfigError, match="ROCm"):
        check_lossless(sglang_args(speculative_use_rejection_sampling=False), sampling=SAMPLED, environ={},
                       is_rocm=True)
    check_lossless(sglang_args(), sampling=SAMPLED, environ={}, is_rocm=True)


def test_min_p_is_not_applied_by_sglang_verify():
    with_min_p = SamplingTensors.from_values([0.7, 0.0], min_p=[0.1, 0.0])
    with pytest.raises(LossyConfigError, match="min_p = 0.1"):
        check_lossless(sglang_args(), sampling=with_min_p, environ={}, is_rocm=False)
    # min_p on a greedy row changes nothing
    check_lossless(sglang_args(), sampling=SamplingTensors.from_values([0.0], min_p=[0.3]), environ={},
                   is_rocm=False)
    # our native engine applies min_p through process_logits: fine there
    check_lossless({"backend": "native"}, sampling=with_min_p, environ={}, is_rocm=False)
    check_lossless(sglang_args(), sampling={"temperature": 1.0, "min_p": 0.0}, environ={}, is_rocm=False)


def test_unreviewed_algorithms_are_refused():
    with pytest.raises(LossyConfigError, match="DFLASH"):
        check_lossless(
            sglang_args(speculative_algorithm="DFLASH"), sampling=GREEDY, environ={}, is_rocm=False
        )


def test_every_problem_is_listed_at_once():
    with pytest.raises(LossyConfigError) as info:
        check_lossless(
            sglang_args(
                speculative_accept_threshold_single=0.5, speculative_accept_threshold_acc=0.5, device="cpu"
            ),
            sampling=SAMPLED,
            environ={"SGLANG_SIMULATE_ACC_LEN": "2"},
            is_rocm=False,
        )
    msg = str(info.value)
    for needle in ("threshold_single", "threshold_acc", "argmax", "SIMULATE"):
        assert needle in msg


@pytest.mark.sglang
def test_real_sglang_server_args():
    server_args = pytest.importorskip("sglang.srt.server_args", reason="sglang is not installed")
    args = server_args.ServerArgs(model_path="/nonexistent", speculative_algorithm="EAGLE3",
                                  speculative_accept_threshold_single=0.5)
    with pytest.raises(LossyConfigError, match="speculative_accept_threshold_single = 0.5"):
        check_lossless(args, sampling=SAMPLED, environ={}, is_rocm=False)
    ok = server_args.ServerArgs(model_path="/nonexistent", speculative_algorithm="EAGLE3")
    check_lossless(ok, sampling=SAMPLED, environ={}, is_rocm=False)
