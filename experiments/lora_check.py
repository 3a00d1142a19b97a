"""Does a LoRA adapter learn in the first lab? PACS with --lora-rank 8 against PACS with full fine-tuning, by seed.

A check, not a claim: 4 seeds, and the adapter's lr (1e-3) was not scanned. It reads the result files alone:
experiments/labs/lab/results/lora-p32/pacs-lora-s<seed>.json (the adapter's runs) and test-p32/pacs-s<seed>.json
(full fine-tuning at its scanned lr, 1e-4), and the base model's pass@1 from the lab's summary.json.

    for s in "0 1" "2 3"; do OMP_NUM_THREADS=1 python experiments/trend.py --lab --methods pacs-lora \\
        --method-lr pacs-lora=1e-3 --seeds $s --out experiments/out_lab/lora-p32-${s// /} \\
        --results experiments/labs/lab/results/lora-p32 & done; wait
    python experiments/lora_check.py
"""
import json
import os

import numpy as np
from scipy import stats

LAB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "labs", "lab")


def read(path):
    with open(path) as f:
        return json.load(f)


def main():
    lora_dir, full_dir = os.path.join(LAB, "results", "lora-p32"), os.path.join(LAB, "results", "test-p32")
    seeds = sorted(int(f.rsplit("-s", 1)[1][:-5]) for f in os.listdir(lora_dir) if f.startswith("pacs-lora-s"))
    print("| seed | LoRA rank 8, lr 1e-3: pass@1 | full, lr 1e-4: pass@1 | LoRA - full | LoRA wall (s) |")
    print("|---|---|---|---|---|")
    diffs, lora = [], []
    for s in seeds:
        a, b = read(os.path.join(lora_dir, f"pacs-lora-s{s}.json")), read(os.path.join(full_dir, f"pacs-s{s}.json"))
        x, y = a["eval"]["test"]["1"], b["eval"]["test"]["1"]
        lora.append(x)
        diffs.append(x - y)
        print(f"| {s} | {x:.3f} | {y:.3f} | {x - y:+.3f} | {a['wall_s']:.0f} |")
    base = read(os.path.join(LAB, "summary.json"))["base"]["pass@k"]["1"]
    d = np.array(diffs)
    half = stats.t.ppf(0.975, len(d) - 1) * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
    print(f"\nbase pass@1 {base:.3f}; LoRA's mean {np.mean(lora):.3f} ({len(seeds)} seeds); LoRA - full "
          f"{d.mean():+.3f} [{d.mean() - half:+.3f}, {d.mean() + half:+.3f}] (95% t-interval, paired by seed)")


if __name__ == "__main__":
    main()
