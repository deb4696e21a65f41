"""Plots of simulated runs, the policies side by side (matplotlib, Agg backend).

- decode_batch.png: decode batch size per step (the paper's Fig. 15);
- memory.png: the KV pool over simulated time, one panel per policy:
  what each layer type needs ("used-<spec>"), waste, cached and free
  (the paper's Fig. 16);
- summary.png: throughput, mean decode batch, prefix hit rate and waste.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvserve.sim.metrics import memory_series, summary  # noqa: E402
from kvserve.sim.simulator import SimResult  # noqa: E402

GB = 1e9


def plot_runs(runs: list[SimResult], out_dir: str | Path) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = _title(runs[0])
    return [
        _decode_batch(runs, out / "decode_batch.png", title),
        _memory(runs, out / "memory.png", title),
        _summary(runs, out / "summary.png", title),
    ]


def _title(res: SimResult) -> str:
    cfg = res.config
    tp = f" x{cfg.tp}" if cfg.tp > 1 else ""
    return f"{cfg.model.name} on {cfg.gpu.name}{tp}"


def _decode_batch(runs: list[SimResult], path: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4))
    for res in runs:
        batch = [s.decode for s in res.steps]
        avg = summary(res)["avg_decode_batch"]
        ax.plot(range(len(batch)), batch, lw=1, label=f"{res.config.policy} (avg {avg:.2f})")
    ax.set(xlabel="step", ylabel="decode batch size", title=f"Decode batch size: {title}")
    ax.legend()
    return _save(fig, path)


SPEC_COLORS = ("tab:blue", "tab:cyan", "tab:purple", "tab:olive", "tab:brown")
OTHER_COLORS = {"waste": "tab:red", "cached": "tab:green", "free": "lightgray"}


def _memory(runs: list[SimResult], path: Path, title: str) -> Path:
    fig, axes = plt.subplots(1, len(runs), figsize=(5 * len(runs), 4.2), sharey=True,
                             squeeze=False)
    for ax, res in zip(axes[0], runs):
        labels, layers = _memory_layers(res)
        colors = [SPEC_COLORS[i % len(SPEC_COLORS)] for i in range(len(labels) - 3)]
        colors += [OTHER_COLORS[k] for k in labels[-3:]]
        ax.stackplot(memory_series(res)["t"], layers, labels=labels, colors=colors,
                     step="post")
        waste = summary(res)["waste_of_held"]
        ax.set(xlabel="simulated time (s)", title=f"{res.config.policy}: waste {waste:.2%}")
        ax.set_xlim(left=0)
        ax.legend(loc="lower left", fontsize=7, framealpha=0.8)
    axes[0][0].set_ylabel("KV pool (GB)")
    fig.suptitle(f"KV memory: {title}")
    return _save(fig, path)


def _memory_layers(res: SimResult) -> tuple[list[str], list[list[float]]]:
    """Stacked series in GB: what each spec needs, then waste, cached and free."""
    mem = memory_series(res)
    specs = list(mem["specs"].items())
    n = len(mem["t"])
    labels = [f"used-{name}" for name, _ in specs] + ["waste", "cached", "free"]
    layers = [[b / GB for b in col["ideal"]] for _, col in specs]
    layers.append([sum(c["waste"][i] for _, c in specs) / GB for i in range(n)])
    layers.append([sum(c["evictable"][i] for _, c in specs) / GB for i in range(n)])
    layers.append([f / GB for f in mem["free"]])
    return labels, layers


def _summary(runs: list[SimResult], path: Path, title: str) -> Path:
    metrics = [("output_tokens_per_s", "output tokens/s"), ("avg_decode_batch", "decode batch"),
               ("hit_rate", "prefix hit rate"), ("waste_of_held", "waste of held KV")]
    sums = [summary(r) for r in runs]
    names = [s["policy"] for s in sums]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.5))
    for ax, (key, label) in zip(axes, metrics):
        vals = [s[key] for s in sums]
        ax.bar(names, vals, color=[f"C{i}" for i in range(len(names))])
        ax.set_title(label)
        if key in ("hit_rate", "waste_of_held"):  # fractions: keep a 0-1 axis
            ax.set_ylim(0, 1)
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
