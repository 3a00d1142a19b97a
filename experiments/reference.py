"""The paper's reference policy in the lab (pacs.py --ref-reset-every K): PACS scored against pi_old (K = 1, the
official code's) and against a frozen pi_ref reset every K rollout steps with AdamW's state (paper v2), never reset
(Eq. 7's fixed pi_ref), or reset without the optimizer half; and paper v2's ablations at PACS's lr (no class weights,
GRPO- and Dr.GRPO-style psi, beta at the ends of v2's axis). summary.json's `reference` and `v2_ablations`, from the
result files alone (experiments/results.md, "The paper's reference policy"):

    python experiments/reference.py --table experiments/labs/lab                 # the tables, from summary.json
    python experiments/reference.py --figure experiments/labs/lab/lab_reference.png experiments/labs/lab
"""
import argparse
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lab_summary import lab_results, paired_entry, rounded, step_rows  # noqa: E402
from stats import t_interval  # noqa: E402

# method -> (K of --ref-reset-every, whether a reset clears AdamW); K = 1 is pi_old (every rollout), K = 0 never
ARMS = {"pacs": (1, True), "pacs-ref4": (4, True), "pacs-ref16": (16, True), "pacs-ref-never": (0, True),
        "pacs-ref16-keep-opt": (16, False)}
ABLATIONS = ("pacs-no-balance", "pacs-est-grpo", "pacs-est-drgrpo", "pacs-beta0.1", "pacs-beta10")
AGAINST = ("pacs", "grpo", "ppo")  # each arm paired with PACS at K = 1 and the baselines
METRICS = ("pass@1", "pass@64", "final_entropy")
STEPS_NEVER = 15  # "never" has one period: |psi| over its first and last 15 rollout steps


def interval(values):
    """{mean, ci95_t, seeds} of per-seed values (None dropped)."""
    v = [x for x in values if x is not None and not math.isnan(x)]
    mean, lo, hi = t_interval(np.array(v, dtype=float)) if v else (math.nan,) * 3
    return {"mean": rounded(mean), "ci95_t": [rounded(lo), rounded(hi)], "seeds": len(v)}


def run_mean(rows, key, steps=None):
    """The mean of a per-step metric over the steps `steps` (all when None) where it is logged; None if nowhere."""
    v = [r[key] for i, r in enumerate(rows) if r.get(key) is not None and (steps is None or i in steps)]
    return float(np.mean(v)) if v else None


def psi_growth(rows, K):
    """Mean |psi| right after a reset (the period's second step; its first has psi = 0 on mini-batch 0) and on the
    period's last step: how far r_hat's spread grows while pi_ref is held. K = 0: the run's first and last
    STEPS_NEVER steps. K = 1: None (psi is scored against pi_old every rollout)."""
    n = len(rows)
    if K == 1:
        return None
    if K == 0:
        early, late = set(range(1, STEPS_NEVER + 1)), set(range(n - STEPS_NEVER, n))
    else:
        early, late = {s for s in range(n) if s % K == 1}, {s for s in range(n) if s % K == K - 1}
    return {"after_reset": run_mean(rows, "psi_abs", early), "before_reset": run_mean(rows, "psi_abs", late)}


def reference_summary(runs_root, summary, base_pass1=None, prompts=32):
    """summary.json's `reference`: per arm that has runs, its K and optimizer half, test pass@1 and pass@64, paired
    by seed with PACS at K = 1, GRPO and PPO (and the final entropy), sigma(psi)'s AUC over the run and on the first
    mini-batch, mean |psi| after a reset and before the next, and the runs that end below the base model's pass@1
    (diverged). None when no arm other than K = 1 has run."""
    results = {(r["method"], r["seed"]): r for r in lab_results(runs_root, f"test-p{prompts}") if r["method"] in ARMS
               and r["settings"]["prompts"] == prompts}
    if not any(m != "pacs" for m, _ in results):
        return None
    runs, swept = summary["runs"], prompts // summary["settings"]["num_mini_batches"]
    arms = []
    for method, (K, clears) in ARMS.items():
        mine = [results[k] for k in sorted(results) if k[0] == method]
        if not mine:
            continue
        rows = [step_rows(r) for r in mine]
        entries = [e for e in runs if e["method"] == method]
        growth = [g for g in (psi_growth(rs, K) for rs in rows) if g]
        arms.append({
            "method": method, "ref_reset_every": K, "clears_optimizer": clears, "seeds": len(mine),
            "pass@1": interval([e["pass@1"] for e in entries]), "pass@64": interval([e["pass@64"] for e in entries]),
            "final_entropy": interval([e["final_entropy"] for e in entries]),
            "critic_auc": interval([e["critic_auc"] for e in entries]),
            "critic_auc_first": interval([run_mean(rs, "critic_auc_first") for rs in rows]) if K != 1 else None,
            "psi_abs": interval([run_mean(rs, "psi_abs") for rs in rows]),
            "psi_abs_after_reset": interval([g["after_reset"] for g in growth]) if growth else None,
            "psi_abs_before_reset": interval([g["before_reset"] for g in growth]) if growth else None,
            "diverged": None if base_pass1 is None else sum(e["pass@1"] < base_pass1 for e in entries),
            "paired": [p for p in (paired_entry(runs, method, b, m, swept) for b in AGAINST if b != method
                                   for m in METRICS) if p["seeds"]]})
    return {"arms": arms, "base_pass@1": base_pass1}


def ablation_summary(summary, prompts=32, base_pass1=None, runs_root=None):
    """summary.json's `v2_ablations`: each of paper v2's ablations that has runs, its test pass@1, sigma(psi)'s AUC,
    the runs that end below the base model's pass@1 (diverged) and, from the result files under runs_root, the mean
    gradient norm over the run (and PACS's on the same seeds), paired by seed with PACS (pass@1, pass@64, final
    entropy); None when none has run."""
    runs, swept = summary["runs"], prompts // summary["settings"]["num_mini_batches"]
    files = [r for r in lab_results(runs_root, f"test-p{prompts}") if r["settings"]["prompts"] == prompts] \
        if runs_root else []
    grad_norm = lambda m, seeds: interval([run_mean(step_rows(r), "grad_norm") for r in files
                                           if r["method"] == m and r["seed"] in seeds])
    out = []
    for m in ABLATIONS:
        entries = [e for e in runs if e["method"] == m]
        if entries:
            out.append({"method": m, "seeds": len(entries), "pass@1": interval([e["pass@1"] for e in entries]),
                        "critic_auc": interval([e["critic_auc"] for e in entries]),
                        "grad_norm": grad_norm(m, {e["seed"] for e in entries}) if files else None,
                        "grad_norm_pacs": grad_norm("pacs", {e["seed"] for e in entries}) if files else None,
                        "diverged": None if base_pass1 is None else sum(e["pass@1"] < base_pass1 for e in entries),
                        "paired": [p for p in (paired_entry(runs, m, "pacs", metric, swept) for metric in METRICS)
                                   if p["seeds"]]})
    return out or None


# ---- the page's tables and figure -------------------------------------------------------------------------------
def ci(stat, fmt=".3f"):
    if stat is None or stat["mean"] is None:
        return "–"
    lo, hi = stat["ci95_t"]
    return f"{stat['mean']:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]" if lo is not None else f"{stat['mean']:{fmt}}"


def norm(stat):
    return "–" if stat is None or stat["mean"] is None else f"{stat['mean']:.3g}"


def paired_with(paired, b, metric):
    """The paired entry against method b in metric (lab_summary's), or None."""
    return next((p for p in paired if p["b"] == b and p["metric"] == metric), None)


def detectable(paired, b, metric):
    """The paired difference the seeds detect with 80% power at p < 0.05."""
    p = paired_with(paired, b, metric)
    return "–" if p is None or p.get("detectable_80") is None else f"{p['detectable_80']:.3f}"


def diff(paired, b, metric):
    p = paired_with(paired, b, metric)
    if p is None:
        return "–"
    lo, hi = p["ci95_t"]
    ci_ = f" [{lo:+.3f}, {hi:+.3f}]" if lo is not None else ""
    p_ = f"p {p['p_t']:.2g}, " if p["p_t"] is not None else ""
    return f"{p['mean']:+.3f}{ci_} ({p_}{p['seeds']})"


def period(arm):
    K = arm["ref_reset_every"]
    name = {1: "1 (π_old)", 0: "never"}.get(K, str(K))
    return name + ("" if arm["clears_optimizer"] else ", AdamW kept")


BETAS = {"pacs-beta0.1": 0.1, "pacs-beta0.5": 0.5, "pacs": 1.0, "pacs-beta2": 2.0, "pacs-beta4": 4.0,
         "pacs-beta10": 10.0}  # v2's beta axis: the sweep's arms and v2's ablation ends


def beta_table(summary):
    """v2's β axis in markdown, from the summary's runs (printed, not stored): per β its test pass@1, its paired
    difference from β = 1 (PACS) and from the next β up; no β other than 1 ran: []."""
    runs = [r for r in summary.get("runs", []) if r["method"] in BETAS]
    methods = sorted({r["method"] for r in runs}, key=BETAS.get)
    if methods == [] or methods == ["pacs"]:
        return []
    out = ["| β | seeds | test pass@1 | − β = 1 | detectable | − the next β up |", "|---:|---:|---:|---:|---:|---:|"]
    for i, m in enumerate(methods):
        pass1 = t_interval([r["pass@1"] for r in runs if r["method"] == m])
        to_one = [paired_entry(runs, m, "pacs", "pass@1", None)] if m != "pacs" else []
        up = [paired_entry(runs, m, methods[i + 1], "pass@1", None)] if i + 1 < len(methods) else []
        out.append(f"| {BETAS[m]:g} | {sum(r['method'] == m for r in runs)} | "
                   f"{ci({'mean': pass1[0], 'ci95_t': pass1[1:]})} | {diff(to_one, 'pacs', 'pass@1')} | "
                   f"{detectable(to_one, 'pacs', 'pass@1')} | "
                   f"{diff(up, methods[i + 1], 'pass@1') if up else '–'} |")
    return out


def tables(summary):
    """The markdown tables of experiments/results.md's reference-policy section and v2's ablations (the β axis
    last), from a summary.json."""
    ref, abl = summary.get("reference"), summary.get("v2_ablations")
    out = []
    if ref:
        out += ["| reset period K | seeds | test pass@1 | − PACS (K = 1) | detectable | − GRPO | − PPO "
                "| pass@64 − PACS |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {period(a)} | {a['seeds']} | {ci(a['pass@1'])} | {diff(a['paired'], 'pacs', 'pass@1')} | "
                f"{detectable(a['paired'], 'pacs', 'pass@1')} | "
                f"{diff(a['paired'], 'grpo', 'pass@1')} | {diff(a['paired'], 'ppo', 'pass@1')} | "
                f"{diff(a['paired'], 'pacs', 'pass@64')} |" for a in ref["arms"]]
        out += ["", "| reset period K | σ(ψ) AUC, run | AUC, first mini-batch | mean \\|ψ\\| "
                "| \\|ψ\\| after a reset → before the next | final entropy − PACS | below the base |",
                "|---|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {period(a)} | {ci(a['critic_auc'])} | {ci(a['critic_auc_first'])} | {ci(a['psi_abs'], '.2f')} | "
                f"{ci(a['psi_abs_after_reset'], '.2f')} → {ci(a['psi_abs_before_reset'], '.2f')} | "
                f"{diff(a['paired'], 'pacs', 'final_entropy')} | {a['diverged']} of {a['seeds']} |"
                for a in ref["arms"]]
    if abl:
        out += ["", "| v2's ablation | seeds | test pass@1 | − PACS | detectable | pass@64 − PACS "
                "| final entropy − PACS | σ(ψ) AUC | grad norm (PACS's) | below the base |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        out += [f"| {a['method']} | {a['seeds']} | {ci(a['pass@1'])} | {diff(a['paired'], 'pacs', 'pass@1')} | "
                f"{detectable(a['paired'], 'pacs', 'pass@1')} | "
                f"{diff(a['paired'], 'pacs', 'pass@64')} | {diff(a['paired'], 'pacs', 'final_entropy')} | "
                f"{ci(a['critic_auc'])} | {norm(a['grad_norm'])} ({norm(a['grad_norm_pacs'])}) | "
                f"{'–' if a['diverged'] is None else a['diverged']} of {a['seeds']} |" for a in abl]
    beta = beta_table(summary)
    return "\n".join(out + ([""] + beta if beta and out else beta))


def plot(summary, path):
    """Test pass@1 and sigma(psi)'s AUC against the reset period (pi_old at the left, "never" at the right), each with
    its 95% t-interval over seeds; the arm that keeps AdamW's state beside its period. Each period's tick names the lr
    its arm ran at (each arm's own validation check chose it): a comparison across periods mixes the period with it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = summary["reference"]["arms"]
    order = {1: 0, 4: 1, 16: 2, 0: 3}
    lrs = summary.get("settings", {}).get("lr", {})
    lr = {a["ref_reset_every"]: lrs.get(a["method"]) for a in arms if a["clears_optimizer"]}
    names = {1: "1 (π_old)", 4: "4", 16: "16", 0: "never"}
    labels = [names[k] + (f"\nlr {lr[k]:g}" if lr.get(k) else "") for k in order]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, key, title in ((axes[0], "pass@1", "test pass@1"), (axes[1], "critic_auc", "σ(ψ)'s AUC")):
        for clears, marker, name in ((True, "o", "reset clears AdamW (v2)"), (False, "s", "AdamW kept")):
            pts = [(order[a["ref_reset_every"]] + (0 if clears else 0.12), a[key]) for a in arms
                   if a["clears_optimizer"] == clears and a[key]["mean"] is not None]
            if not pts:
                continue
            x = [p[0] for p in pts]
            y = [p[1]["mean"] for p in pts]
            bounds = [[b if b is not None else p[1]["mean"] for b in p[1]["ci95_t"]] for p in pts]
            err = [[m - lo for m, (lo, _) in zip(y, bounds)], [hi - m for m, (_, hi) in zip(y, bounds)]]
            ax.errorbar(x, y, yerr=err, fmt=marker + ("-" if clears else ""), capsize=3, label=name)
        if key == "critic_auc":
            pts = [(order[a["ref_reset_every"]], a["critic_auc_first"]) for a in arms
                   if a["clears_optimizer"] and a["critic_auc_first"] and a["critic_auc_first"]["mean"] is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1]["mean"] for p in pts], "x--", label="first mini-batch")
            ax.axhline(0.5, color="grey", lw=0.8, ls=":")
        ax.set_xticks(range(4), labels)
        ax.set_xlabel("π_ref reset every K rollout steps")
        ax.set_title(title)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", metavar="LAB_DIR", help="print the tables from LAB_DIR/summary.json")
    p.add_argument("--figure", nargs=2, metavar=("PATH", "LAB_DIR"), help="draw the figure from LAB_DIR/summary.json")
    args = p.parse_args(argv)
    if not (args.table or args.figure):
        p.error("give --table or --figure")
    lab_dir = args.table or args.figure[1]
    path = os.path.join(lab_dir, "summary.json")
    if not os.path.isfile(path):
        sys.exit(f"reference.py: error: no summary.json in {lab_dir}")
    with open(path) as f:
        summary = json.load(f)
    if not summary.get("reference"):
        sys.exit(f"reference.py: error: {path} has no reference entry: no reference-policy run was summarised")
    if args.table:
        print(tables(summary))
    if args.figure:
        plot(summary, args.figure[0])


if __name__ == "__main__":
    main()
