"""At which lr does PACS's LoRA adapter learn in the first lab, and is rank 1 enough? The scan and the 16-seed answer.

PACS with a LoRA adapter at rank 1 and rank 16 (all seven projections, alpha twice the rank: the flags' defaults),
each at the lr its own validation scan picks (the highest mean validation pass@1 of a x2 grid, seeds 1000 and 1001,
as every method's lr in the lab was picked), then 16 seeds on the test split, paired by seed with full fine-tuning at
its own scanned lr (PACS, 1e-4: results/test-p32/pacs-s<seed>.json). Reads result files alone:
experiments/labs/lab/results/lora/val-p32-lr*/ (the scan), results/lora/test-p32/ (the adapters' 16 seeds) and
results/test-p32/ (full fine-tuning's), and writes experiments/labs/lab/lora.json and the tables of
docs/lora.md#the-learning-rate, which tests/test_regenerate.py recomputes from them.

    # the scan: one process per rank, one thread each (about 8 min an lr on a busy 2-core machine)
    for lr in 5e-4 1e-3 2e-3 4e-3; do OMP_NUM_THREADS=1 python experiments/trend.py --lab --split val --lr $lr \\
        --methods pacs-lora-r1 --seeds 1000 1001 --out experiments/out_lab/lora/val-p32-lr$lr-r1 \\
        --results experiments/labs/lab/results/lora/val-p32-lr$(python -c "print(f'{$lr:g}')"); done
    # (rank 16 the same over 2.5e-4 5e-4 1e-3 2e-3); then each rank at its choice, 16 seeds:
    OMP_NUM_THREADS=1 python experiments/trend.py --lab --methods pacs-lora-r1 --method-lr pacs-lora-r1=2e-3 \\
        --seeds 0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 --out experiments/out_lab/lora/test-p32-r1 \\
        --results experiments/labs/lab/results/lora/test-p32
    python experiments/lora_scan.py            # lora.json, and its tables into docs/lora.md between the markers
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lab_summary import lab_results, lab_scan, p_value, rounded  # noqa: E402
from stats import paired_differences, paired_p, smallest_detectable, t_interval  # noqa: E402

LAB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "labs", "lab")
ARMS = {"pacs-lora-r1": 1, "pacs-lora-r16": 16}
FULL = "pacs"  # full fine-tuning at its scanned lr, the sweep's runs
METRICS = ("1", "64")  # pass@1 and pass@64 on the 200 test problems, 64 samples each


def by_seed(results, method, k):
    return {r["seed"]: r["eval"]["test"][k] for r in results if r["method"] == method}


def summary(lab_dir=LAB):
    """lora.json's content: the scan (pass@1 per lr and seed, the choice) and, per rank, the test split's pass@1
    and pass@64 over seeds, LoRA - full paired by seed, the ratio of the chosen lrs and the machine of each arm."""
    root = os.path.join(lab_dir, "results")
    scan = lab_scan(os.path.join(root, "lora"))
    full_lr = lab_scan(root)["choice"][FULL]
    lora_runs = list(lab_results(os.path.join(root, "lora"), "test-p32"))
    full_runs = [r for r in lab_results(root, "test-p32") if r["method"] == FULL]
    machine = lambda runs: sorted({f"{r['machine']['cpu']}, torch {r['machine']['torch']}, "  # noqa: E731
                                   f"{r['machine']['threads']} thread" for r in runs})
    out = {"scan": scan, "full_lr": full_lr, "full_machine": machine(full_runs), "arms": {}}
    for method, rank in ARMS.items():
        runs = [r for r in lora_runs if r["method"] == method]
        if not runs:
            continue
        arm = {"rank": rank, "lr": scan["choice"][method], "lr_ratio": rounded(scan["choice"][method] / full_lr),
               "seeds": len(runs), "machine": machine(runs), "wall_s_median": rounded(np.median([r["wall_s"]
                                                                                                for r in runs]))}
        for k in METRICS:
            lora, full = by_seed(runs, method, k), by_seed(full_runs, FULL, k)
            seeds, d = paired_differences(lora, full)
            mean, lo, hi = t_interval(list(lora.values()))
            dm, dlo, dhi = t_interval(d)
            arm[f"pass@{k}"] = {"lora": [rounded(mean), rounded(lo), rounded(hi)],
                                "full": rounded(float(np.mean([full[s] for s in seeds]))),
                                "lora_minus_full": [rounded(dm), rounded(dlo), rounded(dhi)], "pairs": len(seeds),
                                "p_t": p_value(paired_p(d)), "detectable_80": rounded(smallest_detectable(d))}
        out["arms"][method] = arm
    return out


def table(s):
    """The scan's and the answer's markdown tables."""
    lrs = sorted({float(lr) for by_lr in s["scan"]["pass@1"].values() for lr in by_lr})
    lines = ["| arm | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | choice |", "|---|" + "---:|" * (len(lrs) + 1)]
    for method, by_lr in s["scan"]["pass@1"].items():
        cell = lambda lr: (f"{np.mean(by_lr[str(lr)]):.3f} ({', '.join(f'{v:.3f}' for v in by_lr[str(lr)])})"  # noqa
                           if str(lr) in by_lr else "")
        lines.append(f"| {method} | " + " | ".join(cell(lr) for lr in lrs) + f" | {s['scan']['choice'][method]:g} |")
    lines += ["", "| arm | lr (× full's) | seeds | test pass@1 | LoRA − full, pass@1 | detectable | test pass@64 | "
              "LoRA − full, pass@64 | detectable |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda x: f"{x[0]:.3f} [{x[1]:.3f}, {x[2]:.3f}]"  # noqa: E731
    sign = lambda x: f"{x:+.3f}".replace("-", "−")  # noqa: E731  (the pages' minus sign)
    dfmt = lambda e: (f"{sign(e['lora_minus_full'][0])} [{sign(e['lora_minus_full'][1])}, "  # noqa: E731
                      f"{sign(e['lora_minus_full'][2])}] p {e['p_t']:.2g}")
    for method, a in s["arms"].items():
        p1, p64 = a["pass@1"], a["pass@64"]
        lines.append(f"| {method} | {a['lr']:g} (×{a['lr_ratio']:g}) | {a['seeds']} | {fmt(p1['lora'])} | {dfmt(p1)} "
                     f"| {p1['detectable_80']:.3f} | {fmt(p64['lora'])} | {dfmt(p64)} | {p64['detectable_80']:.3f} |")
    return "\n".join(lines)


BEGIN, END = "<!-- lora tables: python experiments/lora_scan.py -->", "<!-- end of the lora tables -->"
DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "lora.md")


def write(path, tables):
    """The tables into the page at path, in place of what stands between its BEGIN and END markers."""
    with open(path, encoding="utf-8") as f:
        head, rest = f.read().split(BEGIN, 1)
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"{head}{BEGIN}\n{tables}\n{END}{rest.split(END, 1)[1]}")


def main():
    s = summary()
    with open(os.path.join(LAB, "lora.json"), "w") as f:
        json.dump(s, f, indent=1)
    print(table(s))
    write(DOCS, table(s))
    for method, a in s["arms"].items():
        print(f"{method}: {', '.join(a['machine'])}; full fine-tuning's runs: {', '.join(s['full_machine'])}")


if __name__ == "__main__":
    main()
