"""The sweep's figures: pass@k against k, entropy and reward against step, the critics per step, and the lab's
axis; each a mean over seeds with its 95% t-interval.
"""
import math
import os

import numpy as np

from lab_summary import AXIS_METHODS, BETA_METHODS
from stats import paired_differences, t_interval
from sweep import CRITIC_METHODS, PASSK_FIGURE_METHODS


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend (no screen here or in CI)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save(fig, path, title):
    """The figure's title, a tight layout, written to path at 120 dpi and closed; returns path."""
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def shaded(ax, x, curves, label, bounds=(-math.inf, math.inf)):
    """Mean over seeds (rows of curves) with its 95% t-interval shaded, the band cut to the values the
    metric can take (with few seeds a t-interval of a rate reaches below 0 and above 1)."""
    curves = np.asarray(curves, dtype=float)  # (seeds, len(x)); nan where a seed has no value at a step
    stats = np.array([t_interval(col[~np.isnan(col)]) for col in curves.T])  # (len(x), 3)
    (line,) = ax.plot(x, stats[:, 0], label=f"{label} (n={len(curves)})")
    if len(curves) > 1:
        ax.fill_between(x, np.clip(stats[:, 1], *bounds), np.clip(stats[:, 2], *bounds), alpha=0.2,
                        color=line.get_color())


def plot(args, runs, base):
    plt = pyplot()
    prefix = args.figure_prefix or os.path.join(args.out, "trend")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    what = (f"the lab, {args.split} split" if args.lab else
            f"{os.path.basename(args.model)}, {os.path.basename(args.dataset)}")
    title = (f"{what}, {args.prompts}x{args.group_size} samples/step, "
             f"M = {args.num_mini_batches}, {args.steps} steps; mean over seeds, 95% t-interval shaded")

    datasets = list(next(iter(next(iter(runs.values())).values()))["eval"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(max(4.6 * len(datasets), 8), 4), squeeze=False)
    shown = [m for m in PASSK_FIGURE_METHODS if m in runs] or list(runs)
    ks = np.arange(1, args.eval_n + 1)
    for ax, ds in zip(axes[0], datasets):
        if base and ds in base:
            ax.plot(ks, [base[ds][k] for k in ks], "k--", label="base model")
        for method in shown:
            shaded(ax, ks, [[r["eval"][ds][k] for k in ks] for r in runs[method].values()], method, (0, 1))
        ax.set(title=f"{ds}: held-out pass@k", xlabel="k (samples per problem)", ylabel="pass@k")
        ax.set_xscale("log", base=2)
        ticks = sorted({2 ** i for i in range(args.eval_n.bit_length()) if 2 ** i <= args.eval_n} | {args.eval_n})
        ax.set_xticks(ticks, [str(k) for k in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save(fig, prefix + "_passk.png", title)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(axes, ("entropy", "reward"), ("token-mean entropy", "training reward")):
        for method, by_seed in runs.items():
            curves = [[row[key] for row in r["rows"]] for r in by_seed.values()]
            shaded(ax, np.arange(len(curves[0])), curves, method, (0, 1) if key == "reward" else (0, math.inf))
        ax.set(title=f"{label} against step", xlabel="step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    save(fig, prefix + "_curves.png", title)
    figures = [prefix + "_passk.png", prefix + "_curves.png"]

    critics = [m for m in CRITIC_METHODS[:3] if m in runs]
    if critics:  # the critics per step: what they know (AUC), how far PACS's moves off 1/2 and how much it rewrites
        panels = [("critic_auc", "critic AUC within groups (0.5: no idea)", (0, 1)),
                  ("critic_shift", "PACS: mean |sigma(psi) - 1/2|", (0, 0.5)),
                  ("critic_adv_change", "PACS: |A - A0| / |A0| (share rewritten)", (0, math.inf)),
                  ("explained_var", "PPO: explained variance of the returns", (-math.inf, 1))]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4))
        for ax, (key, label, bounds) in zip(axes, panels):
            for method in critics:
                curves = [[math.nan if row.get(key) is None else row[key] for row in r["rows"]]
                          for r in runs[method].values()]
                if not np.isnan(np.asarray(curves, dtype=float)).all():
                    shaded(ax, np.arange(len(curves[0])), curves, method, bounds)
            if key == "critic_auc":
                ax.axhline(0.5, color="k", lw=0.8, ls="--")
            ax.set(title=label, xlabel="step")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # a panel whose metric no run logs stays empty
                ax.legend(fontsize=8)
        save(fig, prefix + "_critic.png", title)
        figures.append(prefix + "_critic.png")
    return figures


def error_bars(stats):
    """matplotlib's yerr (2, n) from (mean, lo, hi) intervals; 0 where an interval is undefined (one seed)."""
    return np.array([[m - lo, hi - m] if not math.isnan(lo) else [0, 0] for m, lo, hi in stats]).T


def plot_axis(summary, path):
    """The axis: against prompts per mini-batch, the critic's pooled AUC per method, and PACS - critic-off in
    held-out pass@1 paired by seed; each a mean over seeds with its 95% t-interval as error bars."""
    plt = pyplot()
    by = {}
    for a in summary["axis"]:
        by.setdefault(a["prompts_per_mini_batch"], {}).setdefault(a["method"], {})[a["seed"]] = a
    xs = sorted(by)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in AXIS_METHODS:
        stats = [t_interval([r["critic_auc"] for r in by[x].get(method, {}).values() if r["critic_auc"] is not None])
                 for x in xs]
        axes[0].errorbar(xs, [s[0] for s in stats], yerr=error_bars(stats), marker="o", capsize=3, label=method)
    axes[0].axhline(0.5, color="k", lw=0.8, ls="--")
    axes[0].set(title="critic AUC on mini-batches 1..M-1\n(pooled per run)", xlabel="prompts per mini-batch")
    diffs = [t_interval(paired_differences({s: r["pass@1"] for s, r in by[x].get("pacs", {}).items()},
                                           {s: r["pass@1"] for s, r in by[x].get("pacs-critic-off", {}).items()})[1])
             for x in xs]
    axes[1].errorbar(xs, [d[0] for d in diffs], yerr=error_bars(diffs), marker="o", capsize=3, color="C2")
    axes[1].axhline(0.0, color="k", lw=0.8, ls="--")
    axes[1].set(title="pacs - pacs-critic-off, held-out pass@1\n(paired by seed)", xlabel="prompts per mini-batch")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    return save(fig, path, "The axis: what the critic has to read; mean over seeds, 95% t-interval")



def plot_beta(summary, path, best_beta=None):
    """The critic's strength: against beta, PACS's pooled critic AUC and PACS(beta) - critic-off in held-out pass@1
    paired by seed (mean over seeds, 95% t-interval); and the reliability of sigma(psi) at beta = 1 and at best_beta
    (the validation scan's best; absent: the largest beta): per bin of sigma(psi) on mini-batches 1..M-1 (pooled
    over steps and seeds), the observed success rate of its responses against their mean sigma(psi), the marker's
    area by the bin's count and the count written beside it."""
    plt = pyplot()
    by = {}
    for b in summary["beta_axis"]:
        by.setdefault(b["beta"], {})[b["seed"]] = b
    off = {r["seed"]: r["pass@1"] for r in summary["runs"] if r["method"] == "pacs-critic-off"}
    betas = sorted(by)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.6))
    axes = axes.ravel()
    aucs = [t_interval([r["critic_auc"] for r in by[b].values() if r["critic_auc"] is not None]) for b in betas]
    axes[0].errorbar(betas, [a[0] for a in aucs], yerr=error_bars(aucs), marker="o", capsize=3)
    axes[0].axhline(0.5, color="k", lw=0.8, ls="--")
    axes[0].set(title="PACS's critic AUC on mini-batches 1..M-1\n(pooled per run; 0.5: no idea)", xlabel="beta")
    diffs = [t_interval(paired_differences({s: r["pass@1"] for s, r in by[b].items()}, off)[1]) for b in betas]
    axes[1].errorbar(betas, [d[0] for d in diffs], yerr=error_bars(diffs), marker="o", capsize=3, color="C2")
    axes[1].axhline(0.0, color="k", lw=0.8, ls="--")
    axes[1].set(title="PACS(beta) - pacs-critic-off, held-out pass@1\n(paired by seed)", xlabel="beta")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(betas, [f"{b:g}" for b in betas])
        ax.minorticks_off()
    method_of = {b["beta"]: b["method"] for b in summary["beta_axis"]}
    shown = [1.0, best_beta if best_beta in method_of and best_beta != 1.0 else max(method_of)]
    for ax, beta in zip(axes[2:], shown):
        title = f"reliability of sigma(psi) at beta = {beta:g}" + (
            " (validation's best)" if beta == best_beta and beta != 1.0 else "")
        reliability(ax, summary["calibration"].get(method_of.get(beta)), method_of.get(beta), title,
                    f"C{betas.index(beta) if beta in betas else 0}")
    for ax in axes:
        ax.grid(alpha=0.3)
    seeds = len({b["seed"] for b in summary["beta_axis"]})
    return save(fig, path, f"The critic's strength: PACS at each beta, {seeds} seeds; mean over seeds, 95% t-interval")


def reliability(ax, counts, label, title, color):
    """One reliability diagram on ax: per bin of sigma(psi) (sweep.pooled_calibration's counts), the observed
    success rate against the bin's mean sigma(psi), the marker's area by the bin's count, the count beside it."""
    if not counts:
        ax.set_axis_off()
        return
    n, right, sigma = (np.array(counts[k], dtype=float) for k in ("n", "right", "sigma"))
    keep = n > 0
    x, y = sigma[keep] / n[keep], right[keep] / n[keep]
    ax.plot(x, y, "-", color=color, lw=0.8, alpha=0.6)
    ax.scatter(x, y, s=8 + 120 * n[keep] / n.max(), color=color, label=f"{label}: {int(n.sum()):,} responses")
    for xi, yi, ni in zip(x, y, n[keep]):
        ax.annotate(f"{int(ni):,}", (xi, yi), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.plot([0, 1], [0, 1], "k--", lw=0.8, label="calibrated (y = x)")
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="mean sigma(psi) in the bin", ylabel="observed success rate", title=title)
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)


def plot_reliability(summary, path):
    """A sweep at one beta: sigma(psi)'s reliability in PACS's runs and in its critic-off ablation's (psi computed,
    not used), pooled over steps and seeds."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.6))
    for i, (ax, method) in enumerate(zip(axes, AXIS_METHODS)):
        reliability(ax, summary["calibration"].get(method), method, f"reliability of sigma(psi): {method}", f"C{i}")
    seeds = len({r["seed"] for r in summary["runs"]})
    return save(fig, path, f"What sigma(psi) knows: mini-batches 1..M-1, {seeds} seeds pooled")


def plot_rare(summary, path):
    """pass@k at k in summary["rare"]'s metrics on the test problems the base model rarely solved: the base model
    (dashed) and each method's mean over seeds with its 95% t-interval."""
    plt = pyplot()
    rare = summary["rare"]
    ks = [int(m.split("@")[1]) for m in rare["base_selection"]]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    if rare["base"]:  # the base model on samples other than those that chose the set
        ax.plot(ks, [rare["base"][f"pass@{k}"] for k in ks], "k--", marker="o", label="base model, fresh samples")
    ax.plot(ks, [rare["base_selection"][f"pass@{k}"] for k in ks], ":", color="0.5", marker="o",
            label="base model, the samples that chose the set (low by construction)")
    methods = [m for m in PASSK_FIGURE_METHODS if any(r["method"] == m for r in rare["runs"])] + sorted(
        {r["method"] for r in rare["runs"]} - set(PASSK_FIGURE_METHODS))
    for i, method in enumerate(methods):
        stats = [t_interval([r[f"pass@{k}"] for r in rare["runs"] if r["method"] == method]) for k in ks]
        seeds = sum(r["method"] == method for r in rare["runs"])
        x = [k * 1.06 ** (i - (len(methods) - 1) / 2) for k in ks]  # side by side, not on top of each other
        ax.errorbar(x, [s[0] for s in stats], yerr=error_bars(stats), marker="o", ms=4, capsize=3,
                    label=f"{method} (n={seeds})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.set(xlabel="k (samples per problem)", ylabel="pass@k", ylim=(0, 1),
           title=f"the {rare['problems']} of {rare['of']} test problems the base model solved\n"
                 f"in at most {rare['threshold']} of its {rare['eval_n']} samples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save(fig, path, "Where the paper's pass@k claim lives: mean over seeds, 95% t-interval")


PART_ORDER = ("self-damping", "ranking", "values", "total")


def plot_critic_parts(summaries, path, metric="pass@1"):
    """What the critic does, from the labs' summary.json files ({label: summary}): left, PACS - critic-off in `metric`
    split into its three parts by the controls (summary["decomposition"]), lab by lab, each part's paired mean with
    its 95% t-interval; right, the critic's AUC against prompts per mini-batch on a log axis, every point read over
    the same first rollouts (summary["critic_window"]), mean over seeds with its 95% t-interval."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    # a lab whose controls have fewer than 2 seeds a part has no interval to draw yet: left out
    labs = [(label, s["decomposition"]) for label, s in summaries.items() if s.get("decomposition")
            and min(p["seeds"] for p in s["decomposition"]["parts"] if p["metric"] == metric) >= 2]
    width = 0.8 / max(len(labs), 1)
    for i, (label, d) in enumerate(labs):
        by = {p["part"]: p for p in d["parts"] if p["metric"] == metric}
        parts = [p for p in PART_ORDER if p in by]
        xs = [PART_ORDER.index(p) + (i - (len(labs) - 1) / 2) * width for p in parts]
        stats = [(by[p]["mean"], *by[p]["ci95_t"]) for p in parts]
        stats = [(m, m if lo is None else lo, m if hi is None else hi) for m, lo, hi in stats]
        seeds = min(by[p]["seeds"] for p in parts) if parts else 0
        axes[0].bar(xs, [s[0] for s in stats], width, yerr=error_bars(stats), capsize=3,
                    label=f"{label}, {seeds} seeds")
    axes[0].axhline(0.0, color="k", lw=0.8)
    axes[0].set_xticks(range(len(PART_ORDER)), ["self-damping\npacs - class-shuf.", "ranking\nclass- - group-shuf.",
                                                "values' noise\ngroup-shuf. - off", "total\npacs - critic-off"],
                       fontsize=8)
    axes[0].set(title=f"PACS - critic-off in test {metric}, part by part\n(paired by seed)")
    axes[0].legend(fontsize=8)
    ticks = []
    for label, s in summaries.items():
        w = s.get("critic_window")
        if not w:
            continue
        pts = w["points"]
        xs = [p["prompts_per_mini_batch"] for p in pts]
        stats = [tuple(math.nan if v is None else v for v in p["critic_auc"]) for p in pts]
        axes[1].errorbar(xs, [st[0] for st in stats], yerr=error_bars(stats), marker="o", capsize=3,
                         label=f"{label}: first {w['window_steps']} rollouts")
        for p, st in zip(pts, stats):
            axes[1].annotate(f"n={len(p['seeds'])}" + (f"\nlr {p['lr']:g}" if p["lr"] != pts[-1]["lr"] else ""),
                             (p["prompts_per_mini_batch"], st[0]), textcoords="offset points", xytext=(4, -14),
                             fontsize=7)
        ticks = sorted(set(ticks) | set(xs))
    axes[1].axhline(0.5, color="k", lw=0.8, ls="--")
    axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(ticks, [str(x) for x in ticks])
    axes[1].minorticks_off()
    axes[1].set(title="sigma(psi)'s AUC on mini-batches 1..M-1\n(the paper's runs: 256 prompts per mini-batch)",
                xlabel="prompts per mini-batch")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    return save(fig, path, "What the implicit critic does: the controls' decomposition, and its ranking against the "
                           "mini-batch; 95% t-intervals")


def main(argv=None):
    """python experiments/figures.py critic experiments/labs/lab/summary.json experiments/labs/lab2/summary.json
           --out experiments/critic_parts.png"""
    import argparse
    import json
    p = argparse.ArgumentParser(description="figures from the labs' summary.json files")
    p.add_argument("what", choices=["critic"], help="critic: the controls' decomposition and the AUC's axis")
    p.add_argument("summaries", nargs="+",
                   help="summary.json files, experiments/labs/<tag>/summary.json (labelled by <tag>)")
    p.add_argument("--out", required=True, help="the figure's path (.png)")
    args = p.parse_args(argv)
    summaries = {}
    for path in args.summaries:
        try:
            with open(path) as f:
                summaries[os.path.basename(os.path.dirname(os.path.abspath(path)))] = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"figures.py: error: {path}: {e}")
    if not any(s.get("decomposition") or s.get("critic_window") for s in summaries.values()):
        raise SystemExit("figures.py: error: no summary has a decomposition or a critic_window entry")
    print(f"figure: {plot_critic_parts(summaries, args.out)}")


if __name__ == "__main__":
    main()
