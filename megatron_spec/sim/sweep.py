"""Sweeps: speedup vs draft length k and acceptance, and vs batch size, per model, as tables and a PNG.

Each line of the k sweep is one acceptance profile: geometric profiles alpha^i for a few alpha,
plus the profile the user gave. For every k the simulator runs the full RL step, so the
table's optimum k is where the extra accepted tokens stop paying for the longer verify and
draft. The batch sweep prices one decode step and one speculative step of B sequences (at
the workload's mean context) for each k with the given acceptance: tau x t_decode / t_spec,
and marks the smallest B at which it falls below 1, where speculation stops paying (memory-
bound small batches gain; compute-bound large batches, where verifying k+1 tokens costs k+1
times a decode, lose). The layout is the one the search picks when tp/ep are not given.
Plotting uses matplotlib's Agg backend (no display needed).

What it does not know: acceptance that changes with k for reasons other than the profile
(a draft trained for a fixed unroll), or with batch size.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from megatron_spec.sim.acceptance import AcceptanceProfile
from megatron_spec.sim.hardware import get_hardware
from megatron_spec.sim.layout import pin_layout
from megatron_spec.sim.rl_step import SimConfig, build_acceptance, build_step_model, simulate
from megatron_spec.sim.workload import Workload

DEFAULT_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)
DEFAULT_BATCHES = tuple(2 ** i for i in range(11))  # 1 .. 1024 sequences per engine


def batch_sweep(cfg: SimConfig, batches=DEFAULT_BATCHES, k_values=range(1, 6)) -> list[dict]:
    """Rows {model, hardware, tp, ep, k, batch, accept_length, step_speedup, pays} of one decode
    step vs one speculative step per engine, for ``cfg``'s model, hardware, layout (searched
    when tp/ep are None) and acceptance profile, at the workload's mean context per sequence."""
    profile = build_acceptance(cfg)
    pinned = pin_layout(cfg)
    wl: Workload = cfg.workload
    ctx = wl.prompt_len + wl.mean_response_len() / 2.0
    b = np.asarray(batches, dtype=float)
    rows = []
    for k in k_values:
        steps = build_step_model(pinned, k)
        tau = profile.accept_length(k)
        ar = steps.ar_step(b, b * ctx)["total"]
        spec = steps.spec_step(b, b * ctx)["total"]
        for bi, t_ar, t_spec in zip(b, ar, spec):
            x = tau * float(t_ar) / float(t_spec)
            rows.append({"model": steps.target.model.name, "hardware": steps.target.hw.name, "tp": pinned.tp,
                         "ep": pinned.ep, "k": k, "batch": int(bi), "accept_length": tau,
                         "step_speedup": x, "pays": x > 1.0})
    return rows


def break_even(rows: list[dict]) -> dict[int, int | None]:
    """For each k, the smallest swept batch at which speculation no longer pays (None: pays at
    every swept batch)."""
    out: dict[int, int | None] = {}
    for r in sorted(rows, key=lambda r: (r["k"], r["batch"])):
        out.setdefault(r["k"], None)
        if out[r["k"]] is None and not r["pays"]:
            out[r["k"]] = r["batch"]
    return out


def format_batch_table(rows: list[dict]) -> str:
    ks = sorted({r["k"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    by = {(r["k"], r["batch"]): r["step_speedup"] for r in rows}
    head = f"{'batch':>6} " + " ".join(f"{'k=' + str(k):>7}" for k in ks)
    lines = [f"per-step speedup tau x t_decode / t_spec ({rows[0]['model']} on {rows[0]['hardware']}, "
             f"tp={rows[0]['tp']} ep={rows[0]['ep']}; * = speculation loses)", head, "-" * len(head)]
    for bt in batches:
        lines.append(
            f"{bt:>6} " + " ".join(f"{by[(k, bt)]:>6.2f}{'*' if by[(k, bt)] <= 1 else ' '}" for k in ks)
        )
    return "\n".join(lines)


def sweep(cfg: SimConfig, models: list[str] | None = None, alphas=DEFAULT_ALPHAS,
          k_values=range(1, 11), include_given: bool = True, hardware: list[str] | None = None) -> list[dict]:
    """Rows {model, hardware, profile, k, accept_length, rollout_speedup, e2e_speedup, optimal}
    for every model x hardware x acceptance profile x k."""
    given = build_acceptance(cfg) if include_given else None
    profiles: list[tuple[str, AcceptanceProfile]] = []
    if given is not None:
        profiles.append(("given", given))
    profiles += [(f"alpha={a:g}", AcceptanceProfile.geometric(a, max(k_values))) for a in alphas]
    base = cfg.replace(accept_length=None, accept_rates=None)
    base_kind = get_hardware(base.hardware).kind if isinstance(base.hardware, str) else base.hardware.kind
    rows = []
    for hw_name in hardware or [base.hardware]:
        hw = get_hardware(hw_name) if isinstance(hw_name, str) else hw_name
        # the fitted GPU parameters do not apply to the cpu profile and vice versa
        per_hw = base.replace(hardware=hw) if hw.kind == base_kind else base.replace(
            hardware=hw, efficiency=None, engine=None)
        for model in models or [cfg.model]:
            # the layout the search picks for this model and hardware at the given acceptance
            lay = pin_layout(
                cfg.replace(hardware=hw, model=model, efficiency=per_hw.efficiency, engine=per_hw.engine)
            )
            per_model = per_hw.replace(tp=lay.tp, ep=lay.ep)
            for label, prof in profiles:
                block = []
                for k in k_values:
                    rates = tuple(prof.marginal(k))
                    r = simulate(per_model.replace(model=model, num_draft_tokens=k, accept_rates=rates))
                    block.append({"model": r.detail["model"], "hardware": hw.name, "profile": label, "k": k,
                                  "accept_length": 1.0 + sum(rates), "rollout_speedup": r.rollout_speedup,
                                  "e2e_speedup": r.e2e_speedup, "optimal": False})
                max(block, key=lambda row: row["e2e_speedup"])["optimal"] = True
                rows += block
    return rows


def format_table(rows: list[dict]) -> str:
    head = f"{'model':<18} {'hardware':<8} {'profile':<11} {'k':>3} {'tau':>6} {'rollout_x':>10} {'e2e_x':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        mark = "  <- best k" if r["optimal"] else ""
        lines.append(
            f"{r['model']:<18} {r['hardware']:<8} {r['profile']:<11} {r['k']:>3} {r['accept_length']:>6.2f} "
            f"{r['rollout_speedup']:>10.3f} {r['e2e_speedup']:>7.3f}{mark}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str | Path, title: str = "", batch_rows: list[dict] | None = None) -> Path:
    """One row of panels per model x hardware: speedup vs k (generation, RL step) and, with
    ``batch_rows``, the per-step speedup vs batch size per k, the break-even batch marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    panels = list(dict.fromkeys((r["model"], r["hardware"]) for r in rows))
    cols = 3 if batch_rows else 2
    fig, axes = plt.subplots(len(panels), cols, figsize=(5.5 * cols, 3.6 * len(panels)), squeeze=False)
    for i, (model, hw) in enumerate(panels):
        mine = [r for r in rows if r["model"] == model and r["hardware"] == hw]
        for j, metric in enumerate(("rollout_speedup", "e2e_speedup")):
            ax = axes[i][j]
            for label in dict.fromkeys(r["profile"] for r in mine):
                pts = [r for r in mine if r["profile"] == label]
                ax.plot([p["k"] for p in pts], [p[metric] for p in pts], marker="o", ms=3,
                        lw=2.2 if label == "given" else 1.2, label=label)
                best = max(pts, key=lambda p: p["e2e_speedup"])
                ax.plot([best["k"]], [best[metric]], marker="*", ms=10, color="black")
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xlabel("draft tokens k")
            ax.set_ylabel("rollout speedup" if j == 0 else "end-to-end step speedup")
            ax.set_title(f"{model} on {hw}: {'generation' if j == 0 else 'RL step'}")
            ax.grid(alpha=0.3)
        axes[i][0].legend(fontsize=8)
        mine_b = [r for r in batch_rows or [] if r["model"] == model and r["hardware"] == hw]
        if cols == 3:
            ax = axes[i][2]
            for k, edge in break_even(mine_b).items():
                pts = [r for r in mine_b if r["k"] == k]
                line, = ax.plot([p["batch"] for p in pts], [p["step_speedup"] for p in pts], marker="o", ms=3,
                                label=f"k={k} (tau {pts[0]['accept_length']:.2f})")
                if edge is not None:  # where speculation stops paying
                    y = next(p["step_speedup"] for p in pts if p["batch"] == edge)
                    ax.plot([edge], [y], marker="X", ms=9, color=line.get_color())
                    ax.axvline(edge, color=line.get_color(), lw=0.6, ls=":")
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("sequences per engine (batch)")
            ax.set_ylabel("per-step speedup")
            lay = f"tp={mine_b[0]['tp']} ep={mine_b[0]['ep']}" if mine_b else ""
            ax.set_title(f"{model} on {hw} ({lay}): X = stops paying", fontsize=9)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
