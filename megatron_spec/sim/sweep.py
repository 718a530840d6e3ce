"""Sweeps: speedup vs draft length k and acceptance, per model, as a table and a PNG.

Each line of the sweep is one acceptance profile: geometric profiles alpha^i for a few alpha,
plus the profile the user gave. For every k the simulator runs the full RL step, so the
table's optimum k is where the extra accepted tokens stop paying for the longer verify and
draft. Plotting uses matplotlib's Agg backend (no display needed).

What it does not know: acceptance that changes with k for reasons other than the profile
(a draft trained for a fixed unroll), or with batch size.
"""

from __future__ import annotations

from pathlib import Path

from megatron_spec.sim.acceptance import AcceptanceProfile
from megatron_spec.sim.hardware import get_hardware
from megatron_spec.sim.rl_step import SimConfig, build_acceptance, simulate

DEFAULT_ALPHAS = (0.5, 0.6, 0.7, 0.8, 0.9)


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
            for label, prof in profiles:
                block = []
                for k in k_values:
                    rates = tuple(prof.marginal(k))
                    r = simulate(per_hw.replace(model=model, num_draft_tokens=k, accept_rates=rates))
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
        lines.append(f"{r['model']:<18} {r['hardware']:<8} {r['profile']:<11} {r['k']:>3} {r['accept_length']:>6.2f} "
                     f"{r['rollout_speedup']:>10.3f} {r['e2e_speedup']:>7.3f}{mark}")
    return "\n".join(lines)


def plot(rows: list[dict], path: str | Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    panels = list(dict.fromkeys((r["model"], r["hardware"]) for r in rows))
    fig, axes = plt.subplots(len(panels), 2, figsize=(11, 3.6 * len(panels)), squeeze=False)
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
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
