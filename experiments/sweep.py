"""Running a sweep: the methods, the pacs.py and eval.py commands of each run, resume, and the small result file
each finished run leaves (experiments/labs/lab/results/...), which counts as done: a sweep resumes from the committed
files on a fresh machine. experiments/trend.py is the command line; this file is what it runs.
"""
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pacs  # noqa: E402  (CALIBRATION_EDGES: the critic's reliability bins a run logs)
import plumbing  # noqa: E402  (latest_checkpoint: the done-check reads pacs.py's own checkpoint layout)
import lab  # noqa: E402  (the machine a result ran on)
import eval as eval_py  # noqa: E402  (changed_settings: eval.py refuses a rerun with other settings alike)
from curves import read_metrics  # noqa: E402  (a run's metrics.jsonl, sorted by step)

# name -> pacs.py flags; everything else is shared by every run of a sweep
METHODS = {
    "pacs": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance"],  # the official PACS
    "pacs-critic-off": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance",
                        "--no-implicit-critic"],  # 1/2 in place of sigma(psi): the ablation that isolates the critic
    # the critic's strength: psi = beta * sum log-ratio, so beta scales how far sigma(psi) moves off 1/2
    "pacs-beta0.5": ["--algo", "pacs", "--beta", "0.5", "--estimator", "rloo", "--balance"],
    "pacs-beta2": ["--algo", "pacs", "--beta", "2.0", "--estimator", "rloo", "--balance"],  # official beta = 2 script
    "pacs-beta4": ["--algo", "pacs", "--beta", "4.0", "--estimator", "rloo", "--balance"],
    "pacs-beta0.1": ["--algo", "pacs", "--beta", "0.1", "--estimator", "rloo", "--balance"],  # v2's beta axis ends
    "pacs-beta10": ["--algo", "pacs", "--beta", "10.0", "--estimator", "rloo", "--balance"],
    # the paper's pi_ref (v2): a frozen copy of the weights, reset to pi_theta with AdamW's state every K rollout
    # steps; never reset (Eq. 7's fixed pi_ref); and the reset's weights without its optimizer half
    "pacs-ref4": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance", "--ref-reset-every", "4"],
    "pacs-ref16": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance", "--ref-reset-every", "16"],
    "pacs-ref-never": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance",
                       "--ref-reset-every", "0"],
    "pacs-ref16-keep-opt": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance",
                            "--ref-reset-every", "16", "--no-ref-reset-optimizer"],
    "pacs-est-grpo": ["--algo", "pacs", "--beta", "1.0", "--estimator", "grpo", "--balance"],  # psi: (r - mean) / std
    "pacs-est-drgrpo": ["--algo", "pacs", "--beta", "1.0", "--estimator", "drgrpo", "--balance"],  # psi: r - mean
    "pacs-no-balance": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--no-balance"],
    # PACS with a rank-8 LoRA adapter (alpha 16) on the frozen base: a check that the adapter learns (--lora-rank)
    "pacs-lora": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance", "--lora-rank", "8"],
    # LoRA's learning rate (experiments/lora_scan.py): rank 1 and rank 16 on all seven projections, alpha twice the
    # rank (the flag's default), each at the lr its own validation scan picks; GRPO at rank 1 beside them
    "pacs-lora-r1": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance", "--lora-rank", "1"],
    "pacs-lora-r16": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance", "--lora-rank", "16"],
    "grpo-lora-r1": ["--algo", "grpo", "--lora-rank", "1"],
    # what the critic does (experiments/critic_controls.py): sigma(psi), detached, permuted in each group in its place;
    # within each class (the ranking kept, each response's tie to its own move broken), or regardless of R (neither)
    "pacs-critic-class-shuffled": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance",
                                   "--critic-control", "class-shuffled"],
    "pacs-critic-group-shuffled": ["--algo", "pacs", "--beta", "1.0", "--estimator", "rloo", "--balance",
                                   "--critic-control", "group-shuffled"],
    # the official: seq-mean-token-sum-norm, dual clip 3, grad clip 1.0 (pacs.py's defaults)
    "grpo": ["--algo", "grpo"],
    "grpo-token-mean": ["--algo", "grpo", "--loss-agg", "token-mean", "--clip-c", "0", "--max-grad-norm", "0"],
    "ppo": ["--algo", "ppo"],  # the official: a value model, GAE (gamma = lam = 1), critic lr 1e-5
    "reinforce": ["--algo", "reinforce"],
}
ALIASES = {"pacs-beta1": "pacs", "pacs-est-rloo": "pacs"}  # the defaults of PACS under their ablation names
DEFAULT_METHODS = ["pacs", "pacs-critic-off", "grpo", "ppo", "reinforce"]
PASSK_FIGURE_METHODS = ["pacs", "grpo", "ppo"]  # the paper's pass@k figure: base model, PACS, GRPO, PPO
# paired-by-seed differences the summary states: PACS against its critic switched off, and against each baseline
CLAIMS = [("pacs", "pacs-critic-off"), ("pacs", "grpo"), ("pacs", "ppo"), ("pacs", "reinforce")]
# runs whose metrics.jsonl scores a critic (critic_auc, ...): summary.md's critics table has each; lab_critic.png
# the first three (PACS's critic at other betas: lab_beta.png)
CRITIC_METHODS = ["pacs", "pacs-critic-off", "ppo", "pacs-beta0.5", "pacs-beta2", "pacs-beta4",
                  "pacs-critic-class-shuffled", "pacs-critic-group-shuffled", "pacs-beta0.1", "pacs-beta10",
                  "pacs-ref4", "pacs-ref16", "pacs-ref-never", "pacs-ref16-keep-opt"]
# settings that define a sweep's runs and evals: a rerun into the same --out must match them
SWEEP_KEYS = ("model", "dataset", "data_dir", "prompts", "group_size", "num_mini_batches", "max_new_tokens",
              "lr", "method_lr", "critic_lr_ratio", "pacs_args", "eval_datasets", "eval_problems", "eval_n",
              "eval_temperature", "eval_top_p", "eval_max_new_tokens", "eval_args", "diversity", "diversity_k")


# added since the first sweeps, with their neutral value
NEW_SWEEP_KEYS = {"method_lr": {}, "critic_lr_ratio": 0.0, "diversity": [], "diversity_k": 4}


class SweepError(Exception):
    """A user-facing problem with the flags or the --out dir: printed as one line."""


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
    ckpt = plumbing.latest_checkpoint(path)
    return 0 if ckpt is None else int(ckpt.rsplit("-", 1)[1]) + 1


def train_script(method):
    """pacs.py, or for a critic control (a --critic-control flag) experiments/critic_controls.py: pacs.py with
    sigma(psi) permuted in its gradient, every other flag pacs.py's."""
    return os.path.join("experiments", "critic_controls.py") if "--critic-control" in METHODS[method] else "pacs.py"


def train_command(args, method, seed):
    data = ["--data-dir", args.data_dir] if args.data_dir else []
    return [sys.executable, train_script(method), "--model", args.model, "--dataset", args.dataset, *data,
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
    evaluate(args, plumbing.latest_checkpoint(path), eval_dir(args, method, seed))
    if args.results:
        write_result(args, method, seed, time.time() - t0)


# ---- per-run result files: what a finished run leaves in --results (small, committed), resumable from them -----
RESULT_KEYS = ("reward", "entropy", "response_len", "mixed_groups", "critic_auc", "critic_pairs", "critic_shift",
               "critic_adv_change", "explained_var", "grad_norm", "step_time", "psi_abs",
               "critic_auc_first")  # the metrics.jsonl columns kept


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
            "eval_max_new_tokens": args.eval_max_new_tokens, "eval_args": args.eval_args,
            **({"diversity": list(args.diversity), "diversity_k": args.diversity_k}
               if getattr(args, "diversity", None) else {})}  # a key a sweep without it never had


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


DIVERSITY_SEED = 0  # eval.py's --seed: which K right samples of a problem are drawn (eval.draw_correct)


def drawn_answers(samples_path, k, seed, dataset):
    """{problem id: the extracted answers of the k right samples eval.py --diversity drew (eval.draw_correct)} for one
    dataset's rows with k right or more: what a summary counts distinct forms over, the draw fixed by (seed, id)."""
    out = {}
    with open(samples_path) as f:
        for row in (json.loads(line) for line in f if line.strip()):
            drawn = os.path.basename(row["dataset"]) == dataset and eval_py.draw_correct(row, k, seed)
            if drawn:
                out[row["id"]] = [row["extracted"][i] for i in drawn]
    return out


def result_diversity(args, ev, dataset):
    """A result file's "diversity": paper v2's Div(q) of each `dataset` problem with --diversity-k right samples, by
    each --diversity embedder (eval.run_diversity over the eval's samples.jsonl: no sampling), and the extracted
    answers of the K drawn (one draw for every embedder: seeded by problem), so that a summary restricts a comparison
    to the problems both runs have K right in and counts distinct forms with the task's own canonical()."""
    out = {"dataset": dataset, "k": args.diversity_k, "seed": DIVERSITY_SEED, "by_embedder": {}}
    for embedder in args.diversity:
        entries = eval_py.run_diversity(ev, embedder, args.diversity_k, DIVERSITY_SEED)
        d = next(v for name, v in entries.items() if os.path.basename(name) == dataset)
        out["by_embedder"][embedder] = {"pooling": d["pooling"], "s_div": d["s_div"], "problems": d["problems"],
                                        "left_out": d["left_out"],
                                        "div": {i: round(v["div"], 6) for i, v in d["per_problem"].items()}}
    out["drawn_answers"] = drawn_answers(os.path.join(ev, "samples.jsonl"), args.diversity_k, DIVERSITY_SEED, dataset)
    return out


def pooled_calibration(rows):
    """The critic's reliability counts (pacs.py's critic_calibration: per sigma(psi) bin, responses, summed
    sigma(psi), right ones) summed over a run's steps, with the bin edges; None when no step logged them."""
    logged = [r["critic_calibration"] for r in rows if r.get("critic_calibration")]
    if not logged:
        return None
    return {"edges": list(pacs.CALIBRATION_EDGES),
            **{k: [round(sum(c[k][i] for c in logged), 4) for i in range(len(logged[0][k]))]
               for k in ("n", "sigma", "right")}}


def write_result(args, method, seed, wall_s):
    """--results/<method>-s<seed>.json: the run's settings, per-step metrics (RESULT_KEYS), the critic's reliability
    counts over its steps (pooled_calibration), held-out pass@k for every k, the boxed-expression share, the wall
    time and the machine; written to a temp file and renamed."""
    rows = read_metrics(os.path.join(run_dir(args, method, seed), "metrics.jsonl"))[:args.steps]
    ev = eval_dir(args, method, seed)
    with open(os.path.join(ev, "metrics.json")) as f:
        datasets = json.load(f)["datasets"]
    out = {"method": method, "seed": seed, "settings": result_settings(args, method),
           "metrics": {k: [round(v, 5) if isinstance(v, float) else v for v in (r.get(k) for r in rows)]
                       for k in RESULT_KEYS},  # 5 decimals: a run's file stays ~12 KB
           "calibration": pooled_calibration(rows),
           "eval": {os.path.basename(ds): m["pass@k"] for ds, m in datasets.items()},
           "boxed_expressions": boxed_expressions(os.path.join(ev, "samples.jsonl")), "wall_s": round(wall_s, 1),
           "machine": lab.machine()}
    if getattr(args, "diversity", None):
        out["diversity"] = result_diversity(args, ev, os.path.basename(next(iter(datasets))))  # the first set
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
    mine = {k: getattr(args, k, NEW_SWEEP_KEYS.get(k)) for k in SWEEP_KEYS}
    path = os.path.join(args.out, "sweep.json")
    saved = {}
    if os.path.isfile(path):
        with open(path) as f:
            saved = json.load(f)
        # a key newer than the sweep.json is no change while it has its neutral value
        older = {k for k in NEW_SWEEP_KEYS if k not in saved and mine[k] == NEW_SWEEP_KEYS[k]}
        diff = eval_py.changed_settings(path, {k: v for k, v in mine.items() if k not in older})
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

