"""Metrics of pacs.py runs against step, one line per run, one panel per metric.

    python experiments/curves.py runs/pacs-m2 runs/ppo-m2 --keys reward response_len --out curves.png
    python experiments/curves.py runs/* --keys reward critic_auc --smooth 3 --title "20 steps, SmolLM2"

Each run is a pacs.py --out-dir (its metrics.jsonl); a run's label is its directory name. A metric a step did not
log (None, e.g. critic_auc without a mixed group) leaves a gap. --smooth N draws the running mean of the last N
steps over the raw values (drawn faint): one step's reward on 32 samples is noisy.
"""
import argparse
import json
import os
import sys

import numpy as np


def read_metrics(path):
    """A pacs.py metrics.jsonl's rows, one per step, sorted by step (experiments/trend.py reads runs with it too)."""
    with open(path) as f:
        return sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["step"])


def read_rows(run):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"curves.py: error: no metrics.jsonl in {run}")
    rows = read_metrics(path)
    if not rows:
        raise SystemExit(f"curves.py: error: {path} is empty")
    return rows


def running_mean(values, n):
    """Mean of the last n finite values at each step (nan where there is none yet)."""
    out = []
    for i in range(len(values)):
        window = [v for v in values[max(0, i - n + 1):i + 1] if np.isfinite(v)]
        out.append(float(np.mean(window)) if window else np.nan)
    return out


def plot(runs, keys, out, smooth=1, title=""):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows_of = {run: read_rows(run) for run in runs}  # each file once, and every missing run before drawing
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for run, rows in rows_of.items():
            steps = [r["step"] for r in rows]
            values = [np.nan if r.get(key) is None else float(r[key]) for r in rows]
            if smooth > 1:
                (line,) = ax.plot(steps, running_mean(values, smooth), label=os.path.basename(os.path.normpath(run)))
                ax.plot(steps, values, ".", color=line.get_color(), alpha=0.3)
            else:
                ax.plot(steps, values, marker=".", label=os.path.basename(os.path.normpath(run)))
        ax.set(title=key + (f" (running mean of {smooth})" if smooth > 1 else ""), xlabel="step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", help="pacs.py --out-dir directories")
    p.add_argument("--keys", nargs="+", default=["reward", "entropy"], help="metrics.jsonl keys, one panel each")
    p.add_argument("--smooth", type=int, default=1, help="running mean over this many steps (1 = raw)")
    p.add_argument("--title", default="", help="figure title")
    p.add_argument("--out", default="curves.png", help="PNG to write")
    args = p.parse_args(argv)
    if args.smooth < 1:
        sys.exit(f"curves.py: error: --smooth must be at least 1, got {args.smooth}")
    print(f"wrote {plot(args.runs, args.keys, args.out, args.smooth, args.title)}")


if __name__ == "__main__":
    main()
