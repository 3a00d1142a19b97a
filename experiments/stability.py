"""The paper's "more stable and efficient training", measured from a lab's committed result files alone: the
metrics experiments/stability.md defines (fixed before their numbers), summary.json's `stability` and `efficiency`
entries, and the whole summary.json recomputed without a figure (summary_json: what trend.py --summary-json
writes, and what tests/test_regenerate.py checks every committed summary against).

    python experiments/stability.py --table experiments/labs/lab    # the tables of experiments/stability.md
    python experiments/stability.py --figure experiments/stability_lr.png experiments/labs/lab experiments/labs/lab2

Per run (a result file's per-step metrics, T = 150 rollout steps): the drawdown of the smoothed training reward,
the gradient norm's largest spike, whether the run ends below the base model, the mean training reward, the
samples to half its gain, the median step time. Per method: the scan's share of its best at every lr and its
cliff at twice the chosen lr, the spread of final test pass@1 over seeds. PACS against the others: paired by
seed (lab_summary.paired_entry), Levene's test for the spread, Fisher's exact test for the runs below the base.
"""
import argparse
import json
import math
import os
import sys

import numpy as np
from scipy import stats as sps

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bases import bases_summary  # noqa: E402  (each claim over the lab's bases)
from lab_summary import (base_entry, control_summary, countdown_summary, critic_window,  # noqa: E402
                         decomposition_summary, lab_results, lab_scan, lab_summary, p_value, paired_entry,
                         rare_summary, rounded, threshold_digits)
from reference import ablation_summary, paired_with, reference_summary  # noqa: E402  (pi_ref, v2's ablations)
from stats import t_interval  # noqa: E402
from sweep import CLAIMS, SweepError  # noqa: E402

WINDOW = 10  # steps in the trailing mean that smooths the training reward (the summaries' final-reward window)
GAIN_SHARE = 0.5  # efficiency: the samples to reach this share of the run's own gain in smoothed reward
FAMILY = ("grpo", "ppo")  # the paper's baselines: the claims table's row tests PACS against these two
STABILITY_TESTS = ("spread", "drawdown", "log_grad_spike")  # the stability row's metrics
EFFICIENCY_TESTS = ("mean_reward", "samples_to_half_gain")  # the efficiency row's metrics; the step time, taken
# across runs under whatever load the machine had, is paired and printed as a reading, outside the row's tests
LOWER_IS_BETTER = {"spread": True, "drawdown": True, "log_grad_spike": True, "mean_reward": False,
                   "samples_to_half_gain": True, "log_step_time": True}


# ---- per run: pure functions of a run's per-step metrics ---------------------------------------------
def smoothed(values, window=WINDOW):
    """The trailing means m[t] = mean(values[t-window+1 .. t]) for t = window-1 .. T-1: (T - window + 1,)."""
    x = np.asarray(values, dtype=float)  # (T,)
    if x.ndim != 1 or len(x) < window or window < 1:
        raise SweepError(f"a curve of {len(x)} steps is shorter than the smoothing window of {window}")
    # each window summed on its own (not as a difference of prefix sums, whose rounding would make a flat curve dip)
    return np.lib.stride_tricks.sliding_window_view(x, window).mean(axis=1)


def drawdown(rewards, window=WINDOW):
    """The deepest drop of the smoothed reward below its running maximum, max_t (max_{s<=t} m[s] - m[t]), in
    reward units (the share of a step's responses rewarded); 0 for a curve that never falls."""
    m = smoothed(rewards, window)  # (T - window + 1,)
    return float(np.max(np.maximum.accumulate(m) - m))


def grad_spike(grad_norms):
    """The gradient norm's largest spike over a run: max over steps / median over steps (scale-free)."""
    g = np.asarray(grad_norms, dtype=float)  # (T,) the step's mean pre-clip gradient norm over its mini-batches
    if len(g) == 0 or not np.all(np.isfinite(g)):
        raise SweepError(f"gradient norms must be finite and at least one, got {len(g)} with a non-finite value"
                         if len(g) else "no gradient norm to take a spike of")
    median = float(np.median(g))
    if median <= 0:
        raise SweepError(f"the median gradient norm is {median}: a spike over it is undefined")
    return float(g.max() / median)


def steps_to_gain(rewards, share=GAIN_SHARE, window=WINDOW):
    """The first step t* >= window-1 whose smoothed reward reaches start + share * (final - start), start the mean
    reward of the first `window` steps and final that of the last `window`; None when final <= start (no gain)."""
    r = np.asarray(rewards, dtype=float)  # (T,)
    m = smoothed(r, window)  # (T - window + 1,); m[i] is the trailing mean at step i + window - 1
    start, final = float(r[:window].mean()), float(r[-window:].mean())
    if final <= start:
        return None
    reached = np.flatnonzero(m >= start + share * (final - start))  # never empty: m[-1] == final
    return int(reached[0]) + window - 1


def run_entry(result, base_pass1):
    """One result file's per-run numbers: final test pass@1, drawdown, gradient spike, below the base model (None
    without a base), mean training reward, steps and samples to half the gain, median step time (s); and a note
    (metric, text) for each number the file cannot give (a metric it lacks, a run shorter than the smoothing
    window), whose value is then None."""
    s, metrics = result["settings"], result["metrics"]
    name = result.get("name", result["method"])
    notes = []

    def measure(what, key, f):
        values = metrics.get(key)
        if not values or any(v is None for v in values):
            notes.append((what, f"{name}-s{result['seed']}: the result file has no per-step {key}"))
            return None
        try:
            return f(values)
        except SweepError as e:
            notes.append((what, f"{name}-s{result['seed']}: {e}"))
            return None

    pass1 = next(iter(result["eval"].values()))["1"]
    t = measure("steps to half the gain", "reward", steps_to_gain)
    entry = {"method": name, "seed": result["seed"], "pass@1": pass1,
             "drawdown": measure("drawdown", "reward", drawdown),
             "grad_spike": measure("gradient spike", "grad_norm", grad_spike),
             "below_base": None if base_pass1 is None else bool(pass1 < base_pass1),
             "mean_reward": measure("mean reward", "reward", lambda r: float(np.mean(r))),
             "steps_to_half_gain": t,
             "samples_to_half_gain": None if t is None else (t + 1) * s["prompts"] * s["group_size"],
             "median_step_time": measure("step time", "step_time", lambda v: float(np.median(v)))}
    return entry, notes


# ---- per method and per comparison -------------------------------------------------------------------
def detectable_sd_ratio(n_a, n_b, level=0.95, power=0.8):
    """The smallest SD ratio (>= 1) a two-sided F-test of equal variances at `level` finds with probability
    `power` for normal data, n_a and n_b values: sqrt(F_{(1+level)/2}(n_a-1, n_b-1) / F_{1-power}(n_a-1, n_b-1))
    (the far tail's share of the power left out). nan with fewer than 2 values on a side."""
    if n_a < 2 or n_b < 2:
        return math.nan
    d1, d2 = n_a - 1, n_b - 1
    return float(math.sqrt(sps.f.ppf((1 + level) / 2, d1, d2) / sps.f.ppf(1 - power, d1, d2)))


def spread_entry(runs, a, b):
    """SD over seeds (n - 1) of final test pass@1 for methods a and b, their ratio a / b, Levene's test centred
    at the median (Brown-Forsythe) and the smallest SD ratio this many seeds could detect (detectable_sd_ratio)."""
    va = [r["pass@1"] for r in runs if r["method"] == a]
    vb = [r["pass@1"] for r in runs if r["method"] == b]
    sd = lambda v: float(np.std(v, ddof=1)) if len(v) > 1 else math.nan
    p = math.nan
    if len(va) > 1 and len(vb) > 1 and (np.ptp(va) > 0 or np.ptp(vb) > 0):
        p = float(sps.levene(va, vb, center="median").pvalue)
    ratio = sd(va) / sd(vb) if sd(vb) > 0 else math.nan
    return {"a": a, "b": b, "metric": "spread", "seeds_a": len(va), "seeds_b": len(vb), "sd_a": rounded(sd(va)),
            "sd_b": rounded(sd(vb)), "ratio": rounded(ratio), "p_levene": p_value(p),
            "detectable_ratio_80": rounded(detectable_sd_ratio(len(va), len(vb)))}


def below_base_entry(runs, a, b):
    """Runs of a and of b ending below the base model's test pass@1, and Fisher's exact test on the 2 x 2 counts."""
    def count(m):
        flags = [r["below_base"] for r in runs if r["method"] == m and r["below_base"] is not None]
        return sum(flags), len(flags)
    (ka, na), (kb, nb) = count(a), count(b)
    p = float(sps.fisher_exact([[ka, na - ka], [kb, nb - kb]]).pvalue) if na and nb else math.nan
    return {"a": a, "b": b, "below_a": ka, "runs_a": na, "below_b": kb, "runs_b": nb, "p_fisher": p_value(p)}


def lr_robustness(runs_root, prompts=32):
    """The learning-rate scan (val-p<prompts>-lr*/) per method: the chosen lr (lab_scan's rule), validation
    pass@1 per lr and seed, each lr's mean as a share of the best mean, and the loss at twice and at half the
    chosen lr (mean at the choice - mean there; None off the grid), with the loss at twice per seed; and PACS's
    loss at twice against each other method's, paired over the scan's seeds (t-interval only: 2 seeds)."""
    choice = lab_scan(runs_root, prompts)["choice"]  # raises on a lab without a scan
    table = {}
    for r in lab_results(runs_root, f"val-p{prompts}-lr"):
        table.setdefault(r["method"], {}).setdefault(r["settings"]["lr"], {})[r["seed"]] = \
            next(iter(r["eval"].values()))["1"]
    methods = {}
    for m, by_lr in sorted(table.items()):
        means = {lr: float(np.mean(list(v.values()))) for lr, v in by_lr.items()}
        best, chosen = max(means.values()), choice[m]
        at = lambda factor: next((lr for lr in by_lr if math.isclose(lr, factor * chosen, rel_tol=1e-9)), None)
        double, half = at(2.0), at(0.5)
        loss = lambda lr: None if lr is None else rounded(means[chosen] - means[lr])
        methods[m] = {"chosen": chosen, "pass@1": {str(lr): by_lr[lr] for lr in sorted(by_lr)},
                      "share": {str(lr): rounded(means[lr] / best) for lr in sorted(by_lr)},
                      "lr_2x": double, "loss_2x": loss(double), "lr_half": half, "loss_half": loss(half),
                      "loss_2x_per_seed": None if double is None else {
                          str(s): rounded(by_lr[chosen][s] - by_lr[double][s]) for s in sorted(by_lr[chosen])
                          if s in by_lr[double]}}
    paired = []
    for a, b in CLAIMS:
        la, lb = (methods.get(m, {}).get("loss_2x_per_seed") or {} for m in (a, b))
        seeds = sorted(set(la) & set(lb))
        if seeds:
            t = t_interval([la[s] - lb[s] for s in seeds])
            paired.append({"a": a, "b": b, "metric": "loss_2x", "seeds": len(seeds), "mean": rounded(t[0]),
                           "ci95_t": [rounded(t[1]), rounded(t[2])]})
    return {"methods": methods, "paired": paired}


def parameter_counts(model_dir):
    """Trainable parameters of the lab's policy (AutoModelForCausalLM from model_dir/config.json, tied embeddings
    counted once) and of PPO's value model as plumbing.load_value_model builds it (AutoModelForTokenClassification,
    num_labels=1, no dropout: the decoder and a scalar head); built on the meta device, no weights read.
    None without a config.json."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification
    count = lambda model: sum(p.numel() for p in model.parameters())  # parameters() yields a shared tensor once
    with torch.device("meta"):
        policy = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        value = AutoModelForTokenClassification.from_config(
            AutoConfig.from_pretrained(model_dir, num_labels=1, classifier_dropout=0.0))
    return {"policy": count(policy), "value_model": count(value)}


def algo_of(flags):
    return flags[flags.index("--algo") + 1] if "--algo" in flags else "pacs"


def _logged(runs, key, name):
    """The runs with log(key) as `name` (for pairing a ratio on the log scale)."""
    return [{"method": r["method"], "seed": r["seed"], name: math.log(r[key])} for r in runs if r[key] is not None]


def comparisons(summary, runs):
    """The (PACS, other) pairs both entries state: sweep.CLAIMS, then PACS against each control run's method; those
    with runs of both methods."""
    names = sorted({r["method"] for r in (summary.get("control") or {}).get("runs", [])})
    ran = {r["method"] for r in runs}
    return [(a, b) for a, b in CLAIMS + [("pacs", n) for n in names] if a in ran and b in ran]


def row_reading(paired, spread, metrics, family=FAMILY, level=0.05):
    """The claims table's reading of a row (experiments/stability.md, "What counts as an answer"): per (baseline in
    `family`, metric), whether the comparison favours PACS or the other at the row's Bonferroni threshold
    (level / tests) and at 95%; then "holds", "contradicted" or "not shown"."""
    threshold = level / (len(family) * len(metrics))
    rows = []
    for b in family:
        for metric in metrics:
            if metric == "spread":
                e = next((s for s in spread if s["b"] == b), None)
                if e is None or e["p_levene"] is None:
                    continue
                p, pacs_better = e["p_levene"], e["sd_a"] < e["sd_b"]
            else:
                e = next((x for x in paired if x["b"] == b and x["metric"] == metric), None)
                if e is None or e["p_t"] is None:
                    continue
                p, pacs_better = e["p_t"], (e["mean"] < 0) == LOWER_IS_BETTER[metric]
            rows.append({"b": b, "metric": metric, "p": p, "favours": "pacs" if pacs_better else b,
                         "at_threshold": p < threshold, "at_95": p < level})
    favoured = {b: any(r["favours"] == "pacs" and r["at_threshold"] for r in rows if r["b"] == b) for b in family}
    if any(r["favours"] != "pacs" and r["at_threshold"] for r in rows):
        verdict = "contradicted"
    elif all(favoured.values()) and not any(r["favours"] != "pacs" and r["at_95"] for r in rows):
        verdict = "holds"
    else:
        verdict = "not shown"
    return {"threshold": threshold, "tests": rows, "verdict": verdict}


WITHIN_RUN = ("drawdown", "gradient spike")  # run_entry's stability numbers; the rest are efficiency's


# ---- summary.json's entries --------------------------------------------------------------------------
def per_run(runs_root, summary, lab_dir):
    """run_entry for every sweep run at the summary's prompts per step and every control run (named as the
    summary's control names them, "<method>@lr<lr>"), sorted by method and seed; the base model's test pass@1
    (lab_dir's lab.json; None without one); the notes of the numbers no file could give."""
    settings = summary["settings"]
    base = None
    if lab_dir and os.path.isfile(os.path.join(lab_dir, "lab.json")):
        with open(os.path.join(lab_dir, "lab.json")) as f:
            base = (json.load(f).get("test_pass@k") or {}).get("1")
    results = [r for r in lab_results(runs_root, "test-p") if r["settings"]["prompts"] == settings["prompts"]]
    for r in lab_results(runs_root, f"control-p{settings['prompts']}-lr"):
        results.append({**r, "name": f"{r['method']}@lr{r['settings']['lr']:g}"})
    entries = [run_entry(r, base) for r in results]
    runs = sorted((e for e, _ in entries), key=lambda e: (e["method"], e["seed"]))
    return runs, base, [n for _, notes in entries for n in notes]


def stability_entry(runs_root, summary, runs, base, notes):
    """summary.json's "stability": the definitions' parameters, the scan's lr robustness, per-run drawdown,
    gradient spike and below-the-base flag, and PACS against each other method (spread, paired, below_base),
    with the row's reading (row_reading); runs, base and notes from per_run."""
    ppm = summary["settings"]["prompts"] // summary["settings"]["num_mini_batches"]
    pairs = comparisons(summary, runs)
    spread = [spread_entry(runs, a, b) for a, b in pairs]
    paired = [paired_entry(runs, a, b, "drawdown", ppm) for a, b in pairs]
    logs = _logged(runs, "grad_spike", "log_grad_spike")
    paired += [paired_entry(logs, a, b, "log_grad_spike", ppm) for a, b in pairs]
    try:
        lr = lr_robustness(runs_root, summary["settings"]["prompts"])
    except SweepError:
        lr = None  # a lab without a scan at these prompts per step
    return {"window": WINDOW, "base_pass@1": base, "lr": lr,
            "runs": [{k: r[k] for k in ("method", "seed", "pass@1", "drawdown", "grad_spike", "below_base")}
                     for r in runs],
            "spread": spread, "paired": [p for p in paired if p["seeds"]],
            "below_base": [below_base_entry(runs, a, b) for a, b in pairs] if base is not None else [],
            "unmeasured": [f"{text} ({what})" for what, text in notes if what in WITHIN_RUN],
            "claim": row_reading(paired, spread, STABILITY_TESTS)}


def efficiency_entry(summary, lab_dir, runs, notes):
    """summary.json's "efficiency": samples per step, each method's trainable parameters (the policy; PPO's value
    model beside it), per-run mean reward, samples to half the gain and median step time, and PACS against each
    other method paired by seed, with the row's reading (row_reading); runs and notes from per_run."""
    settings = summary["settings"]
    ppm = settings["prompts"] // settings["num_mini_batches"]
    pairs = comparisons(summary, runs)
    paired = [paired_entry(runs, a, b, m, ppm) for m in ("mean_reward", "samples_to_half_gain") for a, b in pairs]
    logs = _logged(runs, "median_step_time", "log_step_time")
    paired += [paired_entry(logs, a, b, "log_step_time", ppm) for a, b in pairs]
    counts = parameter_counts(os.path.join(lab_dir, "model")) if lab_dir else None
    parameters = None
    if counts:
        parameters = {m: {"policy": counts["policy"], "value_model": counts["value_model"]
                          if algo_of(flags) == "ppo" else 0} for m, flags in sorted(settings["pacs_flags"].items())}
    return {"window": WINDOW, "gain_share": GAIN_SHARE,
            "samples_per_step": settings["prompts"] * settings["group_size"], "parameters": parameters,
            "runs": [{k: r[k] for k in ("method", "seed", "mean_reward", "steps_to_half_gain", "samples_to_half_gain",
                                        "median_step_time")} for r in runs],
            "no_gain": sorted(f"{r['method']}-s{r['seed']}" for r in runs if r["steps_to_half_gain"] is None),
            "paired": [p for p in paired if p["seeds"]],
            "unmeasured": [f"{text} ({what})" for what, text in notes if what not in WITHIN_RUN],
            "claim": row_reading(paired, [], EFFICIENCY_TESTS)}


def summary_json(runs_root, lab_dir="", prompts=32, last=10, results_name=""):
    """The whole of a lab's summary.json from its result files under runs_root (and its base's lab.json and model
    config in lab_dir, "" for none), as trend.py --summary-json writes it, without a figure: lab_summary, then
    base, rare (problems-<results_name>/, default test-p<prompts>), control, stability and efficiency."""
    summary = lab_summary(runs_root, prompts, last)
    base = base_entry(lab_dir) if lab_dir else None
    if base:  # the base model's pass@k beside the runs': what RL added, k by k
        summary["base"] = base
    settings = summary["settings"]
    rare = rare_summary(os.path.join(runs_root, "problems-" + (results_name or f"test-p{prompts}")),
                        settings["prompts"] // settings["num_mini_batches"])
    if rare:  # pass@k on the problems the base model rarely solved (lab_problems.py's counts)
        summary["rare"] = rare
    control = control_summary(runs_root, summary, last)
    if control:  # a method at another lr than its choice, against PACS and against itself (control-p*-lr*/)
        summary["control"] = control
    decomposition = decomposition_summary(runs_root, summary, last)
    if decomposition:  # the critic controls: PACS's margin over critic-off, part by part
        summary["decomposition"] = decomposition
    reference = reference_summary(runs_root, summary, base["pass@k"]["1"] if base else None, prompts)
    if reference:  # the paper's pi_ref: PACS with --ref-reset-every K against K = 1 (experiments/reference.py)
        summary["reference"] = reference
    ablations = ablation_summary(summary, prompts, base["pass@k"]["1"] if base else None, runs_root)
    if ablations:  # paper v2's ablations at PACS's lr, each against PACS
        summary["v2_ablations"] = ablations
    window = critic_window(runs_root)
    if window:  # the critic at every prompts per mini-batch, over the same first rollouts (axis-p*/)
        summary["critic_window"] = window
    if lab_dir and os.path.basename(os.path.abspath(lab_dir)) == "base":  # other bases: labs/<tag>/bases/
        over = bases_summary(os.path.dirname(os.path.abspath(lab_dir)), summary, prompts, last)
        if over:
            summary["bases"] = over
    countdown = countdown_summary(runs_root, summary, lab_dir, prompts)
    if countdown:  # the countdown lab: out of domain and the diversity of the right answers
        summary["countdown"] = countdown
    runs, base_pass1, notes = per_run(runs_root, summary, lab_dir)
    summary["stability"] = stability_entry(runs_root, summary, runs, base_pass1, notes)
    summary["efficiency"] = efficiency_entry(summary, lab_dir, runs, notes)
    return json.loads(json.dumps(summary))  # what a reader of the file gets back (tuples as lists, str keys)


# ---- the docs' tables and figure ---------------------------------------------------------------------
def _ci(p, scale=lambda x: x, fmt="+.3f"):
    lo, hi = p["ci95_t"]
    if p["mean"] is None:
        return "–"
    if lo is None:
        return f"{format(scale(p['mean']), fmt)}"
    return f"{format(scale(p['mean']), fmt)} [{format(scale(lo), fmt)}, {format(scale(hi), fmt)}]"


def _seeds(n):
    return f"{n} seed" + ("s" if n != 1 else "")


def _num(x, fmt):
    return "–" if x is None else format(x, fmt)


def _cell(p, scale=lambda x: x, fmt=".2f", det=None):
    """A paired entry as a table cell: mean [95% t-interval] (scaled: exp for a log ratio), p, detectable."""
    if p is None:
        return "–"
    text = f"{_ci(p, scale, fmt)} p {_num(p['p_t'], '.3g')}"
    return text + (f" (det. {format(scale(p['detectable_80']), det)})" if det and p["detectable_80"] is not None
                   else "")


def tables(summary):
    """experiments/stability.md's tables of one lab, Markdown, from its summary.json."""
    st, ef = summary["stability"], summary["efficiency"]
    out = []
    if st["lr"]:
        lrs = sorted({lr for m in st["lr"]["methods"].values() for lr in m["share"]}, key=float)
        out += ["| method | chosen | " + " | ".join(f"{float(lr):g}" for lr in lrs) + " | loss at 2× | at ½× |",
                "|---|---:|" + "---:|" * len(lrs) + "---:|---:|"]
        for m, e in st["lr"]["methods"].items():
            cells = [f"{np.mean(list(e['pass@1'][lr].values())):.3f} ({e['share'][lr]:.2f})"
                     if lr in e["share"] else "" for lr in lrs]
            fmt = lambda v: "" if v is None else f"{v:+.3f}"
            out.append(f"| {m} | {e['chosen']:g} | " + " | ".join(cells) + f" | {fmt(e['loss_2x'])} | "
                       f"{fmt(e['loss_half'])} |")
        out += ["", "| PACS − | loss at 2×, paired over the scan's seeds |", "|---|---:|"]
        out += [f"| {p['b']} | {_ci(p)} |" for p in st["lr"]["paired"]]
        out.append("")
    out += ["| PACS − | SD of test pass@1 (PACS, other) | SD ratio | Levene p | detectable ratio | "
            "drawdown | gradient spike, ratio | runs below the base (PACS, other) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in st["spread"]:
        b = s["b"]
        dd = next((p for p in st["paired"] if p["b"] == b and p["metric"] == "drawdown"), None)
        gs = next((p for p in st["paired"] if p["b"] == b and p["metric"] == "log_grad_spike"), None)
        bb = next((x for x in st["below_base"] if x["b"] == b), None)
        below = "" if bb is None else f"{bb['below_a']}/{bb['runs_a']}, {bb['below_b']}/{bb['runs_b']}"
        out.append(f"| {b} ({_seeds(s['seeds_b'])}) | {_num(s['sd_a'], '.4f')}, {_num(s['sd_b'], '.4f')} | "
                   f"{_num(s['ratio'], '.2f')} | {_num(s['p_levene'], '.3g')} | "
                   f"{_num(s['detectable_ratio_80'], '.2f')} | {_cell(dd, fmt='+.3f', det='.3f')} | "
                   f"{_cell(gs, math.exp, '.2f', det='.2f')} | {below} |")
    per_method = {}
    for r in st["runs"]:
        per_method.setdefault(r["method"], []).append(r)
    out += ["", "| method | runs | SD of test pass@1 | drawdown, median [max] | gradient spike, median [max] |",
            "|---|---:|---:|---:|---:|"]
    for m, rs in sorted(per_method.items()):
        dd, gs = [r["drawdown"] for r in rs], [r["grad_spike"] for r in rs]
        sd = np.std([r["pass@1"] for r in rs], ddof=1) if len(rs) > 1 else None
        out.append(f"| {m} | {len(rs)} | {_num(sd, '.4f')} | "
                   f"{np.median(dd):.3f} [{max(dd):.3f}] | {np.median(gs):.1f} [{max(gs):.1f}] |")
    rule = threshold_digits(st["claim"]["threshold"])
    out += ["", f"Stability row: {st['claim']['verdict']} (threshold p < {rule}).", ""]
    per_method = {}
    for r in ef["runs"]:
        per_method.setdefault(r["method"], []).append(r)
    out += ["| method | trainable parameters | mean training reward | samples to half the gain, median | "
            "median step time (s) |", "|---|---:|---:|---:|---:|"]
    for m, rs in sorted(per_method.items()):
        params = (ef["parameters"] or {}).get(m.split("@")[0])
        ptext = "" if params is None else f"{params['policy'] + params['value_model']:,}"
        samples = [r["samples_to_half_gain"] for r in rs if r["samples_to_half_gain"] is not None]
        out.append(f"| {m} | {ptext} | {np.mean([r['mean_reward'] for r in rs]):.3f} | "
                   f"{np.median(samples) if samples else float('nan'):,.0f} | "
                   f"{np.median([r['median_step_time'] for r in rs]):.3f} |")
    out += ["", "| PACS − | mean training reward | samples to half the gain | step time, ratio (a reading) |",
            "|---|---:|---:|---:|"]
    for a, b in dict.fromkeys((p["a"], p["b"]) for p in ef["paired"]):
        get = lambda metric: paired_with(ef["paired"], b, metric)
        mr, sh, tm = get("mean_reward"), get("samples_to_half_gain"), get("log_step_time")
        out.append(f"| {b} ({_seeds(mr['seeds'])}) | {_cell(mr, fmt='+.3f', det='.3f')} | "
                   f"{_cell(sh, fmt='+,.0f', det=',.0f')} | {_ci(tm, math.exp, '.2f') if tm else '–'} |")
    rule = threshold_digits(ef["claim"]["threshold"])
    out += ["", f"Efficiency row: {ef['claim']['verdict']} (threshold p < {rule}); "
            f"runs without a gain: {', '.join(ef['no_gain']) or 'none'}."]
    return "\n".join(out)


def plot_lr(labs, path):
    """Validation pass@1 against lr, one panel per lab: PACS and sweep.CLAIMS's other methods, each one colour in
    every panel (its mean over the scan's seeds joined, its seeds as dots, the chosen lr ringed); labs is
    [(title, summary)]."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator
    methods = ["pacs"] + [b for _, b in CLAIMS]
    colour = dict(zip(methods, ("tab:orange", "tab:brown", "tab:blue", "tab:red", "tab:grey")))
    fig, axes = plt.subplots(1, len(labs), figsize=(5.5 * len(labs), 4), squeeze=False)
    for ax, (title, summary) in zip(axes[0], labs):
        scan, grid = summary["stability"]["lr"], set()
        for m in methods:
            e = scan["methods"].get(m)
            if e is None:
                continue
            lrs = sorted(e["pass@1"], key=float)
            grid |= {float(lr) for lr in lrs}
            mean = lambda lr: float(np.mean(list(e["pass@1"][lr].values())))
            ax.plot([float(lr) for lr in lrs], [mean(lr) for lr in lrs], marker="o", color=colour[m], label=m,
                    lw=2.5 if m == "pacs" else 1.2)
            for lr in lrs:
                ax.scatter([float(lr)] * len(e["pass@1"][lr]), list(e["pass@1"][lr].values()), s=8, color=colour[m],
                           alpha=0.5)
            ax.scatter([e["chosen"]], [mean(str(e["chosen"]))], s=140, facecolors="none", edgecolors=colour[m])
        base = (summary.get("base") or {}).get("pass@k", {}).get("1")
        if base is not None:
            ax.axhline(base, color="grey", ls=":", lw=1, label="base model, test pass@1")
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sorted(grid)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([f"{lr:g}" for lr in sorted(grid)])
        ax.set_xlabel("learning rate (ringed: the scan's choice)")
        ax.set_ylabel("validation pass@1 after 150 steps")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--table", metavar="LAB_DOCS", help="print the tables of experiments/stability.md for the lab "
                   "whose summary.json is in LAB_DOCS (e.g. experiments/labs/lab)")
    p.add_argument("--figure", nargs="+", metavar=("PATH", "LAB_DOCS"), help="PATH, then each lab's docs dir: "
                   "validation pass@1 against lr, a panel per lab")
    args = p.parse_args(argv)
    if not args.table and not args.figure:
        p.error("give --table LAB_DOCS or --figure PATH LAB_DOCS ...")

    def load(lab_docs):
        path = os.path.join(lab_docs, "summary.json")
        if not os.path.isfile(path):
            sys.exit(f"stability.py: error: no summary.json in {lab_docs}")
        with open(path) as f:
            summary = json.load(f)
        if "stability" not in summary or "efficiency" not in summary:
            sys.exit(f"stability.py: error: {path} has no stability/efficiency entries: rewrite it with "
                     "experiments/trend.py --summary-json")
        return summary

    if args.table:
        print(tables(load(args.table)))
    if args.figure:
        if len(args.figure) < 2:
            p.error("--figure PATH LAB_DOCS [LAB_DOCS ...]")
        labs = [(f"{os.path.normpath(d)}: the scan, 2 seeds", load(d)) for d in args.figure[1:]]
        print(f"figure: {plot_lr(labs, args.figure[0])}")


if __name__ == "__main__":
    main()
