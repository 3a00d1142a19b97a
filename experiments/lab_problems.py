"""Each finished run's correct samples per test problem, kept beside its result file: what pass@k on a subset of
the problems is computed from (the second lab asks it of the problems its base model rarely solves, where the
paper's exploration claim lives).

A result file keeps pass@1..n over all problems; the per-problem counts live in the run directory's eval samples
(eval.py's samples.jsonl, 2.8 MB at 200 problems x 256 samples), which are not committed. This writes them, small,
into the lab's results:

    python experiments/lab_problems.py experiments/out_lab2/test-p32-a experiments/out_lab2/test-p32-b \\
        --into experiments/labs/lab2/results/problems-test-p32 --results experiments/labs/lab2/results/test-p32

<into>/<method>-s<seed>.json for every run directory (<method>-s<seed>/) whose last eval finished, and
base-s<eval seed>.json from an eval_base/ (the sweep's, at eval.py's seed 0: the samples lab.json measured; another
seed's is a fresh look at the same model); {"method", "seed", "eval_n", "correct": {problem id: correct samples}}.
A file that exists is left as it is, so the command can run as often as runs land.

With --table, the counts are read back instead: pass@1 and pass@n per method (mean over seeds; "base": every eval
seed of the base model) on the test problems of each chain length (a lab solution writes one line per operation),
printed as a markdown table:

    python experiments/lab_problems.py --table experiments/labs/lab2/base/test.jsonl \\
        --into experiments/labs/lab2/results/problems-test-p32
"""
import argparse
import glob
import json
import os
import re
import sys

RUN_DIR = re.compile(r"^(?P<method>.+)-s(?P<seed>\d+)$")


def finished_eval(directory):
    """The eval directory of a run's last eval (eval-step<N>/ with the largest N, or eval_base/ itself) when eval.py
    finished it (its metrics.json is written last), else None."""
    if os.path.basename(directory) == "eval_base":
        candidates = [directory]
    else:
        candidates = sorted(glob.glob(os.path.join(directory, "eval-step*")),
                            key=lambda p: int(p.rsplit("eval-step", 1)[1]))[-1:]
    for d in candidates:
        if os.path.isfile(os.path.join(d, "metrics.json")) and os.path.isfile(os.path.join(d, "samples.jsonl")):
            return d
    return None


def problem_counts(eval_dir):
    """(n, {problem id: correct samples}) from eval.py's samples.jsonl: one dataset, every problem n samples."""
    counts, ns = {}, set()
    with open(os.path.join(eval_dir, "samples.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if row["id"] in counts:
                sys.exit(f"lab_problems.py: error: {eval_dir}/samples.jsonl holds problem {row['id']} twice")
            counts[row["id"]] = sum(bool(c) for c in row["correct"])
            ns.add(len(row["correct"]))
    if len(ns) != 1:
        sys.exit(f"lab_problems.py: error: {eval_dir}/samples.jsonl has {sorted(ns)} samples per problem, not one n")
    return ns.pop(), counts


def collect(run_parents, into, results=None):
    """Write <into>/<method>-s<seed>.json for every finished run under the run_parents (with `results`, only the
    runs whose result file is there: the runs that count as done) and <into>/base-s<seed>.json from their eval_base/;
    returns the paths written (existing files are kept)."""
    os.makedirs(into, exist_ok=True)
    written = []
    for parent in run_parents:
        if not os.path.isdir(parent):
            sys.exit(f"lab_problems.py: error: {parent} is not a directory (a sweep's --out)")
        for name in sorted(os.listdir(parent)):
            match = RUN_DIR.match(name)
            if name != "eval_base" and not match:
                continue
            eval_dir = finished_eval(os.path.join(parent, name))
            if eval_dir is None:
                continue
            if match:
                method, seed = match["method"], int(match["seed"])
                if results and not os.path.isfile(os.path.join(results, f"{name}.json")):
                    continue
            else:  # eval_base/, named by eval.py's seed: base-s0.json is the samples lab.json measured
                with open(os.path.join(eval_dir, "config.json")) as f:
                    method, seed = "base", json.load(f)["seed"]
            target = os.path.join(into, f"{method}-s{seed}.json")
            if os.path.exists(target):
                continue
            n, counts = problem_counts(eval_dir)
            entry = {"method": method, "seed": seed, "eval_n": n, "correct": counts}
            with open(target + ".tmp", "w") as f:
                json.dump(entry, f, indent=0)
            os.replace(target + ".tmp", target)  # a killed write leaves no half file that counts as done
            written.append(target)
    return written


def chain_lengths(problems_jsonl):
    """{problem id: operations}: a lab solution (lab.make_problem) writes one line per operation."""
    with open(problems_jsonl) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    missing = [r.get("id", "?") for r in rows if not r.get("solution")]
    if missing:
        sys.exit(f"lab_problems.py: error: {problems_jsonl}: problem {missing[0]} has no worked solution "
                 "(--table reads a lab's test.jsonl)")
    return {r["id"]: r["solution"].count("\n") + 1 for r in rows}


def by_chain_length(into, problems_jsonl):
    """{method: {"seeds", "eval_n", "problems": {ops: count}, "pass@1": {ops: mean}, "pass@n": {ops: mean}}} from the
    count files in `into`: per file, pass@1 and pass@n averaged over the problems of each chain length (eval.py's
    estimator), then over the method's seeds; every base-s*.json counts as a seed of the method "base"."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from eval import pass_at_k  # the unbiased estimator (eval.py imports torch: only this mode needs it)
    ops = chain_lengths(problems_jsonl)
    problems = {o: sum(v == o for v in ops.values()) for o in sorted(set(ops.values()))}
    per_method = {}
    for path in sorted(glob.glob(os.path.join(into, "*.json"))):
        with open(path) as f:
            entry = json.load(f)
        if set(entry["correct"]) != set(ops):
            sys.exit(f"lab_problems.py: error: {path} counts other problems than {problems_jsonl} holds")
        n = entry["eval_n"]
        per_method.setdefault((entry["method"], n), []).append(
            {key: {o: sum(pass_at_k(n, c, k) for i, c in entry["correct"].items() if ops[i] == o) / problems[o]
                   for o in problems} for key, k in (("pass@1", 1), ("pass@n", n))})
    if not per_method:
        sys.exit(f"lab_problems.py: error: no count files in {into}")
    return {method: {"seeds": len(files), "eval_n": n, "problems": problems,
                     **{key: {o: sum(f[key][o] for f in files) / len(files) for o in problems}
                        for key in ("pass@1", "pass@n")}}
            for (method, n), files in sorted(per_method.items())}


def print_table(table):
    """The table as markdown: a row per method (the base model first), a column per chain length."""
    first = next(iter(table.values()))
    print("| method | seeds | " + " | ".join(f"{o} ops ({c} problems): pass@1, pass@{first['eval_n']}"
                                             for o, c in first["problems"].items()) + " |")
    print("|---|---:|" + "---:|" * len(first["problems"]))
    for method in sorted(table, key=lambda m: (m != "base", m)):
        row = table[method]
        print(f"| {method} | {row['seeds']} | " + " | ".join(
            f"{row['pass@1'][o]:.3f}, {row['pass@n'][o]:.3f}" for o in row["problems"]) + " |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("run_parents", nargs="*", help="sweep --out directories holding <method>-s<seed>/ and eval_base/")
    p.add_argument("--into", required=True,
                   help="where the counts go, e.g. experiments/labs/lab2/results/problems-test-p32")
    p.add_argument("--results", help="only runs with a result file here (the sweep's --results), e.g. "
                                     "experiments/labs/lab2/results/test-p32")
    p.add_argument("--table", metavar="TEST_JSONL", help="read the counts in --into back instead: pass@1 and pass@n "
                                                         "per method by chain length, the problems from this file")
    args = p.parse_args(argv)
    if args.table:
        if args.run_parents:
            p.error("--table reads the counts in --into; it takes no run directories")
        print_table(by_chain_length(args.into, args.table))
        return
    if not args.run_parents:
        p.error("name the sweep --out directories to collect from (or --table to read the counts back)")
    written = collect(args.run_parents, args.into, args.results)
    print(f"{len(written)} written into {args.into}" + "".join(f"\n  {os.path.basename(w)}" for w in written))


if __name__ == "__main__":
    main()
