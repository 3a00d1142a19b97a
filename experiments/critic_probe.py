"""What sigma(psi) reads in the lab: PACS's loop for a few rollouts from the shipped base, and for every response on
mini-batches 1..M-1 its psi, its reward and how likely the sampler found it (log pi_old summed over its tokens,
centred in its group). Prints, per bin of sigma(psi), the responses, their success rate, their length and their
centred log pi_old; and the correlations behind the reliability diagram of experiments/labs/lab/lab_beta.png.

    OMP_NUM_THREADS=1 python experiments/critic_probe.py --steps 40      # 46 s of CPU (7 min beside two runs)
"""
import argparse
import os
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import lab  # noqa: E402
import pacs  # noqa: E402
import plumbing  # noqa: E402

BINS = (0.0, 0.45, 0.49, 0.51, 0.55, 1.0)  # sigma(psi): both tails, the middle


def rollout_updates(cfg, model, optimizer, roll, rewards, device):
    """Phases 3 and 4 of pacs.train_step on a rollout sampled outside it, to watch the critic (docs/pacs.ipynb):
    pi_old's log-probs, then one optimizer step per mini-batch of whole groups, as train_step runs them (PACS,
    pi_ref = pi_old). Returns [(psi (B/M,), loss)], one per mini-batch, psi scored at the weights that mini-batch
    trains from: 0 on mini-batch 0, where pi_theta == pi_old; on the later ones, what the earlier updates taught."""
    sizes, rows = plumbing.Sizes.typed(cfg), plumbing.rows_per_mini_batch(cfg)
    mask = roll["response_mask"].float()  # (B, T)
    old_logprobs, _ = pacs.reference_logprobs(cfg, model, None, roll, sizes, device)  # mini-batch 0: its own
    model.train()
    out = []
    for m in range(cfg.num_mini_batches):
        mini = slice(m * rows, (m + 1) * rows)
        for attempt in plumbing.shrinking(cfg, sizes, f"mini-batch {m}", model):
            with attempt:
                loss, psi, _ = pacs.accumulate_mini_batch(cfg, model, roll, old_logprobs, mask, rewards, mini, m == 0,
                                                          device, None, None, sizes)
        pacs.optimizer_update(cfg, model, optimizer, f"mini-batch {m}")
        out.append((psi, float(loss)))
    model.eval()
    return out


def centred(x, group_size):
    """x minus its group's mean: (B,) -> (B,)."""
    return x - x.view(-1, group_size).mean(1).repeat_interleave(group_size)


def probe(lab_dir, steps, beta, lr, seed):
    """(psi, reward, length, centred log pi_old) of every response on mini-batches 1..M-1 of `steps` rollouts of
    PACS from the lab's base (the sweep's schedule: 32 prompts x 8, M = 4), as numpy arrays."""
    lab.ensure_splits(lab_dir)
    model, tokenizer = plumbing.load_model(os.path.join(lab_dir, "model"))
    problems = plumbing.load_problems(os.path.join(lab_dir, "train.jsonl"))
    cfg = pacs.Config(prompts_per_step=32, group_size=8, num_mini_batches=4, max_new_tokens=32, micro_batch_size=64,
                      lr=lr, beta=beta, seed=seed)
    G, M = cfg.group_size, cfg.num_mini_batches
    optimizer = pacs.make_optimizer(cfg, model)
    torch.manual_seed(seed)
    out = []
    for step in range(steps):
        batch = [problems[i] for i in plumbing.batch_indices(step, len(problems), cfg.prompts_per_step, seed=seed)]
        model.eval()
        roll = pacs.sample(model, tokenizer, [plumbing.build_prompt(tokenizer, p["problem"]) for p in batch], G,
                           cfg.max_new_tokens)
        texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)
        rewards = pacs.reward_fn(texts, [p["answer"] for p in batch for _ in range(G)])  # (B,)
        mask = roll["response_mask"].float()  # (B, T)
        with torch.no_grad():
            old = (pacs.step_logprobs(cfg, model, roll, slice(0, len(rewards)))[0] * mask).sum(1)  # (B,) log pi_old
        updates = rollout_updates(cfg, model, optimizer, roll, rewards, torch.device("cpu"))
        rows = len(rewards) // M
        for m in range(1, M):  # psi == 0 on mini-batch 0
            mini = slice(m * rows, (m + 1) * rows)
            out.append(torch.stack([updates[m][0], rewards[mini], mask[mini].sum(1), centred(old[mini], G)], 1))
    return torch.cat(out).numpy().T


def report(psi, reward, length, old):
    sigma = 1 / (1 + np.exp(-psi))
    lines = [f"{len(psi):,} responses on mini-batches 1..M-1, success rate {reward.mean():.3f}",
             f"corr(psi, R) {np.corrcoef(psi, reward)[0, 1]:+.3f} | "
             f"corr(|psi|, R) {np.corrcoef(abs(psi), reward)[0, 1]:+.3f}"
             f" | corr(|psi|, centred log pi_old) {np.corrcoef(abs(psi), old)[0, 1]:+.3f}"
             f" | corr(R, centred log pi_old) {np.corrcoef(reward, old)[0, 1]:+.3f}",
             "sigma(psi) bin | responses | success rate | mean length | mean centred log pi_old"]
    for lo, hi in zip(BINS, BINS[1:]):
        k = (sigma >= lo) & (sigma < hi)
        if k.any():
            lines.append(f"[{lo:.2f}, {hi:.2f}) | {k.sum():,} | {reward[k].mean():.3f} | {length[k].mean():.1f} | "
                         f"{old[k].mean():+.2f}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--lab", default=lab.SHIPPED, help="a lab's directory (experiments/lab.py; default: the shipped)")
    p.add_argument("--steps", type=int, default=40, help="rollouts of PACS to probe")
    p.add_argument("--beta", type=float, default=1.0, help="PACS's beta")
    p.add_argument("--lr", type=float, default=1e-4, help="the sweep's lr")
    p.add_argument("--seed", type=int, default=0, help="data order and sampling")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: expected at least 1")
    if not os.path.isfile(os.path.join(args.lab, "lab.json")):
        p.error(f"--lab {args.lab}: no lab.json there (a directory experiments/lab.py built)")
    print(report(*probe(args.lab, args.steps, args.beta, args.lr, args.seed)))


if __name__ == "__main__":
    main()
