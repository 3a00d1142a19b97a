"""A lab's results from its committed result files alone (experiments/labs/<tag>/results/<split>-p<prompts>[-lr<lr>]/):
the learning-rate scan's table and choice (scan.json) and the summary of the sweep and its axes (summary.json, in a
fixed schema tested in tests/test_trend.py).
"""
import json
import math
import os

import numpy as np

from stats import (bootstrap_interval, final_mean, paired_differences, paired_p, pooled_auc, smallest_detectable,
                   t_interval)
from sweep import CLAIMS, SweepError, read_result
from eval import pass_at_k  # noqa: E402  (sweep put the project root on the path; eval.py's unbiased pass@k)


AXIS_METHODS = ("pacs", "pacs-critic-off")
BETA_METHODS = ("pacs-beta0.5", "pacs", "pacs-beta2", "pacs-beta4")  # PACS at each beta (the critic's strength)
SUMMARY_SETTINGS = ("prompts", "group_size", "num_mini_batches", "steps", "max_new_tokens", "eval_problems",
                    "eval_n", "eval_temperature", "eval_top_p", "eval_max_new_tokens", "lab_weights_sha256")


def lab_results(runs_root, prefix):
    """Every result file under runs_root/<prefix>*/, read, in directory and file-name order."""
    for d in sorted(os.listdir(runs_root)) if os.path.isdir(runs_root) else []:
        if d.startswith(prefix) and os.path.isdir(os.path.join(runs_root, d)):
            for fname in sorted(os.listdir(os.path.join(runs_root, d))):
                if fname.endswith(".json"):
                    yield read_result(os.path.join(runs_root, d, fname))


def step_rows(result):
    """A result file's per-step metrics ({metric: [value per step]}) as one {metric: value} row per step."""
    return [dict(zip(result["metrics"], vals)) for vals in zip(*result["metrics"].values())]


def lab_summary(runs_root, prompts=32, last=10):
    """A lab's summary.json content from the result files under runs_root: settings (the schedule, each method's
    lr and pacs.py flags, the seeds), runs (every method at `prompts` prompts per step: pass@1, pass@64, the final
    reward and entropy as means of the last `last` steps, the pooled critic AUC, the boxed-expression share), axis
    (pacs and pacs-critic-off at every prompts per step swept: prompts per mini-batch, critic AUC, pass@1) and
    beta_axis (PACS at each beta: critic AUC, pass@1, pass@64), calibration (per method, the critic's reliability
    counts summed over steps and seeds) and wall_s (the runs' wall time, summed)."""
    groups = {}
    for r in lab_results(runs_root, "test-p"):
        groups.setdefault(r["settings"]["prompts"], []).append(r)
    if prompts not in groups:
        raise SweepError(f"no result file for --prompts {prompts} under {runs_root}/test-p*/")
    main_runs = sorted(groups[prompts], key=lambda r: (r["method"], r["seed"]))
    first = main_runs[0]["settings"]
    for r in main_runs:
        diff = [k for k in SUMMARY_SETTINGS if r["settings"].get(k) != first.get(k)]
        if diff:
            raise SweepError(f"{r['method']}-s{r['seed']} differs from the other runs in {', '.join(diff)}")

    def entry(r):
        rows = step_rows(r)
        passk = next(iter(r["eval"].values()))
        auc = pooled_auc(rows)
        large_k = {f"pass@{k}": passk[str(k)] for k in (16, 256)} if "256" in passk else {}  # the second lab's k
        return {"method": r["method"], "seed": r["seed"], "pass@1": passk["1"], "pass@64": passk.get("64"), **large_k,
                "final_reward": final_mean(rows, "reward", last), "final_entropy": final_mean(rows, "entropy", last),
                "critic_auc": None if math.isnan(auc) else auc, "boxed_expressions": r["boxed_expressions"]}

    settings = {k: first.get(k) for k in SUMMARY_SETTINGS}
    methods = sorted({r["method"] for r in main_runs})
    settings.update({"lr": {m: next(r["settings"]["lr"] for r in main_runs if r["method"] == m) for m in methods},
                     "pacs_flags": {m: next(r["settings"]["pacs_flags"] for r in main_runs if r["method"] == m)
                                    for m in methods},
                     "seeds": {m: sorted(r["seed"] for r in main_runs if r["method"] == m) for m in methods},
                     "final_mean_of_last_steps": last})
    entries = {p: [entry(r) for r in rs] for p, rs in groups.items()}  # each result file's row, computed once
    runs = sorted(entries[prompts], key=lambda e: (e["method"], e["seed"]))
    axis = [{"prompts_per_mini_batch": p // r["settings"]["num_mini_batches"], **{k: e[k] for k in (
        "method", "seed", "critic_auc", "pass@1")}} for p in sorted(groups) for r, e in zip(groups[p], entries[p])
        if r["method"] in AXIS_METHODS]
    swept = prompts // first["num_mini_batches"]  # the sweep's prompts per mini-batch: its claims, both metrics
    metrics = ("pass@1", "pass@64", "pass@16", "pass@256")  # a metric no run has pairs no seed, and is left out
    paired = [paired_entry(runs, a, b, metric, swept) for a, b in CLAIMS for metric in metrics]
    paired += [paired_entry([e for e in axis if e["prompts_per_mini_batch"] == ppm], "pacs", "pacs-critic-off",
                            "pass@1", ppm) for ppm in sorted({e["prompts_per_mini_batch"] for e in axis} - {swept})]
    beta_axis = [{"beta": flag_value(r["settings"]["pacs_flags"], "--beta"), **{k: e[k] for k in (
        "method", "seed", "pass@1", "pass@64", "critic_auc")}} for r, e in zip(groups[prompts], entries[prompts])
        if r["method"] in BETA_METHODS]
    beta_axis.sort(key=lambda b: (b["beta"], b["seed"]))
    paired += [paired_entry(runs, m, b, metric, swept) for m in BETA_METHODS if m != "pacs"
               for b in ("pacs-critic-off", "grpo", "ppo") for metric in metrics]  # PACS(beta) - critic-off: what a
    # stronger critic adds; - GRPO and - PPO: the paper's claims at each beta (the validation scan's best among them)
    calibration = {}
    for r in main_runs:
        calibration[r["method"]] = add_counts(calibration.get(r["method"]), r.get("calibration"))
    return {"settings": settings, "runs": runs, "axis": axis, "paired": [p for p in paired if p["seeds"]],
            "beta_axis": beta_axis, "calibration": {m: c for m, c in calibration.items() if c},
            "wall_s": round(sum(r["wall_s"] for rs in groups.values() for r in rs), 1)}


RARE_KS = (1, 16, 64, 256)


def rare_summary(problems_dir, swept, threshold=1):
    """summary.json's "rare": pass@k on the test problems the base model solved in at most `threshold` of its
    samples at eval seed 0 (problems_dir/base-s0.json, lab_problems.py's counts: the samples lab.json measured), for
    every run in problems_dir, and PACS against each baseline there, paired by seed (sweep.CLAIMS), at k in RARE_KS.
    "base" is the base model on fresh samples (base-s<seed>.json at other eval seeds, averaged): its selection
    sample's own numbers ("base_selection") are low by construction, the set being the problems where they were
    low. None without base-s0.json."""
    path = os.path.join(problems_dir, "base-s0.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        selection = json.load(f)
    rare = sorted(i for i, c in selection["correct"].items() if c <= threshold)
    if not rare:
        raise SweepError(f"{path}: no problem solved by at most {threshold} of {selection['eval_n']} samples")

    def on_rare(counts, n):
        missing = [i for i in rare if i not in counts]
        if missing:
            raise SweepError(f"{len(missing)} of the base model's rare problems have no count (first {missing[0]})")
        return {f"pass@{k}": round(float(np.mean([pass_at_k(n, counts[i], k) for i in rare])), 5)
                for k in RARE_KS if k <= n}

    runs, fresh = [], []
    for fname in sorted(os.listdir(problems_dir)):
        if fname.endswith(".json") and fname != "base-s0.json":
            with open(os.path.join(problems_dir, fname)) as f:
                r = json.load(f)
            (fresh if r["method"] == "base" else runs).append(
                {"method": r["method"], "seed": r["seed"], **on_rare(r["correct"], r["eval_n"])})
    runs.sort(key=lambda e: (e["method"], e["seed"]))
    metrics = [f"pass@{k}" for k in RARE_KS if k <= selection["eval_n"]]
    paired = [paired_entry(runs, a, b, m, swept) for a, b in CLAIMS for m in metrics]
    return {"threshold": threshold, "eval_n": selection["eval_n"], "problems": len(rare),
            "of": len(selection["correct"]), "base_selection": on_rare(selection["correct"], selection["eval_n"]),
            "base": {m: round(float(np.mean([b[m] for b in fresh])), 5) for m in metrics} if fresh else None,
            "base_seeds": sorted(b["seed"] for b in fresh), "runs": runs, "paired": [p for p in paired if p["seeds"]]}


def control_summary(runs_root, summary, last=10, reference="pacs"):
    """summary.json's "control": runs of a method at an lr other than the one its scan chose (result dirs
    runs_root/control-p<prompts>-lr<lr>/, written by trend.py with --lr and that --results), named "<method>@lr<lr>",
    each paired by seed with the sweep's `reference` runs and with the same method's sweep runs (`summary`, from
    lab_summary with the same `last`), at k in RARE_KS and in the final entropy (the mean of the last `last` steps):
    whether a margin over a method is the method or the lr it ran at. None without such a directory."""
    settings = summary["settings"]
    runs, pairs = [], []
    for r in lab_results(runs_root, f"control-p{settings['prompts']}-lr"):
        differ = [k for k in SUMMARY_SETTINGS if r["settings"].get(k) != settings.get(k)]
        if differ:
            raise SweepError(f"control run {r['method']}-s{r['seed']} differs from the sweep's in {', '.join(differ)}")
        name = f"{r['method']}@lr{r['settings']['lr']:g}"
        at = next(iter(r["eval"].values()))
        runs.append({"method": name, "seed": r["seed"], **{f"pass@{k}": at[str(k)] for k in RARE_KS if str(k) in at},
                     "final_entropy": final_mean(step_rows(r), "entropy", last)})
        pairs += [(reference, name), (name, r["method"])]
    if not runs:
        return None
    runs.sort(key=lambda e: (e["method"], e["seed"]))
    per_mini_batch = settings["prompts"] // settings["num_mini_batches"]
    metrics = [m for m in (f"pass@{k}" for k in RARE_KS) if any(m in e for e in runs)] + ["final_entropy"]
    paired = [paired_entry(runs + summary["runs"], a, b, m, per_mini_batch) for a, b in dict.fromkeys(pairs)
              for m in metrics]
    return {"runs": runs, "paired": [p for p in paired if p["seeds"]]}


def base_entry(lab_dir):
    """summary.json's "base": the base model's test pass@k for k = 1..eval_n and eval_n, as lab.py measured them
    (its lab.json; T = 1.0, the runs' eval protocol); None when the lab has no lab.json or it measured none."""
    path = os.path.join(lab_dir, "lab.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        built = json.load(f)
    passk = built.get("test_pass@k")
    if not passk:
        return None
    return {"eval_n": int(built.get("settings", {}).get("eval_n", len(passk))),
            "weights_sha256": built["weights_sha256"],
            "pass@k": {str(k): round(float(v), 5) for k, v in sorted(passk.items(), key=lambda kv: int(kv[0]))}}


def flag_value(flags, name):
    """The float after `name` in a pacs.py flag list (the beta of a PACS run)."""
    return float(flags[flags.index(name) + 1])


def add_counts(a, b):
    """Two runs' reliability counts (sweep.pooled_calibration) summed bin by bin; either may be None."""
    if not a or not b:
        return a or b
    return {"edges": a["edges"], **{k: [round(x + y, 4) for x, y in zip(a[k], b[k])] for k in ("n", "sigma", "right")}}


def rounded(x):
    """A summary's number: 5 decimals; None for None or nan."""
    return None if x is None or math.isnan(x) else round(float(x), 5)


def p_value(p):
    """A summary's p-value: 3 significant digits (a small p stays > 0); None for None or nan."""
    return None if p is None or math.isnan(p) else float(f"{p:.3g}")


def by_seed(entries, metric):
    """{method: {seed: value}} of `metric` over the entries (summary runs or axis points) that have it."""
    by = {}
    for e in entries:
        if e.get(metric) is not None:
            by.setdefault(e["method"], {})[e["seed"]] = e[metric]
    return by


def paired_entry(entries, a, b, metric, prompts_per_mini_batch):
    """a - b in `metric`, paired by seed over the entries (summary runs or axis points): the mean, its 95% t- and
    bootstrap intervals, the smallest difference this many seeds could detect (80% power) and the paired t-test's
    two-sided p-value; None for nan."""
    by = by_seed(entries, metric)
    seeds, d = paired_differences(by.get(a, {}), by.get(b, {}))
    t, boot, p = t_interval(d), bootstrap_interval(d), paired_p(d)
    return {"prompts_per_mini_batch": prompts_per_mini_batch, "a": a, "b": b, "metric": metric, "seeds": len(seeds),
            "mean": rounded(t[0]), "ci95_t": [rounded(t[1]), rounded(t[2])],
            "ci95_bootstrap": [rounded(boot[1]), rounded(boot[2])], "detectable_80": rounded(smallest_detectable(d)),
            "p_t": p_value(p)}



def lab_scan(runs_root, prompts=32):
    """The learning-rate scan at `prompts` prompts per step from the result files in runs_root/val-p<prompts>-lr*/:
    {"pass@1": {method: {lr: [validation pass@1 per seed]}}, "choice": {method: the lr of the highest mean}}
    (ties: the smaller lr)."""
    table = {}
    for r in lab_results(runs_root, f"val-p{prompts}-lr"):
        table.setdefault(r["method"], {}).setdefault(r["settings"]["lr"], []).append(
            next(iter(r["eval"].values()))["1"])
    if not table:
        raise SweepError(f"no scan result under {runs_root}/val-p{prompts}-lr*/")
    choice = {m: max(sorted(by_lr), key=lambda lr: float(np.mean(by_lr[lr]))) for m, by_lr in table.items()}
    return {"pass@1": {m: {str(lr): v for lr, v in sorted(by_lr.items())} for m, by_lr in table.items()},
            "choice": choice}


# ---- what the critic does: the controls' decomposition, and the critic against the prompts per mini-batch ----------
# PACS - class-shuffled: the self-damping (each response's sigma(psi) tied to its own move); class- - group-shuffled:
# the ranking (what psi knows of R); group-shuffled - critic-off: the values' noise; PACS - critic-off: all of it
DECOMPOSITION = (("self-damping", "pacs", "pacs-critic-class-shuffled"),
                 ("ranking", "pacs-critic-class-shuffled", "pacs-critic-group-shuffled"),
                 ("values", "pacs-critic-group-shuffled", "pacs-critic-off"),
                 ("total", "pacs", "pacs-critic-off"))
CRITIC_KEYS = ("critic_auc", "critic_shift", "critic_adv_change")


def critic_numbers(result, steps=None):
    """A run's critic over its first `steps` rollout steps (all: None): the pooled AUC of sigma(psi), its mean
    |sigma(psi) - 1/2| and the mean share of the advantage it rewrote, each None where no step logged one."""
    rows = step_rows(result)[:steps]
    auc = pooled_auc(rows)
    mean = lambda key: (float(np.mean([r[key] for r in rows if r.get(key) is not None]))
                        if any(r.get(key) is not None for r in rows) else None)
    return {"critic_auc": None if math.isnan(auc) else auc, "critic_shift": mean("critic_shift"),
            "critic_adv_change": mean("critic_adv_change"),
            "critic_pairs": int(sum(r.get("critic_pairs") or 0 for r in rows))}


def decomposition_summary(runs_root, summary, last=10):
    """summary.json's "decomposition": PACS's margin over critic-off split by the two controls (DECOMPOSITION), each
    part paired by seed (paired_entry) at pass@1, the lab's largest k and the final entropy; and per method the
    critic's numbers over the whole run (critic_numbers: sigma(psi)'s own AUC, shift and rewritten share, mean and
    95% t-interval over seeds). None without a control's runs in the sweep."""
    methods = {r["method"] for r in summary["runs"]}
    if not methods & {"pacs-critic-class-shuffled", "pacs-critic-group-shuffled"}:
        return None
    settings = summary["settings"]
    per_mini_batch = settings["prompts"] // settings["num_mini_batches"]
    large = "pass@256" if any("pass@256" in r for r in summary["runs"]) else "pass@64"
    parts = [{"part": part, **paired_entry(summary["runs"], a, b, metric, per_mini_batch)}
             for part, a, b in DECOMPOSITION for metric in ("pass@1", large, "final_entropy")]
    critic = {}
    for r in lab_results(runs_root, f"test-p{settings['prompts']}"):
        if r["settings"]["prompts"] == settings["prompts"] and r["method"] in {m for _, a, b in DECOMPOSITION
                                                                                for m in (a, b)}:
            critic.setdefault(r["method"], []).append({"seed": r["seed"], **critic_numbers(r)})
    return {"parts": [p for p in parts if p["seeds"]],
            "critic": {m: {"seeds": len(rows), **{k: [rounded(v) for v in t_interval(
                [row[k] for row in rows if row[k] is not None])] for k in CRITIC_KEYS}}
                for m, rows in sorted(critic.items())}}


def critic_window(runs_root, window=5, method="pacs"):
    """summary.json's "critic_window": `method`'s critic at every prompts per mini-batch the lab ran (test-p*/, the
    sweep and its axis; axis-p*/, short runs at larger mini-batches), each run read over its first `window` rollout
    steps only (window x M optimizer steps, the same for every point; critic_numbers), with the runs' lr: per point the
    seeds, and the mean and 95% t-interval over seeds of the AUC, the shift and the rewritten share, and the AUC pooled
    over every run's pairs. None without an axis-p*/ directory."""
    dirs = [d for d in (sorted(os.listdir(runs_root)) if os.path.isdir(runs_root) else []) if d.startswith("axis-p")]
    if not dirs:
        return None
    points = {}
    for r in [*lab_results(runs_root, "test-p"), *lab_results(runs_root, "axis-p")]:
        if r["method"] != method:
            continue
        s = r["settings"]
        if len(r["metrics"]["reward"]) < window:
            raise SweepError(f"{method}-s{r['seed']} at {s['prompts']} prompts ran {len(r['metrics']['reward'])} "
                             f"steps, fewer than the window's {window}")
        points.setdefault((s["prompts"] // s["num_mini_batches"], s["lr"]), []).append(
            {"seed": r["seed"], **critic_numbers(r, window)})
    out = []
    for (ppm, lr), rows in sorted(points.items()):
        won = sum(row["critic_auc"] * row["critic_pairs"] for row in rows if row["critic_auc"] is not None)
        pairs = sum(row["critic_pairs"] for row in rows if row["critic_auc"] is not None)
        out.append({"prompts_per_mini_batch": ppm, "lr": lr, "seeds": sorted(row["seed"] for row in rows),
                    **{k: [rounded(v) for v in t_interval([row[k] for row in rows if row[k] is not None])]
                       for k in CRITIC_KEYS},
                    "critic_auc_pooled": round(won / pairs, 5) if pairs else None, "critic_pairs": pairs})
    return {"method": method, "window_steps": window, "points": out}
