"""The claims beyond one base model: a lab's recipe built again at other seeds, the replication sweep on each new base,
and each claim's answer with the base as a random effect (experiments/results.md, "The claims over bases").

Every interval of a lab's sweep is over RL seeds from one base model: it measures RL's noise, not how the answer moves
with the base. Here each new base is `experiments/lab.py` with the first base's settings (its lab.json) and another
--seed, which redraws the problems (all four splits), the initial weights and SFT's batches: a base is a draw of the
whole recipe, the population a reader's "on this kind of task" refers to. The first seeds after the shipped base's
whose build lands in the lab's window (the one the first base was built to meet) are shipped, a miss is kept in
bases/builds.json and reported, not hidden:

    python experiments/bases.py build --lab-tag lab --bases 4     # experiments/labs/lab/bases/seed<N>/, builds.json
    python experiments/bases.py sweep --lab-tag lab --seeds 0 1   # PACS, critic-off, GRPO, PPO on every new base
    python experiments/trend.py --lab ... --summary-json experiments/labs/lab/summary.json   # summary.json's "bases"
    python experiments/bases.py table --lab-tag lab               # its claims as the markdown table docs/ quotes

The sweep runs each method at the lr the lab's scan chose on its first base (experiments/labs/<tag>/summary.json's
settings): no scan per base. Seed-major: every base gets seed 0 before any gets seed 1, so a sweep cut short has
every base.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np
from scipy import stats as scipy_stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import lab  # noqa: E402
from lab_summary import by_seed, lab_summary, paired_entry, rounded  # noqa: E402
from stats import over_bases, paired_differences, t_interval  # noqa: E402
from sweep import SweepError  # noqa: E402

METHODS = ("pacs", "pacs-critic-off", "grpo", "ppo")
CLAIMS = (("pacs", "grpo"), ("pacs", "ppo"), ("pacs", "pacs-critic-off"))  # PACS - each, paired by seed, per base
# a window's rule beyond lab.py's two pass@k ranges: the second lab asks that at least a quarter of its test problems
# be solved by at most 1 of the base model's 256 samples (experiments/labs/lab2/README.md, "The shipped base")
RARE_MIN = {"lab2": 0.25}
BUILDS = "builds.json"  # experiments/labs/<tag>/bases/builds.json: every seed tried, in the window or not


def docs_dir(tag):
    return os.path.join(ROOT, "experiments", "labs", tag)


def recipe(tag):
    """lab.py's flags of the lab's first base (its lab.json settings; a setting it predates takes lab.py's default,
    which it was built with), without --out and --seed."""
    with open(os.path.join(docs_dir(tag), "base", "lab.json")) as f:
        settings = json.load(f)["settings"]
    defaults = vars(lab.parse_args(["--out", "x"]))
    flags = []
    for key, default in defaults.items():
        if key in ("out", "seed"):
            continue
        value = settings.get(key, default)
        values = value if isinstance(value, list) else [value]
        if value != "":
            flags += [f"--{key.replace('_', '-')}", *[str(v) for v in values]]
    return flags, settings, defaults


def in_window(tag, built, settings, defaults):
    """Whether a build's base model lands in the lab's window: test pass@1 and pass@eval_n in the first base's ranges
    (its window_pass1 / window_passn, else lab.py's defaults), and the rare share where the lab asks one."""
    (lo1, hi1) = settings.get("window_pass1", defaults["window_pass1"])
    (lon, hin) = settings.get("window_passn", defaults["window_passn"])
    n = str(settings.get("eval_n", defaults["eval_n"]))
    p1, pn = built["test_pass@k"]["1"], built["test_pass@k"][n]
    rare_ok = built.get("test_rare_share", 1.0) >= RARE_MIN.get(tag, 0.0)
    return bool(lo1 <= p1 <= hi1 and lon <= pn <= hin and rare_ok)


def read_builds(tag):
    path = os.path.join(docs_dir(tag), "bases", BUILDS)
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return json.load(f)["builds"]


def write_builds(tag, flags, builds):
    path = os.path.join(docs_dir(tag), "bases", BUILDS)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"recipe": ["python", "experiments/lab.py", "--out", "<dir>", "--seed", "<N>", *flags],
                   "builds": builds}, f, indent=1)
    os.replace(path + ".tmp", path)


def build(tag, bases=4, first_seed=1, max_tries=12):
    """Build seeds first_seed, first_seed + 1, ... until `bases` of them land in the window (at most max_tries seeds);
    ship each that does as experiments/labs/<tag>/bases/seed<N>/ (model/, lab.json, sft_log.jsonl). Resumable: a
    seed already in builds.json is not built again."""
    flags, settings, defaults = recipe(tag)
    builds = read_builds(tag)
    done = {b["seed"] for b in builds}
    seed = first_seed
    while sum(b["in_window"] for b in builds) < bases:
        if seed >= first_seed + max_tries:
            raise SweepError(f"{tag}: only {sum(b['in_window'] for b in builds)} of {max_tries} seeds landed in the "
                             f"window; see experiments/labs/{tag}/bases/{BUILDS}")
        if seed in done:
            seed += 1
            continue
        out = os.path.join(ROOT, "experiments", f"out_{tag}", "bases", f"seed{seed}")
        if not os.path.isfile(os.path.join(out, "lab.json")):
            shutil.rmtree(out, ignore_errors=True)  # a build cut short: lab.py builds into a new directory
            cmd = [sys.executable, os.path.join("experiments", "lab.py"), "--out", os.path.relpath(out, ROOT),
                   "--seed", str(seed), *flags]  # relative: lab.json records its --out, no machine's path
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)
        with open(os.path.join(out, "lab.json")) as f:
            built = json.load(f)
        n = str(settings.get("eval_n", defaults["eval_n"]))
        entry = {"seed": seed, "weights_sha256": built["weights_sha256"], "splits_sha256": built["splits_sha256"],
                 "sft_steps": built["sft_steps"], "pass@1": round(built["test_pass@k"]["1"], 5),
                 f"pass@{n}": round(built["test_pass@k"][n], 5),
                 "rare_share": round(built.get("test_rare_share", float("nan")), 5),
                 "in_window": in_window(tag, built, settings, defaults), "wall_s": round(built["wall_s"], 1)}
        if entry["in_window"]:
            ship = os.path.join(docs_dir(tag), "bases", f"seed{seed}")
            shutil.rmtree(ship, ignore_errors=True)
            os.makedirs(ship)
            shutil.copytree(os.path.join(out, "model"), os.path.join(ship, "model"))
            for name in ("lab.json", "sft_log.jsonl"):
                shutil.copy(os.path.join(out, name), os.path.join(ship, name))
        builds.append(entry)
        write_builds(tag, flags, builds)
        print(f"[bases] {tag} seed {seed}: pass@1 {entry['pass@1']:.3f}, pass@{n} {entry[f'pass@{n}']:.3f}, "
              f"rare {entry['rare_share']:.3f}: {'in' if entry['in_window'] else 'outside'} the window", flush=True)
        seed += 1
    return builds


def chosen_lrs(tag):
    """Each method's lr as the lab's scan chose it on its first base (experiments/labs/<tag>/summary.json's
    settings)."""
    with open(os.path.join(docs_dir(tag), "summary.json")) as f:
        lrs = json.load(f)["settings"]["lr"]
    return {m: lrs[m] for m in METHODS}


def sweep(tag, seeds, methods=METHODS):
    """trend.py on every new base, seed by seed (every base at a seed before the next seed), at the chosen lrs."""
    lrs = chosen_lrs(tag)
    for seed in seeds:
        for base in lab.shipped_bases(docs_dir(tag))[1:]:
            cmd = [sys.executable, os.path.join("experiments", "trend.py"), "--lab", base, "--seeds", str(seed),
                   "--methods", *methods, "--method-lr", *[f"{m}={lrs[m]:g}" for m in methods]]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True, cwd=ROOT)


# ---- the analysis: each claim over bases ----------------------------------------------------------------------------
def bases_summary(tag_dir, summary, prompts=32, last=10):
    """summary.json's "bases": the lab's first base (summary's runs, its 16 seeds) and every new base with result
    files (experiments/labs/<tag>/bases/seed<N>/results/test-p<prompts>/), and for each claim (PACS - GRPO, - PPO,
    - critic-off) at pass@1, the lab's largest k and the final entropy: per base the paired mean and its t-interval,
    and over bases stats.over_bases (the mixed model with the base as a random intercept: its REML optimum, whether
    it was reached, each base's share of the weight) beside the t-interval over base means, and on how many bases
    the mean of the base's seeds (2 on a new base) has the first base's sign ("holds on"). None without a new base's
    results."""
    runs_by_base, info = {}, []
    for i, base in enumerate(lab.shipped_bases(tag_dir)):
        results = lab.results_root(base)
        if i == 0:
            runs = summary["runs"]
        elif os.path.isdir(os.path.join(results, f"test-p{prompts}")):
            runs = lab_summary(results, prompts, last)["runs"]
        else:
            continue
        with open(os.path.join(base, "lab.json")) as f:
            built = json.load(f)
        name = os.path.relpath(base, tag_dir)
        runs_by_base[name] = [r for r in runs if r["method"] in METHODS]
        n = str(built["settings"].get("eval_n", 64))
        info.append({"base": name, "seed": built["settings"]["seed"], "weights_sha256": built["weights_sha256"],
                     "base_pass@1": round(built["test_pass@k"]["1"], 5),
                     f"base_pass@{n}": round(built["test_pass@k"][n], 5),
                     "seeds": {m: sorted(r["seed"] for r in runs_by_base[name] if r["method"] == m) for m in METHODS}})
    if len(runs_by_base) < 2:
        return None
    large = "pass@256" if any("pass@256" in r for rs in runs_by_base.values() for r in rs) else "pass@64"
    claims = []
    for a, b in CLAIMS:
        for metric in ("pass@1", large, "final_entropy"):
            per_base = []
            for name, runs in runs_by_base.items():
                e = paired_entry(runs, a, b, metric, prompts // 4)
                per_base.append({"base": name, "seeds": e["seeds"], "mean": e["mean"], "ci95_t": e["ci95_t"],
                                 "diffs": paired_diffs(runs, a, b, metric)})
            per_base = [p for p in per_base if p["seeds"]]
            fit = over_bases({p["base"]: p["diffs"] for p in per_base})
            means = t_interval([p["mean"] for p in per_base])
            first = per_base[0]["mean"] if per_base and per_base[0]["base"] == "base" else None
            holds = sum(1 for p in per_base if first and p["mean"] and np.sign(p["mean"]) == np.sign(first))
            claims.append({"a": a, "b": b, "metric": metric, "per_base": per_base,
                           "over_bases": {"mean": rounded(fit["mean"]), "se": rounded(fit["se"]),
                                          "ci95": [rounded(c) for c in fit["ci"]], "df": fit["df"],
                                          "between_sd": rounded(fit["between_sd"]),
                                          "within_sd": rounded(fit["within_sd"]), "boundary": fit["boundary"],
                                          "converged": fit["converged"],
                                          "weights": [rounded(w) for w in fit["weights"]]},
                           "t_over_base_means": {"mean": rounded(means[0]),
                                                 "ci95": [rounded(means[1]), rounded(means[2])]},
                           "holds_on": holds, "of": len(per_base)})
    return {"methods": list(METHODS), "large_k": large, "bases": info, "claims": claims}


def fmt(x):
    return "–" if x is None else f"{x:+.3f}".replace("-", "−")


def p_text(mean, se, df):
    """' p X': the two-sided t-test of a zero mean with this standard error and df; '' where one is missing."""
    if mean is None or not se or not df:
        return ""
    return f" p {2 * scipy_stats.t.sf(abs(mean / se), df):.2g}"


def table(entry):
    """summary.json's "bases" as markdown: per claim the first base's paired mean (its seeds), each new base's; over
    bases the mixed model's interval (t with K - 1 df) beside the t-interval over the K base means, the first base's
    share of the mixed model's weight, the between- and within-base SD, and on how many bases the mean of the base's
    seeds has the first base's sign."""
    names = [b["base"] for b in entry["bases"]]
    seeds = {b["base"]: b["seed"] for b in entry["bases"]}
    head = ["claim", "metric"] + [f"base {seeds[n]}" for n in names] + [
        "mixed model [95%]", "t over base means [95%]", f"base {seeds[names[0]]}'s weight", "between SD", "within SD",
        "holds on"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 2 + "---:|" * (len(head) - 2)]
    for c in entry["claims"]:
        per = {p["base"]: p for p in c["per_base"]}
        cells = [f"{fmt(per[n]['mean'])} ({per[n]['seeds']})" if n in per else "" for n in names]
        o, t = c["over_bases"], c["t_over_base_means"]
        over = (f"{fmt(o['mean'])} [{fmt(o['ci95'][0])}, {fmt(o['ci95'][1])}]" + (" ‡" if o["boundary"] else "")
                + p_text(o["mean"], o.get("se"), o.get("df"))
                + ("" if o.get("converged", True) else " (no REML optimum found)"))
        base_means = [p["mean"] for p in c["per_base"]]
        means = (f"{fmt(t['mean'])} [{fmt(t['ci95'][0])}, {fmt(t['ci95'][1])}]"
                 + p_text(float(np.mean(base_means)), float(np.std(base_means, ddof=1) / np.sqrt(len(base_means))),
                          len(base_means) - 1))
        weights = dict(zip([p["base"] for p in c["per_base"]], o.get("weights") or []))
        share = "–" if weights.get(names[0]) is None else f"{weights[names[0]]:.2f}"
        lines.append("| " + " | ".join([f"{c['a']} − {c['b']}", c["metric"].replace("final_entropy", "entropy"),
                                        *cells, over, means, share, f"{o['between_sd']:.3f}",
                                        f"{o['within_sd']:.3f}", f"{c['holds_on']} of {c['of']}"]) + " |")
    return "\n".join(lines) + (
        "\n\n(n): RL seeds on that base; base 0 is the shipped base. Mixed model: the base a random intercept, "
        "REML (stats.over_bases), t with K − 1 df. ‡: its between-base SD is negligible beside the seeds' (at or "
        "near 0), so it weighs each base by its seeds and the shipped base carries most of the weight; the "
        "t-interval over the K base means weighs every base alike. p: the two-sided t-test of a zero mean, K − 1 df; "
        "the rows held at once ask p < 0.05 / rows (Bonferroni). Holds on: the bases whose mean over their seeds has "
        "base 0's sign, a count of signs, not a test.\n")


def paired_diffs(runs, a, b, metric):
    """a - b in `metric` per seed both ran (seed order), to 6 decimals."""
    by = by_seed(runs, metric)
    return [round(float(x), 6) for x in paired_differences(by.get(a, {}), by.get(b, {}))[1]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", choices=["build", "sweep", "table"],
                   help="build the bases, run the replication sweep on them, or print summary.json's bases as "
                   "markdown")
    p.add_argument("--lab-tag", default="lab", help="the lab: experiments/labs/<tag>/ (lab or lab2)")
    p.add_argument("--bases", type=int, default=4, help="build: new bases to land in the window")
    p.add_argument("--first-seed", type=int, default=1, help="build: the first seed tried (the shipped base is 0)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3], help="sweep: RL seeds per base")
    args = p.parse_args(argv)
    if not os.path.isfile(os.path.join(docs_dir(args.lab_tag), "base", "lab.json")):
        sys.exit(f"bases.py: error: no lab experiments/labs/{args.lab_tag}/base/lab.json")
    try:
        if args.what == "table":
            with open(os.path.join(docs_dir(args.lab_tag), "summary.json")) as f:
                entry = json.load(f).get("bases")
            if not entry:
                sys.exit(f"bases.py: error: experiments/labs/{args.lab_tag}/summary.json has no bases entry: "
                         "no new base has result files yet")
            print(table(entry), end="")
        elif args.what == "build":
            build(args.lab_tag, args.bases, args.first_seed)
        else:
            sweep(args.lab_tag, args.seeds)
    except SweepError as e:
        sys.exit(f"bases.py: error: {e}")
    except subprocess.CalledProcessError as e:
        sys.exit(f"bases.py: error: {os.path.basename(e.cmd[1])} exited with {e.returncode} (its output is above); "
                 "the same command resumes")


if __name__ == "__main__":
    main()
