"""Wall time of one pacs.py training step on the lab (experiments/lab.py), phase by phase, on one CPU thread.

    # the shipped base:
    OMP_NUM_THREADS=1 python benchmarks/lab_step.py --lab experiments/labs/lab/base --micro-batch-size 64
    # cProfile of one step:
    OMP_NUM_THREADS=1 python benchmarks/lab_step.py --lab experiments/labs/lab/base --profile
    # the same step on a GPU:
    python benchmarks/lab_step.py --lab experiments/labs/lab/base --device cuda --json lab.json

Runs pacs.train_step (the trainer's own step: sample, verify, pi_old log-probs, M AdamW updates) at 32 prompts
x G = 8, M = 4 by default, after --warmup untimed steps, and prints the mean and min over --steps timed steps of
each phase (generate, verify, old log-probs, updates) and of the whole step, with the response length.
--attn picks the attention kernel (the lab's model loads with transformers' default, sdpa).
"""
import argparse
import cProfile
import dataclasses
import json
import os
import pstats
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pacs  # noqa: E402
import plumbing  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import lab  # noqa: E402  (the shipped lab's splits, regenerated from its seed)

PHASES = ("time_generate", "time_verify", "time_old_logprobs", "time_update", "step_time")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lab", required=True,
                   help="a directory experiments/lab.py built (experiments/labs/lab/base: the shipped one)")
    p.add_argument("--algo", default="pacs", choices=["pacs", "grpo", "ppo", "reinforce"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--num-mini-batches", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=0, help="0: the memory plan's")
    p.add_argument("--attn", default="", choices=["", "eager", "sdpa"], help="attention kernel ('' = as loaded)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--json", default="", help="also write the means per phase here")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile", action="store_true", help="cProfile one step, print the top 25 by cumulative time")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.join(args.lab, "model")):
        sys.exit(f"lab_step.py: error: no model/ in {args.lab} (build it with experiments/lab.py --out {args.lab})")
    lab.ensure_splits(args.lab)  # a shipped lab commits no splits
    torch.set_num_threads(args.threads)
    cfg = pacs.Config(model=os.path.join(args.lab, "model"), dataset=os.path.join(args.lab, "train.jsonl"),
                      algo=args.algo, prompts_per_step=args.prompts, group_size=args.group_size,
                      num_mini_batches=args.num_mini_batches, max_new_tokens=args.max_new_tokens, lr=1e-5,
                      micro_batch_size=args.micro_batch_size, device=args.device, eval_every=0)
    try:
        plumbing.check_config(cfg)
        device = plumbing.pick_device(cfg)
    except plumbing.ConfigError as e:
        sys.exit(f"lab_step.py: error: {e}")
    torch.manual_seed(0)
    model, rollout_model, tokenizer, sizes = plumbing.setup_model(cfg, cfg.model, device)
    if args.attn:
        model.set_attn_implementation(args.attn)
    problems = plumbing.load_problems(cfg.dataset)
    optimizer = pacs.make_optimizer(cfg, model)
    critic = critic_opt = None
    if args.algo == "ppo":
        critic = plumbing.load_value_model(cfg, cfg.model, device)
        if args.attn:
            critic.set_attn_implementation(args.attn)
        critic_opt = pacs.make_optimizer(cfg, critic, lr=cfg.critic_lr)
    step = lambda s: pacs.train_step(cfg, model, tokenizer, optimizer, problems, s, device, rollout_model,
                                     critic, critic_opt, sizes=sizes)[0]
    for s in range(args.warmup):
        step(s)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        m = step(args.warmup)
        prof.disable()
        print(f"one step: {m['step_time']:.3f} s")
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return
    rows = [step(args.warmup + s) for s in range(args.steps)]
    print(f"lab step: {args.algo}, {args.prompts} prompts x G = {args.group_size}, M = {args.num_mini_batches}, "
          f"{args.threads} thread(s), attention {model.config._attn_implementation}, micro-batch "
          f"{sizes.micro_batch_size} rows; {args.steps} timed steps after {args.warmup} warm-up")
    print(f"response length {np.mean([r['response_len'] for r in rows]):.1f} tokens, "
          f"reward {np.mean([r['reward'] for r in rows]):.3f}")
    for k in PHASES:
        v = [r[k] for r in rows]
        print(f"  {k:18s} mean {np.mean(v):.3f} s  min {np.min(v):.3f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "threads": args.threads, "steps": args.steps,
                       **dataclasses.asdict(sizes),
                       "response_len": float(np.mean([r["response_len"] for r in rows])),
                       **{k: float(np.mean([r[k] for r in rows])) for k in PHASES}}, f, indent=2)


if __name__ == "__main__":
    main()
