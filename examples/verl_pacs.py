"""PACS inside verl (0.9.1): an advantage estimator and a policy loss, registered with verl's registries, whose
loss is pacs.pacs_loss (imported: one source of truth).

verl keeps everything a large run needs: Ray, vLLM / SGLang rollouts, the reward managers, FSDP / FSDP2 over many
GPUs, checkpoints, logging. Its update runs `engine_workers.TrainingWorker.train_mini_batch` -> the FSDP engine's
`train_batch` -> `forward_backward_batch` -> `verl/workers/utils/losses.py` `ppo_loss`, which calls the policy loss
registered under `actor_rollout_ref.actor.policy_loss.loss_mode` by keyword: (old_log_prob, log_prob, advantages,
response_mask, loss_agg_mode, config, rollout_is_weights), and expects (loss, metrics) back. Three things stand
between that and PACS, and each is handled here:

1. The loss never sees the rewards. The advantage estimator `pacs_label` (algorithm.adv_estimator) returns the
   0/1 verifier label R of each response as its advantage, R on every response token; the loss `pacs` reads R
   back as the masked mean of its advantages. The estimator refuses rewards outside {0, 1}.
2. The loss never sees the groups; it relies on the order. verl keeps the G samples of a prompt in adjacent rows
   (`repeat(interleave=True)`), cuts a rollout into mini-batches and micro-batches in order, and the loss reads
   rows i*G .. i*G+G-1 as one group. What reorders rows is refused with one line: `actor.shuffle=True` and
   `actor.use_dynamic_bsz=True` (seen by the loss, in the actor config every call gets, and by the estimator);
   a micro-batch that is not a multiple of G; a rollout whose groups are not in adjacent aligned blocks of G rows
   (seen by the estimator from the uid of each row). With N data-parallel ranks, verl's dispatch hands rank r the
   r-th contiguous share of the rollout, and each rank cuts its share into mini-batches of ppo_mini_batch_size / N
   prompts: mini-batch m is every rank's m-th block of groups, each group whole on one rank. The estimator refuses,
   from the trainer config, what splits a group across ranks: the V1 trainer on several ranks (it balances every
   batch across ranks by length), trainer.balance_batch=True, a ppo_mini_batch_size or a rollout not a multiple of N.
3. Loss scaling. The engine sums the losses of a mini-batch's micro-batches and FSDP averages the ranks; it
   expects each micro-batch's loss normalised by the global mini-batch (`config.global_batch_info`: dp_size,
   global_batch_size). pacs_loss is the mean over its b rows, so it is scaled by b * dp_size / global_batch_size:
   the step's gradient is that of the mean of w * BCE over the global mini-batch's rows, as in pacs.py. (A per-call
   mean without that factor gives a gradient as many times too large as there are micro-batches; without dp_size,
   N times too small.)
The critic sigma(psi) acts only from a rollout's second optimizer step on (pi_theta = pi_old on the first: psi = 0);
the estimator refuses a rollout trained in one step (data.train_batch_size = actor.ppo_mini_batch_size, ppo_epochs 1).
pi_old is verl's `old_log_probs`, recomputed by the actor right after sampling; the estimator refuses
`algorithm.rollout_correction.bypass_mode=True`, which puts the rollout engine's log-probs in its place.

Load it the way verl loads external modules, in the driver and in every worker: with `examples/` on PYTHONPATH,
`VERL_USE_EXTERNAL_MODULES=verl_pacs` (read by `import verl`). The settings, the official run's (ritzz-ai/PACS
scripts/pacs/pacs_beta_1.0.sh: 1024 prompts x 8 samples per rollout, 4 optimizer steps of 256 prompts, a micro-batch
of one group, AdamW at 1e-6, no gradient clipping, no KL or entropy term), with verl's default trainer on one GPU:

    PYTHONPATH=$PWD/examples VERL_USE_EXTERNAL_MODULES=verl_pacs python -m verl.trainer.main_ppo \\
        algorithm.adv_estimator=pacs_label actor_rollout_ref.actor.policy_loss.loss_mode=pacs \\
        data.train_batch_size=1024 actor_rollout_ref.rollout.n=8 \\
        actor_rollout_ref.actor.ppo_mini_batch_size=256 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \\
        actor_rollout_ref.actor.shuffle=False actor_rollout_ref.actor.use_dynamic_bsz=False \\
        actor_rollout_ref.actor.use_kl_loss=False actor_rollout_ref.actor.entropy_coeff=0 \\
        actor_rollout_ref.actor.optim.lr=1e-6 actor_rollout_ref.actor.optim.clip_grad=1e9 \\
        algorithm.use_kl_in_reward=False trainer.n_gpus_per_node=1 trainer.nnodes=1 \\
        actor_rollout_ref.model.path=... data.train_files=... data.val_files=... actor_rollout_ref.rollout.name=vllm

On N GPUs: trainer.use_v1=False trainer.balance_batch=False trainer.n_gpus_per_node=N, with ppo_mini_batch_size
and data.train_batch_size multiples of N (docs/porting.md, "Several ranks"; tested on 2 ranks). PACS's beta,
estimator and class balance are not verl config fields: loss_mode `pacs` is beta 1, RLOO, balanced (the official
run); `register("pacs_beta2", beta=2.0)` in a module of your own, loaded the same way, registers another.
tests/test_verl_pacs.py runs this plugin in verl's own training engine on a CPU, on one data-parallel rank and on
two, and checks its gradients and weights against pacs.py's.
"""
from __future__ import annotations

import os
import sys

import torch
from omegaconf import DictConfig, OmegaConf
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pacs  # noqa: E402  (the loss: pacs.pacs_loss, one source of truth)

# transformers 5.25 kernelizes every from_pretrained by default (USE_HUB_KERNELS unset: on), and kernelize refuses a
# model on the meta device, where verl's FSDP engine builds it on every rank but the first: on two ranks or more
# the workers fail before the first step. Off in this process and the workers it starts, unless the user set it.
os.environ.setdefault("USE_HUB_KERNELS", "0")

ADV_ESTIMATOR = "pacs_label"
ESTIMATORS = ("rloo", "grpo", "drgrpo", "none")
# what the estimator reads from the trainer config beside its own node: the actor's settings (ACTOR_KEYS, which the
# loss also sees), the rollout's group size, and how the trainer orders and dispatches rows (TRAINER_KEYS)
ACTOR_KEYS = ("shuffle", "use_dynamic_bsz", "ppo_micro_batch_size_per_gpu", "ppo_mini_batch_size", "ppo_epochs",
              "use_kl_loss", "entropy_coeff", "rollout_n")
TRAINER_KEYS = {"use_v1": "trainer.use_v1", "balance_batch": "trainer.balance_batch",
                "n_gpus_per_node": "trainer.n_gpus_per_node", "nnodes": "trainer.nnodes",
                "sp": "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
                "fsdp_sp": "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"}


def check_actor_config(config):
    """One-line ValueError for an actor setting (verl's ActorConfig, or a dict of ACTOR_KEYS) that breaks PACS's
    groups or objective."""
    G = config["rollout_n"]
    if G < 2:
        raise ValueError(f"actor_rollout_ref.rollout.n={G}: PACS needs groups of at least 2 samples per prompt")
    if config["shuffle"]:
        raise ValueError("actor_rollout_ref.actor.shuffle=True draws mini-batches sample by sample, splitting "
                         "groups: set it to False")
    if config["use_dynamic_bsz"]:
        raise ValueError("actor_rollout_ref.actor.use_dynamic_bsz=True regroups rows by length, splitting groups: "
                         "set it to False and ppo_micro_batch_size_per_gpu to a multiple of rollout.n")
    micro = config["ppo_micro_batch_size_per_gpu"]
    if not micro or micro % G:
        raise ValueError(f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} is not a multiple of "
                         f"rollout.n={G}: every micro-batch must hold whole groups")
    if config["use_kl_loss"] or config["entropy_coeff"]:
        raise ValueError("PACS has no KL or entropy term: set actor_rollout_ref.actor.use_kl_loss=False and "
                         "entropy_coeff=0")


def labels_from_advantages(advantages, response_mask):
    """R (b,): the label pacs_label put on every response token of a row, read back as the masked mean."""
    mask = response_mask.to(advantages.dtype)  # (b, T)
    R = (advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # (b,)
    if not ((R == 0) | (R == 1)).all():
        raise ValueError("the loss 'pacs' needs algorithm.adv_estimator=pacs_label (advantages that are 0/1 labels)")
    return R


def register(name, beta=1.0, estimator="rloo", balance=True):
    """Register the PACS loss as verl policy loss `name` (actor_rollout_ref.actor.policy_loss.loss_mode=name)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}: use {', '.join(ESTIMATORS)}")

    def pacs_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                         rollout_is_weights=None):
        """(loss, metrics) of one micro-batch of b rows: log_prob, old_log_prob, advantages, response_mask (b, T).
        loss_agg_mode (verl's token aggregation) does not apply: r_hat sums over tokens, the BCE averages over rows."""
        check_actor_config(config)
        if rollout_is_weights is not None:
            raise ValueError("PACS takes no rollout-correction weights: leave algorithm.rollout_correction unset")
        G, b = config.rollout_n, log_prob.shape[0]
        info = config.global_batch_info
        if info.get("global_batch_size") is None:
            raise ValueError("verl gave the loss no global_batch_size (config.global_batch_info): cannot scale it")
        mask = response_mask.to(log_prob.dtype)  # (b, T)
        R = labels_from_advantages(advantages, response_mask)  # (b,)
        loss = pacs.pacs_loss(log_prob, old_log_prob, mask, R, G, beta=beta, estimator=estimator, balance=balance)
        # the engine sums its micro-batches and FSDP averages the ranks: this call's share of the global mean
        loss = loss * (b * info["dp_size"] / info["global_batch_size"])
        with torch.no_grad():
            psi = pacs.pacs_score(log_prob, old_log_prob, mask, G, beta, estimator)  # (b,)
        metrics = {"pacs/psi_mean": psi.mean().item(), "pacs/psi_std": psi.std().item() if b > 1 else 0.0,
                   "pacs/sigma_psi": torch.sigmoid(psi).mean().item(), "pacs/label_mean": R.mean().item()}
        return loss, metrics

    pacs_policy_loss.__name__ = f"pacs_policy_loss_{name}"
    return register_policy_loss(name)(pacs_policy_loss)


def check_trainer_config(settings, prompts):
    """One-line ValueError for a trainer setting (a dict of ACTOR_KEYS and TRAINER_KEYS) that reorders rows or
    splits a group across data-parallel ranks, for a rollout of `prompts` groups. verl's dispatch hands rank r the
    r-th contiguous share of the rollout; each rank cuts its share into mini-batches of ppo_mini_batch_size / ranks
    prompts."""
    dp = settings["n_gpus_per_node"] * settings["nnodes"] // max(settings["sp"], settings["fsdp_sp"])
    if settings["use_v1"] and dp > 1:
        raise ValueError(f"trainer.use_v1=True on {dp} data-parallel ranks: the V1 trainer balances every batch "
                         "across ranks by length, splitting groups: set trainer.use_v1=False and balance_batch=False")
    if not settings["use_v1"] and settings["balance_batch"]:
        raise ValueError("trainer.balance_batch=True reorders rows by length, splitting groups: set it to False")
    if settings["ppo_mini_batch_size"] % dp:
        raise ValueError(f"actor_rollout_ref.actor.ppo_mini_batch_size={settings['ppo_mini_batch_size']} is not a "
                         f"multiple of the {dp} data-parallel ranks: a group would be split across ranks")
    if prompts % dp:
        raise ValueError(f"a rollout of {prompts} prompts on {dp} data-parallel ranks: verl's dispatch would split "
                         "a group across ranks (data.train_batch_size must be a multiple of the ranks)")


def trainer_settings(algorithm_config):
    """ACTOR_KEYS and TRAINER_KEYS, read through the algorithm node's trainer config (the estimator is given only
    its own node); None when that node is not part of a full config (a dataclass, a bare dict)."""
    if not isinstance(algorithm_config, DictConfig):
        return None
    paths = {k: f"actor_rollout_ref.actor.{k}" for k in ACTOR_KEYS if k != "rollout_n"}
    paths["rollout_n"] = "actor_rollout_ref.rollout.n"
    paths.update(TRAINER_KEYS)
    # a node created under `parent` resolves ${...} from the parent's root: the whole trainer config
    view = OmegaConf.create({k: "${oc.select:" + p + ",null}" for k, p in paths.items()}, parent=algorithm_config)
    settings = OmegaConf.to_container(view, resolve=True)
    return None if any(v is None for v in settings.values()) else settings


@register_adv_est(ADV_ESTIMATOR)
def pacs_label_advantage(token_level_rewards, response_mask, index=None, config=None, **kwargs):
    """(advantages, returns), both (B, T): the label R_i in {0, 1} on every response token of row i, for the loss
    `pacs`. Refuses rows whose groups are not adjacent aligned blocks, and settings it can see that break PACS."""
    R = token_level_rewards.sum(-1)  # (B,)
    if not ((R == 0) | (R == 1)).all():
        bad = R[(R != 0) & (R != 1)][:3].tolist()
        raise ValueError(f"PACS needs rewards in {{0, 1}} (a verifier's labels), got {bad}")
    if config is not None and (config.get("rollout_correction") or {}).get("bypass_mode", False):
        raise ValueError("algorithm.rollout_correction.bypass_mode=True makes the rollout engine's log-probs pi_old: "
                         "PACS needs the actor's, recomputed after sampling")
    if index is None:
        raise ValueError("pacs_label needs the uid of each row (verl's `index`) to check the groups")
    settings = trainer_settings(config)
    B, uids = R.shape[0], list(index)
    G = settings["rollout_n"] if settings else uids.count(uids[0])
    blocks = [uids[i:i + G] for i in range(0, B, G)]
    if B % G or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise ValueError(f"the {B} rows are not groups of {G} adjacent rows per prompt (uid): verl reordered them "
                         "(its balancing by length: trainer.balance_batch, or the V1 trainer on several ranks)")
    if settings:
        check_actor_config(settings)
        check_trainer_config(settings, B // G)
        if B // G <= settings["ppo_mini_batch_size"] and settings["ppo_epochs"] == 1:
            raise ValueError(f"one optimizer step per rollout ({B // G} prompts, actor.ppo_mini_batch_size="
                             f"{settings['ppo_mini_batch_size']}): psi = 0 on every step and the critic never acts; "
                             "set ppo_mini_batch_size to a fraction of data.train_batch_size (official: 1/4)")
    advantages = R.to(response_mask.dtype)[:, None] * response_mask  # (B, T)
    return advantages, advantages


register("pacs")
