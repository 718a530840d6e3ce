"""The policy's optimizer: AdamW on fp32 main weights, whatever dtype the model computes in.

With ``--bf16`` the model's weights are bf16 (the forward and backward run in bf16), but an
update of lr * m/sqrt(v) ~ 1e-6 is far below half a bf16 ulp of a weight of 0.02 (2^-14 ~ 6e-5),
so AdamW stepping bf16 weights directly rounds every update away: with lr 1e-6, 0 of 1000
weights changed in 10 steps. Mixed-precision training keeps an fp32 *main* copy of
every bf16 weight, runs AdamW (fp32 ``exp_avg`` / ``exp_avg_sq``) on the main copies with the
fp32 gradients megatron-core's DDP accumulates in ``param.main_grad``
(``grad_reduce_in_fp32=True``), and rounds the main copies back into the bf16 weights after
each step (megatron-core's ``Float16OptimizerWithFloat16Params``, Micikevicius et al. 2018,
"Mixed Precision Training"). fp32 weights are their own main copy: the fp32 path is plain
``torch.optim.AdamW`` on the model's parameters, exactly as before.

Why not megatron-core's own class: ``get_megatron_optimizer(OptimizerConfig(bf16=True))`` builds
``Float16OptimizerWithFloat16Params``, whose constructor accepts only parameters whose
``param.type()`` is ``torch.cuda.*Tensor`` and allocates its scalars with ``device='cuda'``
(megatron-core 0.16/0.19), so it cannot run, or be tested, on CPU. This class is the same
algorithm in torch's AdamW, and it runs on every device the model does.

Weight decay applies to matrices only: one-dimensional weights (the norms' scales and every
bias) are in a second parameter group with ``weight_decay=0`` (megatron-core's rule in
``optimizer/__init__.py``: no decay for biases and 1-D parameters; decaying a norm's scale pulls
it to 0, not to its initial 1).

What it does not know: data or tensor parallelism (gradients arrive reduced in ``main_grad``;
the caller computes the norm over its groups and clips through :meth:`grads`), schedules
(the caller sets ``param_groups[i]["lr"]``), where tensors live between phases
(``train/offload.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MixedPrecisionAdamW:
    """AdamW whose weights and moments are fp32; the model's weights follow after every step.

    Args:
        params: the model's trainable parameters (fp32 or bf16; under megatron-core DDP they
            carry ``main_grad``).
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8):
        self.params = list(params)
        # fp32 weights are their own main copy; bf16 ones get an fp32 copy on the same device
        self.main_params = [
            p if p.dtype == torch.float32 else p.detach().float().clone() for p in self.params
        ]
        decay = [m for m in self.main_params if m.dim() >= 2]
        no_decay = [m for m in self.main_params if m.dim() < 2]  # norms and biases
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def has_main_copies(self) -> bool:
        """True when some weight keeps a separate fp32 main copy (bf16 training)."""
        return any(m is not p for p, m in zip(self.params, self.main_params))

    def grads(self) -> list[torch.Tensor | None]:
        """The fp32 gradient of every main weight (``None`` where the weight got none), after
        pointing each main weight's ``.grad`` at it. In-place changes (clipping) are what
        :meth:`step` uses. Under megatron-core DDP these are views of its fp32 grad buffers: no copy."""
        out = []
        for p, main in zip(self.params, self.main_params):
            g = getattr(p, "main_grad", None)
            if g is None:
                g = p.grad
            if g is not None and g.dtype != torch.float32:  # grad_reduce_in_fp32=False: widen once
                g = g.float()
            main.grad = g
            out.append(g)
        return out

    def step(self) -> None:
        """One AdamW step on the main weights, then round them into the model's weights."""
        if not any(m.grad is not None for m in self.main_params):
            self.grads()
        self.optimizer.step()
        with torch.no_grad():
            for p, main in zip(self.params, self.main_params):
                if main is not p:
                    p.copy_(main)  # round to nearest into bf16
        for p, main in zip(self.params, self.main_params):
            main.grad = None
            if main is not p:
                p.grad = None  # a bf16 copy of the gradient (train/ddp.finalize_grads): not read, freed

    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor this optimizer owns beyond the model's weights: the fp32 main copies of
        bf16 weights and the AdamW moments (what ``--colocate-offload`` moves off the device)."""
        out = [m for p, m in zip(self.params, self.main_params) if m is not p]
        for state in self.optimizer.state.values():
            out.extend(v for k, v in state.items() if isinstance(v, torch.Tensor) and k != "step")
        return out

    def state_dict(self) -> dict[str, Any]:
        """AdamW's state plus the fp32 main weights (bf16 training resumes from them, not from the
        rounded bf16 weights)."""
        return {
            "adamw": self.optimizer.state_dict(),
            "main_params": [
                m.detach() if m is not p else None for p, m in zip(self.params, self.main_params)
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "adamw" not in state:  # a checkpoint saved by plain torch.optim.AdamW (fp32 runs)
            state = {"adamw": state, "main_params": [None] * len(self.params)}
        mains = state["main_params"]
        if len(mains) != len(self.params):
            raise ValueError(
                f"optimizer state holds {len(mains)} main weights, the model has {len(self.params)}"
            )
        with torch.no_grad():
            for p, main, saved in zip(self.params, self.main_params, mains):
                if main is p:
                    continue
                # a bf16 run resumed from an fp32-run checkpoint starts from its rounded weights
                main.copy_(saved if saved is not None else p)
        self.optimizer.load_state_dict(self._two_groups(state["adamw"]))

    # ------------------------------------------------------------------ megatron-core dist_checkpointing
    def _state_ids(self) -> list[int]:
        """For each of AdamW's state ids (its groups' parameters in order): the index of the model
        parameter."""
        index = {id(m): i for i, m in enumerate(self.main_params)}
        return [index[id(m)] for group in self.optimizer.param_groups for m in group["params"]]

    def _fill_state(self) -> None:
        """AdamW's per-weight state, made where a weight has none yet (before the first step, or a weight that
        never got a gradient): zeros and step 0, what AdamW itself starts from, so that a sharded state dict
        has every tensor to save or load into."""
        for group in self.optimizer.param_groups:
            for m in group["params"]:
                if not self.optimizer.state[m]:
                    self.optimizer.state[m] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(m),
                                               "exp_avg_sq": torch.zeros_like(m)}

    def sharded_state_dict(self, model_sharded_state_dict: dict[str, Any]) -> dict[str, Any]:
        """This optimizer's state for ``megatron.core.dist_checkpointing``: every AdamW moment and fp32 main
        weight a ``ShardedTensor`` sharded as its parameter is in ``model_sharded_state_dict`` (the model's
        ``sharded_state_dict()``), so a checkpoint saved at one TP/DP layout loads at another
        (``optimizer.state.exp_avg.<param key>``, megatron-core's own names); the hyper-parameters and the
        step counts are common state (every weight steps together)."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        self._fill_state()
        ids = self._state_ids()
        sharded = get_param_id_to_sharded_param_map(model_sharded_state_dict, [self.params[i] for i in ids])
        adamw = self.optimizer.state_dict()
        steps = {k: float(v["step"]) for k, v in adamw["state"].items()}
        optim_state_to_sharding_state(adamw, sharded, exclude_keys=("step",))
        for k, i in enumerate(ids):
            if self.main_params[i] is not self.params[i]:
                adamw["state"][k]["fp32_param"] = make_sharded_optimizer_tensor(
                    sharded[k], self.main_params[i], prefix="optimizer.state.fp32_param")
        return {"adamw": adamw, "steps": steps}

    def load_sharded_state_dict(self, loaded: dict[str, Any]) -> None:
        """The state :meth:`sharded_state_dict` described, as ``dist_checkpointing.load`` returned it."""
        adamw, steps = loaded["adamw"], loaded["steps"]
        ids = self._state_ids()
        with torch.no_grad():
            for k, state in adamw["state"].items():
                state["step"] = torch.tensor(steps[k])
                main = state.pop("fp32_param", None)
                i = ids[k]
                if main is not None and self.main_params[i] is not self.params[i]:
                    self.main_params[i].copy_(main)
                    self.params[i].copy_(main)  # the model computes with the rounded main weights
        self.optimizer.load_state_dict(adamw)

    def _two_groups(self, adamw: dict[str, Any]) -> dict[str, Any]:
        """AdamW state saved with one parameter group (before norms and biases got their own):
        its parameter indices follow the model's order; renumber them into the two groups."""
        if len(adamw["param_groups"]) != 1 or len(self.optimizer.param_groups) != 2:
            return adamw
        order = [i for i, m in enumerate(self.main_params) if m.dim() >= 2] + \
                [i for i, m in enumerate(self.main_params) if m.dim() < 2]
        new_index = {old: new for new, old in enumerate(order)}
        group = adamw["param_groups"][0]
        groups = [dict(group, params=list(range(n0 := sum(m.dim() >= 2 for m in self.main_params)))),
                  dict(group, params=list(range(n0, len(order))), weight_decay=0.0)]
        return {"state": {new_index[i]: v for i, v in adamw["state"].items()}, "param_groups": groups}
