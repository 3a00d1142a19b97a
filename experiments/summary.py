"""A sweep's summary: every finished run read back (its run dir, or its committed result file), the numbers per
method and paired by seed, and OUT/summary.md and OUT/stats.json written from them.
"""
import json
import math
import os

import numpy as np

from stats import (auc_sentence, bootstrap_interval, claim_sentence, final_mean, fmt_ci, paired_differences,
                   pooled_auc, smallest_detectable, t_interval)
from sweep import (CLAIMS, CRITIC_METHODS, SWEEP_KEYS, check_result, eval_dir, method_lr, read_result, result_path,
                   run_dir)
from curves import read_metrics


def read_eval(path):
    with open(os.path.join(path, "metrics.json")) as f:
        return {ds: {int(k): v for k, v in m["pass@k"].items()} for ds, m in json.load(f)["datasets"].items()}


def collect(args):
    """{method: {seed: run}} for every finished run (trained args.steps steps and evaluated), with run =
    {"rows": metrics.jsonl rows of steps 0..steps-1, "eval": {dataset: {k: pass@k}}}; and the missing runs."""
    runs, missing = {}, []
    for method in args.methods:
        for seed in args.seeds:
            if args.results:  # the committed result files: the summary needs no run dir
                if os.path.isfile(result_path(args, method, seed)):
                    check_result(args, method, seed)
                    r = read_result(result_path(args, method, seed))
                    rows = [dict(zip(r["metrics"], vals)) for vals in zip(*r["metrics"].values())]
                    runs.setdefault(method, {})[seed] = {"rows": rows, "eval": {
                        ds: {int(k): v for k, v in passk.items()} for ds, passk in r["eval"].items()}}
                else:
                    missing.append(f"{method}-s{seed}")
                continue
            ev = eval_dir(args, method, seed)
            metrics = os.path.join(run_dir(args, method, seed), "metrics.jsonl")
            if not (os.path.isfile(os.path.join(ev, "metrics.json")) and os.path.isfile(metrics)):
                missing.append(f"{method}-s{seed}")
                continue
            rows = read_metrics(metrics)
            runs.setdefault(method, {})[seed] = {"rows": rows[:args.steps], "eval": read_eval(ev)}
    return runs, missing


def pass_metrics(args, runs):
    """[(metric name, dataset, k)]: held-out pass@1 and pass@--pass-k for each eval dataset."""
    datasets = list(next(iter(next(iter(runs.values())).values()))["eval"]) if runs else []
    return [(f"{ds} pass@{k}", ds, k) for ds in datasets for k in sorted({1, args.pass_k})]


def metric_values(args, runs):
    """{metric name: {method: {seed: value}}}: held-out pass@1 and pass@k per eval dataset, then the final
    training reward and the final entropy (each the mean of the last --last steps)."""
    out = {name: {m: {s: r["eval"][ds][k] for s, r in by_seed.items()} for m, by_seed in runs.items()}
           for name, ds, k in pass_metrics(args, runs)}
    for name, key in (("final training reward", "reward"), ("final entropy", "entropy")):
        out[name] = {m: {s: final_mean(r["rows"], key, args.last) for s, r in by_seed.items()}
                     for m, by_seed in runs.items()}
    return out


def statistics(args, runs):
    """The numbers summary.md prints, as a dict (also written to stats.json)."""
    values = metric_values(args, runs)
    per_method = {name: {m: {"n": len(v), "mean_ci95_t": t_interval(list(v.values()))} for m, v in by_m.items()}
                  for name, by_m in values.items()}
    claims = []
    for a, b in CLAIMS:
        if a not in runs or b not in runs:
            continue
        for name, by_m in values.items():
            seeds, d = paired_differences(by_m[a], by_m[b])
            boot, t = bootstrap_interval(d), t_interval(d)
            claims.append({"a": a, "b": b, "metric": name, "seeds": seeds, "diffs": d.tolist(),
                           "mean_ci95_bootstrap": boot, "mean_ci95_t": t, "detectable_80": smallest_detectable(d),
                           "sentence": claim_sentence(a, b, name, len(d), boot, t)})
    return {"values": values, "per_method": per_method, "claims": claims, "critic": critic_statistics(runs)}


CRITIC_KEYS = [("critic_shift", "mean |sigma(psi) - 1/2|"), ("critic_adv_change", "|A - A0| / |A0|"),
               ("explained_var", "explained variance")]


def critic_statistics(runs):
    """{method: {metric: {"per_seed": {seed: value}, "mean_ci95_t": (mean, lo, hi), "sentence": ...}}} for the
    runs that score a critic: the pooled AUC (and whether its t-interval over seeds excludes 0.5), and the mean
    over steps of the shift, the advantage change and PPO's explained variance."""
    out = {}
    for method in [m for m in CRITIC_METHODS if m in runs]:
        per_metric = {"critic_auc": {s: pooled_auc(r["rows"]) for s, r in runs[method].items()}}
        for key, _ in CRITIC_KEYS:
            vals = {s: [row[key] for row in r["rows"] if row.get(key) is not None] for s, r in runs[method].items()}
            if any(vals.values()):
                per_metric[key] = {s: float(np.mean(v)) if v else math.nan for s, v in vals.items()}
        out[method] = {}
        for key, per_seed in per_metric.items():
            finite = [v for v in per_seed.values() if not math.isnan(v)]
            stat = t_interval(finite)
            entry = {"per_seed": per_seed, "mean_ci95_t": stat}
            if key == "critic_auc":
                entry["sentence"] = auc_sentence(method, len(finite), stat)
            out[method][key] = entry
    return out


def write_summary(args, runs, missing, stats, base):
    names = list(stats["values"])
    lrs = {m: method_lr(args, m) for m in runs}  # --method-lr entries, else --lr
    if len(set(lrs.values())) <= 1:  # one lr for every method (or no run yet: --lr)
        lr = f"{next(iter(lrs.values()), args.lr):g}"
    else:
        lr = ", ".join(f"{m} {v:g}" for m, v in lrs.items())
    lines = [f"# Trend: {args.model} on {args.dataset}, {args.prompts} prompts x {args.group_size} samples per "
             f"step, M = {args.num_mini_batches}, {args.steps} steps, lr {lr}", "",
             f"Held-out: {args.eval_datasets}, {args.eval_problems or 'all'} problems x {args.eval_n} samples at "
             f"T = {args.eval_temperature}, top-p {args.eval_top_p}. Final reward and entropy: mean of the last "
             f"{args.last} steps. Intervals: 95%, t-interval over seeds per method; paired differences: "
             "percentile bootstrap over seeds (10,000 resamples), paired t-interval beside it.", ""]
    if missing:
        lines += [f"Not finished yet (left out): {', '.join(missing)}.", ""]
    lines += ["## Per run", "", "| method | seed | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    if base:  # the base model has pass@k only
        cells = {name: f"{base[ds][k]:.3f}" for name, ds, k in pass_metrics(args, runs) if ds in base}
        lines.append("| base model | - | " + " | ".join(cells.get(n, "-") for n in names) + " |")
    for method, by_seed in runs.items():
        for seed in sorted(by_seed):
            lines.append(f"| {method} | {seed} | " + " | ".join(f"{stats['values'][n][method][seed]:.3f}"
                                                              for n in names) + " |")
    lines += ["", "## Per method: mean [95% t-interval] over seeds", "",
              "| method | seeds | " + " | ".join(names) + " |", "|---|---:|" + "---:|" * len(names)]
    for method, by_seed in runs.items():
        lines.append(f"| {method} | {len(by_seed)} | " + " | ".join(
            fmt_ci(stats["per_method"][n][method]["mean_ci95_t"]) for n in names) + " |")
    if stats["claims"]:
        lines += ["", "## Paired by seed", "", "Detectable: the smallest true difference a paired t-test at 5% finds "
                  "4 times in 5, given the spread of these differences.", "",
                  "| difference | metric | seeds | mean | 95% bootstrap | 95% t | detectable |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for c in stats["claims"]:
            b, t = c["mean_ci95_bootstrap"], c["mean_ci95_t"]
            ci = lambda s: "-" if math.isnan(s[1]) else f"[{s[1]:+.3f}, {s[2]:+.3f}]"
            det = "-" if math.isnan(c["detectable_80"]) else f"{c['detectable_80']:.3f}"
            lines.append(f"| {c['a']} - {c['b']} | {c['metric']} | {len(c['seeds'])} | {b[0]:+.3f} | {ci(b)} "
                         f"| {ci(t)} | {det} |")
        lines += ["", "## What the intervals say", ""] + [f"- {c['sentence']}" for c in stats["claims"]]
    if stats["critic"]:
        names = [("critic_auc", "critic AUC (pooled pairs)")] + CRITIC_KEYS
        lines += ["", "## The critics: mean [95% t-interval] over seeds", "",
                  "AUC: within mixed groups, the share of (right, wrong) pairs the critic ranks right, pooled over a "
                  "run's steps, on the mini-batches 1..M-1 (psi = 0 on mini-batch 0); PACS's critic is psi, "
                  "PPO's the value at each response's last token. Shift, advantage change, explained variance: mean "
                  "over steps.", "", "| method | " + " | ".join(label for _, label in names) + " |",
                  "|---|" + "---:|" * len(names)]
        for method, by_key in stats["critic"].items():
            lines.append(f"| {method} | " + " | ".join(fmt_ci(by_key[k]["mean_ci95_t"]) if k in by_key else "-"
                                                       for k, _ in names) + " |")
        lines += [""] + [f"- {by_key['critic_auc']['sentence']}" for by_key in stats["critic"].values()]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "stats.json"), "w") as f:
        json.dump({"sweep": {k: getattr(args, k) for k in SWEEP_KEYS + ("steps", "seeds", "methods", "last")},
                   "missing": missing, "base": base, **stats}, f, indent=1, default=str)
    return text



def base_pass_at_k(args):
    """{dataset: {k: pass@k}} of the base model: its eval in --out, else (a lab sweep summarised from the committed
    result files on a fresh machine) the test pass@k that lab.py measured; None when neither exists."""
    base_path = os.path.join(args.out, "eval_base")
    if os.path.isfile(os.path.join(base_path, "metrics.json")):
        return read_eval(base_path)
    if args.lab and args.split == "test":
        with open(os.path.join(args.lab, "lab.json")) as f:
            measured = json.load(f).get("test_pass@k")
        return {"test": {int(k): v for k, v in measured.items()}} if measured else None
    return None

