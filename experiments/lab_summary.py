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


def significant(x):
    """A summary's number of any size (S_div by an LM's mean-pooled states is ~1e-4): 4 significant digits."""
    return None if x is None or math.isnan(x) else float(f"{float(x):.4g}")


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


# ---- the countdown lab: out of domain (the chain task's test split) and the diversity of the right answers --------
OOD_DATASET = "chain_test"  # the countdown lab's second domain: scored before RL (lab.json) and after
# the countdown lab's table: PACS - GRPO and PACS - PPO in each, held at once (its family, FAMILIES)
COUNTDOWN_METRICS = ("pass@1", "pass@64", "ood_pass@1", "ood_pass@64", "s_div_char-ngrams", "s_div_smollm2",
                     "distinct_forms")
COUNTDOWN_PAIRS = (("pacs", "grpo"), ("pacs", "ppo"))  # v2's Table 3 compares PACS with GRPO; Fig. 6 with both


def distinct_forms(answers):
    """Distinct canonical forms (countdown.canonical: + and * up to order) among one problem's drawn right answers."""
    import countdown
    return len({countdown.canonical(a) for a in answers})


def diversity_by_problem(result):
    """{embedder: {problem id: Div(q)}} and {problem id: distinct forms} of a result file's K drawn right answers."""
    d = result["diversity"]
    forms = {i: distinct_forms(answers) for i, answers in d["drawn_answers"].items()}
    return {e: v["div"] for e, v in d["by_embedder"].items()}, forms


def shared_mean_differences(a_runs, b_runs, values):
    """{seed: mean over the problems both seeds' runs have K right in of a's values - b's}, and {seed: that count}:
    a comparison of diversity never confounded with pass@1 (a seed with no shared problem is left out)."""
    diffs, shared = {}, {}
    for seed in sorted(set(a_runs) & set(b_runs)):
        va, vb = values(a_runs[seed]), values(b_runs[seed])
        ids = sorted(set(va) & set(vb))
        if ids:
            diffs[seed] = float(np.mean([va[i] for i in ids]) - np.mean([vb[i] for i in ids]))
            shared[seed] = len(ids)
    return diffs, shared


def diff_entry(diffs, a, b, metric, prompts_per_mini_batch, digits=rounded):
    """paired_entry's fields for differences already paired by seed ({seed: a - b}), each number by `digits`."""
    d = np.array([diffs[s] for s in sorted(diffs)], dtype=float)
    t, boot, p = t_interval(d), bootstrap_interval(d), paired_p(d)
    return {"prompts_per_mini_batch": prompts_per_mini_batch, "a": a, "b": b, "metric": metric, "seeds": len(d),
            "mean": digits(t[0]), "ci95_t": [digits(t[1]), digits(t[2])],
            "ci95_bootstrap": [digits(boot[1]), digits(boot[2])], "detectable_80": digits(smallest_detectable(d)),
            "p_t": p_value(p)}


def countdown_summary(runs_root, summary, lab_dir="", prompts=32):
    """summary.json's "countdown" of a countdown lab, None for another: per run, the out-of-domain pass@1 and pass@64
    (the chain test split) and S_div by each embedder with the mean distinct canonical forms (each over the run's
    own problems with K right); paired by seed, PACS - GRPO and PACS - PPO in each, diversity over the problems both
    runs share; the base model's out-of-domain pass@k (its lab.json)."""
    results = [r for r in lab_results(runs_root, f"test-p{prompts}") if r.get("diversity")]
    if not results:
        return None
    ppm = prompts // summary["settings"]["num_mini_batches"]
    runs, by = [], {}
    for r in sorted(results, key=lambda r: (r["method"], r["seed"])):
        div, forms = diversity_by_problem(r)
        ood = r["eval"][OOD_DATASET]
        runs.append({"method": r["method"], "seed": r["seed"], "ood_pass@1": ood["1"], "ood_pass@64": ood.get("64"),
                     "problems_with_k_right": len(forms), "distinct_forms": rounded(np.mean(list(forms.values())))
                     if forms else None, **{f"s_div_{e}": significant(np.mean(list(v.values()))) if v else None
                                            for e, v in div.items()}})
        by.setdefault(r["method"], {})[r["seed"]] = (div, forms)
    embedders = sorted(next(iter(results))["diversity"]["by_embedder"])
    paired, shared = [], {}
    for a, b in COUNTDOWN_PAIRS:
        paired += [paired_entry(runs, a, b, m, ppm) for m in ("ood_pass@1", "ood_pass@64")]
        for metric, values in [(f"s_div_{e}", lambda x, e=e: x[0][e]) for e in embedders] + [
                ("distinct_forms", lambda x: x[1])]:
            diffs, n = shared_mean_differences(by.get(a, {}), by.get(b, {}), values)
            if diffs:
                digits = significant if metric.startswith("s_div_") else rounded
                paired.append({**diff_entry(diffs, a, b, metric, ppm, digits),
                               "shared_problems": [n[s] for s in sorted(n)]})
    base = None
    if lab_dir and os.path.isfile(os.path.join(lab_dir, "lab.json")):
        with open(os.path.join(lab_dir, "lab.json")) as f:
            built = json.load(f)
        base = {k: round(float(built["chain_test_pass@k"][k]), 5) for k in ("1", "64")}
    d = results[0]["diversity"]
    return {"ood_dataset": OOD_DATASET, "diversity_dataset": d["dataset"], "k": d["k"], "embedders": embedders,
            "base_ood_pass@k": base, "runs": runs, "paired": [p for p in paired if p["seeds"]]}


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


# ---- the pages' claims, written from summary.json ----------------------------------------------------------------
# experiments/README.md's claims table and each lab page's results list are written here from the labs' summary.json
# (`python experiments/lab_summary.py --pages`), between BEGIN and END markers; tests/test_regenerate_pages.py
# writes them afresh and fails on any difference. The word of every comparison is verdict()'s.
LEVEL = 0.05
BASES_ROWS = 9  # the claims over five bases: 3 comparisons x 3 metrics per lab (experiments/bases.py)
FAMILIES = {  # family: (its comparisons held at once, where the page states them); None: read at 95% only
    "sweep lab": 12, "sweep lab2": 16, "bases": BASES_ROWS, "v2": 8, "reference": 4, "parts": 3, "base": 1,
    "95%": None, "sweep countdown": 2 * len(COUNTDOWN_METRICS)}


def threshold_digits(threshold):
    """`threshold` printed to the digits that decide it: the shortest %g form (3 significant digits or more) that
    every p-value a summary prints (3 significant digits, p_value) reads against as it reads against the exact one."""
    exponent = math.floor(math.log10(threshold))
    grid = [m * 10.0 ** (e - 2) for e in (exponent, exponent - 1) for m in range(100, 1000)]
    for digits in range(3, 8):
        text = f"{threshold:.{digits}g}"
        if all((float(f"{p:.3g}") < float(text)) == (float(f"{p:.3g}") < threshold) for p in grid):
            return text
    return repr(threshold)


def family_rule(family):
    """'0.05 / 12 = 0.00417' for a family of 12 comparisons; None for a family read at 95% only."""
    n = FAMILIES[family]
    return None if n is None else f"{LEVEL} / {n} = {threshold_digits(LEVEL / n)}"


def verdict(intervals, p=None, threshold=None, detectable=None):
    """The word for one comparison, by the rule experiments/README.md states: "above" / "below" where every 95%
    interval lies on that side of 0 and p passes the family's Bonferroni `threshold`; "above at 95% only" / "below at
    95% only" where the intervals do and p does not (or the family is read at 95% only: threshold None); "level"
    where the interval spans 0 within the difference the seeds could detect (±detectable); "not resolved" else."""
    for side, on_side in (("above", lambda i: i[0] > 0), ("below", lambda i: i[1] < 0)):
        if all(on_side(i) for i in intervals):
            passed = threshold is not None and p is not None and p < threshold
            return side if passed else f"{side} at 95% only"
    if detectable is not None and all(-detectable <= i[0] and i[1] <= detectable for i in intervals):
        return "level"
    return "not resolved"


def _num(x, fmt="+.3f"):
    return format(x, fmt).replace("-", "−")


def _p(p):
    return f"p {p:.3g}" if p >= 1e-4 else f"p {p:.1e}".replace("e-0", "e-")


def find_pair(summary, a, b, metric):
    """The paired entry a − b in `metric` at the sweep's prompts per mini-batch, wherever summary.json keeps it (the
    sweep, the controls, v2's ablations, the reference arms, the decomposition); else computed from its runs."""
    ppm = summary["settings"]["prompts"] // summary["settings"]["num_mini_batches"]
    lists = [summary["paired"], (summary.get("control") or {}).get("paired", []),
             *[x["paired"] for x in summary.get("v2_ablations") or []],
             *[x["paired"] for x in (summary.get("reference") or {}).get("arms", [])],
             (summary.get("decomposition") or {}).get("parts", []), (summary.get("countdown") or {}).get("paired", [])]
    for entries in lists:
        for e in entries:
            if (e["a"], e["b"], e["metric"], e["prompts_per_mini_batch"]) == (a, b, metric, ppm):
                return e
    return paired_entry(summary["runs"], a, b, metric, ppm)


def pair_item(summary, a, b, metric, family, label, rare=False):
    e = (next(x for x in summary["rare"]["paired"] if (x["a"], x["b"], x["metric"]) == (a, b, metric)) if rare
         else find_pair(summary, a, b, metric))
    if e["seeds"] < 2:  # a comparison whose runs have not landed: no interval yet
        return f"not yet run: {label} ({e['seeds']} paired seed{'s' * (e['seeds'] != 1)})"
    n = FAMILIES[family]
    word = verdict([e["ci95_t"]], e["p_t"], None if n is None else LEVEL / n, e["detectable_80"])
    ci = e["ci95_t"]
    small = metric.startswith("s_div_") and max(abs(e["mean"]), abs(ci[0]), abs(ci[1])) < 0.005
    fmt = "+.2e" if small else "+.3f"  # S_div by an LM's mean-pooled states: ~1e-4
    text = f"{word}: {label} {_num(e['mean'], fmt)} [{_num(ci[0], fmt)}, {_num(ci[1], fmt)}] ({_p(e['p_t'])}"
    detectable = _num(e["detectable_80"], fmt).lstrip("+")
    return text + (f", detectable {detectable})" if word in ("level", "not resolved") else ")")


def bases_p(claim):
    """(the mixed model's p, the t-test's p over the base means) of a claim over bases: two-sided, 4 df."""
    from scipy import stats as sps
    o, means = claim["over_bases"], [b["mean"] for b in claim["per_base"]]
    p_mixed = 2 * sps.t.sf(abs(o["mean"] / o["se"]), o["df"])
    p_means = 2 * sps.t.sf(abs(np.mean(means) / (np.std(means, ddof=1) / np.sqrt(len(means)))), len(means) - 1)
    return float(p_mixed), float(p_means)


def bases_item(summary, b, metric, label):
    claim = next(c for c in summary["bases"]["claims"] if (c["a"], c["b"], c["metric"]) == ("pacs", b, metric))
    o, t = claim["over_bases"], claim["t_over_base_means"]
    p_mixed, p_means = bases_p(claim)
    word = verdict([o["ci95"], t["ci95"]], max(p_mixed, p_means), LEVEL / BASES_ROWS)
    return (f"over five bases {word}: {label} {_num(o['mean'])} [{_num(o['ci95'][0])}, {_num(o['ci95'][1])}] "
            f"by the mixed model ({_p(p_mixed)}), {_num(t['mean'])} [{_num(t['ci95'][0])}, {_num(t['ci95'][1])}] "
            f"over the base means ({_p(p_means)})")


def base_item(summary, method="pacs", ood=False):
    """`method`'s test pass@1 against the base model's (one number, no spread): a one-sample t-test over seeds; with
    `ood`, its pass@1 out of domain (the countdown lab's chain test split) against the base model's there."""
    from scipy import stats as sps
    runs, base = ((summary["countdown"]["runs"], summary["countdown"]["base_ood_pass@k"]["1"]) if ood else
                  (summary["runs"], summary["base"]["pass@k"]["1"]))
    values = [r["ood_pass@1" if ood else "pass@1"] for r in runs if r["method"] == method]
    mean, lo, hi = t_interval(values)
    p = float(sps.ttest_1samp(values, base).pvalue)
    word = verdict([[lo - base, hi - base]], p, LEVEL)
    where = " out of domain" if ood else ""
    return f"{word}: base {base:.3f} → {method.upper()} {mean:.3f} [{lo:.3f}, {hi:.3f}]{where} ({_p(p)})"


def row_item(summary, key):
    """stability.md's reading of the stability or efficiency row (stability.row_reading) and its tests at 95%."""
    claim = summary[key]["claim"]
    names = {"spread": "spread", "drawdown": "drawdown", "log_grad_spike": "gradient spike",
             "mean_reward": "reward per sample", "samples_to_half_gain": "samples to half the gain"}
    tests = [f"{names[t['metric']]} " + (f"favours PACS over {t['b'].upper()}" if t["favours"] == "pacs" else
                                         f"favours {t['b'].upper()} over PACS") + f" ({_p(t['p'])})"
             for t in claim["tests"] if t["at_95"]]
    n = round(LEVEL / claim["threshold"])
    return f"{claim['verdict']} at p < {LEVEL} / {n} = {threshold_digits(claim['threshold'])}" + (
        f": {'; '.join(tests)}" if tests else "")


A, B, C = "lab", "lab2", "countdown"
CD = "sweep countdown"
CLAIM_ROWS = [  # (the paper's claim, its source, {lab: [item, ...] or a sentence with no number})
    ("PACS above PPO and GRPO in accuracy (pass@1 here)", "v1 Tables 1–2, every k (7B: above both in every cell; "
     "3B: below one of them in 6 of 24); v2 Sec. 4.2, Tables 2, 6", {
        A: [("pair", "pacs", "ppo", "pass@1", "sweep lab", "− PPO"),
            ("pair", "pacs", "grpo", "pass@1", "sweep lab", "− GRPO"),
            ("pair", "pacs-beta2", "ppo", "pass@1", "sweep lab", "at β = 2 − PPO"),
            ("pair", "pacs-beta2", "grpo", "pass@1", "sweep lab", "at β = 2 − GRPO"),
            ("bases", "ppo", "pass@1", "− PPO"), ("bases", "grpo", "pass@1", "− GRPO")],
        B: [("pair", "pacs", "ppo", "pass@1", "sweep lab2", "− PPO"),
            ("pair", "pacs", "grpo", "pass@1", "sweep lab2", "− GRPO"),
            ("bases", "ppo", "pass@1", "− PPO"), ("bases", "grpo", "pass@1", "− GRPO")]}),
    ("pass@1 above the base model (+8.26 at 4B, +9.57 at 8B)", "v2 abstract, Table 1",
     {A: [("base",)], B: [("base",)]}),
    ("pass@256 above PPO and GRPO (\"59.78%, +13.32 and +14.36\": v1 Table 2's AIME 2024 cells, where the base is "
     "above PACS; on AIME 2025 +15.31 and +11.77; at 3B PACS is below the base at k = 256 on all three sets)",
     "v1 abstract, Tables 1–2; dropped in v2", {
        A: "not testable: the base model's pass@64 leaves no room",
        B: [("pair", "pacs", "ppo", "pass@256", "sweep lab2", "− PPO"),
            ("pair", "pacs", "ppo@lr2.5e-05", "pass@256", "95%", "− PPO at PACS's lr (a control)"),
            ("pair", "pacs", "grpo", "pass@256", "sweep lab2", "− GRPO"),
            ("pair", "pacs", "reinforce", "pass@256", "sweep lab2", "− REINFORCE"),
            ("bases", "ppo", "pass@256", "− PPO"), ("bases", "grpo", "pass@256", "− GRPO")]}),
    ("above PPO and GRPO most on the hardest set (BeyondAIME pass@64)", "v2 Sec. 1, 4.2; Tables 2, 6", {
        A: "not testable: no hard set",
        B: [("rare", "pacs", "grpo", "pass@64", "95%", "on the rarely solved problems − GRPO"),
            ("rare", "pacs", "ppo", "pass@64", "95%", "− PPO")]}),
    ("the implicit critic: \"implicitly coupling actor and critic roles\"", "v1 abstract; v2 Eq. 5", {
        A: [("pair", "pacs", "pacs-critic-off", "pass@1", "sweep lab", "σ(ψ) on − off"),
            ("bases", "pacs-critic-off", "pass@1", "on − off"),
            ("pair", "pacs", "pacs-critic-class-shuffled", "pass@1", "parts", "its self-damping"),
            ("pair", "pacs-critic-group-shuffled", "pacs-critic-off", "pass@1", "parts", "its values at random")],
        B: [("pair", "pacs", "pacs-critic-off", "pass@1", "sweep lab2", "σ(ψ) on − off"),
            ("pair", "pacs", "pacs-critic-off@lr2.5e-05", "pass@1", "95%", "− off at PACS's lr (a control)"),
            ("bases", "pacs-critic-off", "pass@1", "on − off")]}),
    ("PPO and GRPO collapse in entropy, PACS does not", "v2 Sec. 3.4, 6.2; Fig. 5a", {
        A: [("pair", "pacs", "ppo", "final_entropy", "95%", "final entropy − PPO"),
            ("pair", "pacs", "grpo", "final_entropy", "95%", "− GRPO"),
            ("bases", "ppo", "final_entropy", "− PPO"), ("bases", "grpo", "final_entropy", "− GRPO")],
        B: [("pair", "pacs", "ppo", "final_entropy", "95%", "final entropy − PPO"),
            ("pair", "pacs", "grpo", "final_entropy", "95%", "− GRPO"),
            ("bases", "ppo", "final_entropy", "− PPO"), ("bases", "grpo", "final_entropy", "− GRPO")]}),
    ("more diverse correct answers than GRPO (S_div)", "v2 Sec. 6.2, Table 3", {
        A: "not measured: the lab's answers are single numbers", B: "not measured"}),
    ("β: robust, pass@1 best in [0.5, 1], β = 1 chosen", "v2 Sec. 5.1, Fig. 4", {
        A: [("pair", "pacs-beta2", "pacs", "pass@1", "v2", "β = 2 − β = 1"),
            ("pair", "pacs-beta0.5", "pacs", "pass@1", "v2", "β = 0.5 − β = 1"),
            ("pair", "pacs-beta2", "pacs-beta4", "pass@1", "v2", "β = 2 − β = 4"),
            ("pair", "pacs-beta0.1", "pacs", "pass@1", "v2", "β = 0.1 − β = 1"),
            ("pair", "pacs-beta10", "pacs", "pass@1", "v2", "β = 10 − β = 1")],
        B: "β = 1 only"}),
    ("the class weights help (v2: \"w/o weight\" −1.27 to +1.35 points of pass@1 over 8 cells, below PACS in 6)",
     "v2 Sec. 5.3; Tables 2, 6", {
        A: [("pair", "pacs-no-balance", "pacs", "pass@1", "v2", "without them − PACS")], B: "not run"}),
    ("RLOO above GRPO- and Dr.GRPO-style scores (v2, 4B BeyondAIME pass@1: 27.16, 26.41, 26.67)",
     "v2 Sec. 5.2; App. D.3", {
        A: [("pair", "pacs-est-grpo", "pacs", "pass@1", "v2", "GRPO-style − RLOO, under π_old at PACS's lr"),
            ("pair", "pacs-est-drgrpo", "pacs", "pass@1", "v2", "Dr.GRPO-style − RLOO")],
        B: "not run"}),
    ("the reference policy π_ref with periodic resets", "v2 Sec. 3.4", {
        A: [("pair", "pacs-ref16-keep-opt", "pacs", "pass@1", "reference", "reset every 16, AdamW kept − π_old"),
            ("pair", "pacs-ref16", "pacs", "pass@1", "reference", "every 16 − π_old"),
            ("pair", "pacs-ref4", "pacs", "pass@1", "reference", "every 4 − π_old"),
            ("pair", "pacs-ref-never", "pacs", "pass@1", "reference", "never reset − π_old")],
        B: "not run"}),
    ("more stable training", "v1 abstract; v2 abstract", {A: [("row", "stability")], B: [("row", "stability")]}),
    ("more efficient training", "v1 abstract; v2 abstract", {A: [("row", "efficiency")], B: [("row", "efficiency")]}),
    ("out of domain (LiveCodeBench, GPQA)", "v2 Sec. 6.1, Fig. 6", {A: "not testable: one task", B: "not testable"}),
    ("PACS-4B above Qwen3-14B on AIME 2025", "v2 Sec. 1, Table 1", {A: "not testable: no scale", B: "not testable"}),
]


# the countdown lab's column (its README), by the opening of each claim; a claim not named here was not run there
COUNTDOWN_CELLS = {
    "PACS above PPO and GRPO in accuracy": [("pair", "pacs", "ppo", "pass@1", CD, "− PPO"),
                                            ("pair", "pacs", "grpo", "pass@1", CD, "− GRPO")],
    "pass@1 above the base model": [("base",)],
    "pass@256 above PPO and GRPO": "not testable: the base model's pass@64 leaves no room",
    "PPO and GRPO collapse in entropy": [("pair", "pacs", "ppo", "final_entropy", "95%", "final entropy − PPO"),
                                         ("pair", "pacs", "grpo", "final_entropy", "95%", "− GRPO")],
    "more diverse correct answers than GRPO": [
        ("pair", "pacs", "grpo", "s_div_char-ngrams", CD, "S_div by character 3-grams − GRPO"),
        ("pair", "pacs", "grpo", "s_div_smollm2", CD, "by SmolLM2"),
        ("pair", "pacs", "grpo", "distinct_forms", CD, "distinct right forms − GRPO"),
        ("pair", "pacs", "ppo", "s_div_char-ngrams", CD, "S_div by 3-grams − PPO"),
        ("pair", "pacs", "ppo", "s_div_smollm2", CD, "by SmolLM2")],
    "more stable training": [("row", "stability")],
    "more efficient training": [("row", "efficiency")],
    "out of domain": [("ood base",), ("pair", "pacs", "grpo", "ood_pass@1", CD, "chain pass@1 − GRPO"),
                      ("pair", "pacs", "ppo", "ood_pass@1", CD, "− PPO"),
                      ("pair", "pacs", "grpo", "ood_pass@64", CD, "chain pass@64 − GRPO"),
                      ("pair", "pacs", "ppo", "ood_pass@64", CD, "− PPO")],
    "PACS-4B above Qwen3-14B": "not testable",
}
for _claim, _, _cells in CLAIM_ROWS:
    _cells[C] = next((v for k, v in COUNTDOWN_CELLS.items() if _claim.startswith(k)), "not run")


def item_text(summary, lab, item):
    kind = item[0]
    if kind == "pair":
        family = item[4] if item[4] != "sweep lab" else f"sweep {lab}"
        return pair_item(summary, *item[1:4], family, item[5])
    if kind == "rare":
        return pair_item(summary, *item[1:4], item[4], item[5], rare=True)
    if kind == "bases":
        return bases_item(summary, *item[1:])
    if kind == "base":
        return base_item(summary)
    if kind == "ood base":
        return base_item(summary, ood=True)
    return row_item(summary, item[1])


def cell(summaries, lab, spec):
    return spec if isinstance(spec, str) else "; ".join(item_text(summaries[lab], lab, i) for i in spec)


LAB_NAMES = {A: "first lab", B: "second lab", C: "countdown lab"}


def claims_table(summaries):
    """experiments/README.md's claims table: one row per claim of the paper, a cell per lab (the countdown lab's
    where its summary.json exists)."""
    labs = [lab for lab in (A, B, C) if lab in summaries]
    lines = ["| the paper's claim | source | " + " | ".join(LAB_NAMES[lab] for lab in labs) + " |",
             "|---|---|" + "---|" * len(labs)]
    for claim, source, cells in CLAIM_ROWS:
        lines.append(f"| {claim} | {source} | " + " | ".join(cell(summaries, lab, cells[lab]) for lab in labs) + " |")
    return "\n".join(lines)


def results_list(summaries, lab):
    """A lab page's results list: its column of the claims table, one item per claim it tests."""
    if lab == C:
        seeds = summaries[lab]["settings"]["seeds"]
        landed = ", ".join(f"{m.upper()} {len(seeds.get(m, []))}" for m in ("pacs", "grpo", "ppo"))
        lines = [f"Threshold (Bonferroni): the lab's table {family_rule(CD)} (PACS − GRPO and − PPO in "
                 f"{len(COUNTDOWN_METRICS)} metrics); the entropy at 95%; PACS against the base model at 0.05.",
                 "", f"Seeds landed: {landed} of the sweep's 16"
                 + ("." if all(len(seeds.get(m, [])) >= 16 for m in ("pacs", "grpo", "ppo")) else
                    "; until all have, every word below is provisional (with few seeds the detectable "
                    "difference is wide, and \"level\" says little)."), ""]
    else:
        rules = ", ".join(f"{name} {family_rule(f)}" for name, f in (
            ("the sweep's table", f"sweep {lab}"), ("over bases", "bases"), *((("v2's ablations and β", "v2"),
                                                                               ("π_ref's arms", "reference"),
                                                                               ("the critic's parts", "parts"))
                                                                              if lab == A else ())))
        lines = [f"Thresholds (Bonferroni): {rules}; the entropy, the controls and the rarely solved problems at "
                 "95%.", ""]
    for claim, _, cells in CLAIM_ROWS:
        if not isinstance(cells[lab], str):
            lines.append(f"- **{claim}**: {cell(summaries, lab, cells[lab])}.")
    return "\n".join(lines)


LABS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "labs")
README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "README.md")
BEGIN = "<!-- {}: python experiments/lab_summary.py --pages -->"
END = "<!-- end of the {} -->"


def pages(labs_dir=LABS_DIR):
    """{path: {block name: text}}: what `--pages` writes between each page's markers, from the labs' summary.json."""
    summaries = {}
    for lab in (A, B, C):
        if lab != C or os.path.isfile(os.path.join(labs_dir, lab, "summary.json")):
            with open(os.path.join(labs_dir, lab, "summary.json")) as f:
                summaries[lab] = json.load(f)
    return {README: {"claims table": claims_table(summaries)},
            **{os.path.join(labs_dir, lab, "README.md"): {"results list": results_list(summaries, lab)}
               for lab in summaries}}


def between(text, name):
    """The text a page holds between its `name` markers (stripped)."""
    begin, end = BEGIN.format(name), END.format(name)
    return text[text.index(begin) + len(begin):text.index(end)].strip()


def write_pages(labs_dir=LABS_DIR):
    for path, blocks in pages(labs_dir).items():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for name, block in blocks.items():
            begin, end = BEGIN.format(name), END.format(name)
            text = text[:text.index(begin) + len(begin)] + "\n" + block + "\n" + text[text.index(end):]
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)


if __name__ == "__main__":
    import sys
    if sys.argv[1:] != ["--pages"]:
        sys.exit("usage: python experiments/lab_summary.py --pages  (writes the claims table and the labs' results "
                 "lists from summary.json)")
    write_pages()
