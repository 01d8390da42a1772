"""The run's plots (speedup per dataset, DE against rows with the break-even curve)."""
from __future__ import annotations

import json
from pathlib import Path

from vllm_ptd.bench.methods import Method


def _break_even(path: str | None) -> tuple[str, list[tuple[float, float]]] | None:
    """(backend, [(extra rows, cost ratio)]) from a --row-cost run's row_cost.json."""
    if not path:
        return None
    data = json.loads(Path(path).read_text())
    for b in ("vllm", "hf"):
        rows = (data.get(b) or {}).get("rows") or {}
        pts = sorted((int(n) - 1, v["ratio"]) for n, v in rows.items() if v.get("ratio"))
        if len(pts) > 1:
            return b, pts
    return None


def make_plots(agg: dict, methods: list[Method], failed: dict, out: Path,
               row_cost_json: str | None = None) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    rows = agg["rows"]
    labels = [m.label for m in methods if m.label not in failed and m.label != "none"]
    dsets = []
    for r in rows:
        if r["dataset"] not in dsets:
            dsets.append(r["dataset"])
    bss = sorted({r["batch_size"] for r in rows})
    get = {(r["method"], r["batch_size"], r["dataset"]): r for r in rows}
    if labels:
        fig, axes = plt.subplots(len(bss), 1, figsize=(max(7, 1.2 * len(dsets) * (1 + len(labels) / 3)),
                                                        3.4 * len(bss)), squeeze=False)
        width = 0.8 / len(labels)
        for ax, bs in zip(axes[:, 0], bss):
            for j, m in enumerate(labels):
                means, lo, hi = [], [], []
                for d in dsets:
                    s = get.get((m, bs, d), {}).get("speedup", {})
                    mu = s.get("mean")
                    means.append(mu if mu is not None else float("nan"))
                    lo.append(mu - s["min"] if mu is not None else 0)
                    hi.append(s["max"] - mu if mu is not None else 0)
                xs = [i + (j - (len(labels) - 1) / 2) * width for i in range(len(dsets))]
                ax.bar(xs, means, width, label=m, yerr=[lo, hi], capsize=2)
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_xticks(range(len(dsets)))
            ax.set_xticklabels(dsets)
            ax.set_ylabel("speedup vs none")
            ax.set_title(f"batch size {bs} (bars: mean over repeats, whiskers: min-max)")
        axes[0, 0].legend(fontsize=7, ncol=min(4, len(labels)))
        fig.tight_layout()
        p = out / "speedup.png"
        fig.savefig(p, dpi=120)
        plt.close(fig)
        files.append(p.name)
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for m in [m.label for m in methods if m.label not in failed]:
        s = agg["pooled"][m]
        if s.get("DE_all") is None:
            continue
        ax.scatter([s["rows_all"]], [s["DE_all"]], s=40)
        ax.annotate(m, (s["rows_all"], s["DE_all"]), fontsize=7, xytext=(4, 3),
                    textcoords="offset points")
    be = _break_even(row_cost_json)
    if be is not None:
        xs, ys = zip(*be[1])
        ax.plot(xs, ys, "--", color="gray", lw=1,
                label=f"break-even: forward cost ratio vs 1 row ({be[0]}, {Path(row_cost_json).name})")
        ax.legend(fontsize=7)
    ax.set_xlabel("extra rows per step (draft + verify, Dft+Ver)")
    ax.set_ylabel("DE (tokens per step)")
    ax.set_title("Decoding efficiency against extra rows per step\n"
                 "(all steps of all requests, every dataset and batch size pooled)", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "de_vs_rows.png"
    fig.savefig(p, dpi=120)
    plt.close(fig)
    files.append(p.name)
    return files
