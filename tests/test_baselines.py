"""The paper's baselines (GRPO and PPO as its scripts ran them in verl) against verl's own formulas.

The references below are verl's functions as the official fork has them (ritzz-ai/PACS,
src/verl/trainer/ppo/core_algos.py: agg_loss, compute_policy_loss, compute_grpo_outcome_advantage,
compute_gae_advantage_return, compute_value_loss; src/verl/utils/torch_functional.py: masked_mean,
masked_var, masked_whiten, clip_by_value), copied with their loops and names and without verl's imports.
pacs.py's functions must give the same values and gradients, float64, to 1e-6, on random masked tensors, in all
four aggregation modes. One difference is by design: verl's seq-mean-token-sum-norm is the token sum over
responses / L, never divided by the number of responses; pacs.py's is the mean over responses (Dr. GRPO's
definition), so pacs.py's value times B is verl's.
"""
import json
import os
from collections import defaultdict

import numpy as np
import pytest
import torch

import pacs

import plumbing
import conftest

MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


# ---------------------------------------------------------------------------------------------------
# verl, copied (torch_functional.py and core_algos.py of the official fork)
# ---------------------------------------------------------------------------------------------------
def verl_masked_mean(values, mask, axis=None):
    return (values * mask).sum(axis=axis) / (mask.sum(axis=axis) + 1e-8)


def verl_masked_var(values, mask, unbiased=True):
    mean = verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def verl_masked_whiten(values, mask, shift_mean=True):
    mean, var = verl_masked_mean(values, mask), verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_clip_by_value(x, tensor_min, tensor_max):
    return torch.max(torch.min(x, tensor_max), tensor_min)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    if loss_agg_mode == "token-mean":
        loss = verl_masked_mean(loss_mat, loss_mask)
    elif loss_agg_mode == "seq-mean-token-sum":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        loss = torch.mean(seq_losses)
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1)
        loss = torch.mean(seq_losses)
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        loss = torch.sum(seq_losses) / loss_mask.shape[-1]
    else:
        raise ValueError(loss_agg_mode)
    return loss


def verl_compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange=None, cliprange_low=None,
                             cliprange_high=None, clip_ratio_c=3.0, loss_agg_mode="token-mean"):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    if cliprange_low is None:
        cliprange_low = cliprange
    if cliprange_high is None:
        cliprange_high = cliprange
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return verl_agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)


def verl_compute_grpo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            id2mean[idx] = torch.mean(torch.tensor(id2score[idx], dtype=scores.dtype))
            id2std[idx] = torch.std(torch.tensor([id2score[idx]], dtype=scores.dtype))
        for i in range(bsz):
            scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
        scores = scores.unsqueeze(-1) * response_mask
    return scores, scores


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    with torch.no_grad():
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]
        for t in reversed(range(gen_len)):
            nextvalues = values[:, t + 1] if t < gen_len - 1 else 0.0
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam = delta + gamma * lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        advantages = verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean"):
    vpredclipped = verl_clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    return verl_agg_loss(loss_mat=clipped_vf_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode)


# ---------------------------------------------------------------------------------------------------
# Random masked batches
# ---------------------------------------------------------------------------------------------------
def random_batch(seed, B=12, T=7, G=4):
    """float64 tensors: a response mask of ragged lengths 1..T (each row keeps its first token), log-probs
    whose ratios spread across both clip edges and the dual clip, rewards in {0, 1} with mixed and one-class groups."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()  # (B, T)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logprobs = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.8  # ratios ~ e^(+-0.8): past 0.8, 1.2, 3
    rewards = (torch.rand(B, generator=g) < 0.5).double()
    rewards[:G] = 1.0  # one all-right group: its advantage is 0
    return logprobs, old, mask, rewards


def value_and_grad(fn, x):
    x = x.clone().requires_grad_()
    out = fn(x)
    (grad,) = torch.autograd.grad(out, x)
    return out.detach(), grad


def assert_same(ours, theirs, scale=1.0):
    """Values and gradients equal to 1e-6 (ours * scale vs theirs)."""
    torch.testing.assert_close(ours[0] * scale, theirs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours[1] * scale, theirs[1], atol=1e-6, rtol=1e-6)


def norm_scale(mode, B):
    return B if mode == "seq-mean-token-sum-norm" else 1.0  # verl never divides that mode by the responses


# ---------------------------------------------------------------------------------------------------
# 1. The five functions equal verl's
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_agg_loss_is_verls(mode, seed):
    _, _, mask, _ = random_batch(seed)
    loss_mat = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    T = mask.shape[1]
    ours = value_and_grad(lambda x: pacs.agg_loss(x, mask, mode, max_len=T), loss_mat)
    theirs = value_and_grad(lambda x: verl_agg_loss(x, mask, mode), loss_mat)
    assert_same(ours, theirs, norm_scale(mode, mask.shape[0]))


def test_seq_mean_token_sum_norm_divides_by_the_constant_not_the_batch_width():
    """verl divides by the mask's width, which in pacs.py is the rollout's longest response (it changes from step
    to step); the Dr. GRPO definition divides by a constant L: --max-new-tokens."""
    loss_mat, mask = torch.ones(2, 3, dtype=torch.float64), torch.tensor([[1.0, 1, 0], [1, 0, 0]], dtype=torch.float64)
    assert pacs.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx((2 + 1) / 2 / 8)
    with pytest.raises(ValueError, match="max_len"):
        pacs.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="unknown loss_agg"):
        pacs.agg_loss(loss_mat, mask, "token-sum")


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_ppo_loss_is_verls_compute_policy_loss(mode, seed):
    logprobs, old, mask, _ = random_batch(seed)
    adv = torch.randn(mask.shape, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64) * 2
    T = mask.shape[1]
    ours = value_and_grad(lambda x: pacs.ppo_loss(x, old, adv, mask, 0.2, 3.0, mode, max_len=T), logprobs)
    theirs = value_and_grad(lambda x: verl_compute_policy_loss(old, x, adv, mask, cliprange=0.2, clip_ratio_c=3.0,
                                                               loss_agg_mode=mode), logprobs)
    assert_same(ours, theirs, norm_scale(mode, mask.shape[0]))
    # the batch reaches every branch: both clip edges and the dual clip on real tokens
    ratio, real = (logprobs - old).exp(), mask.bool()
    assert ((ratio > 1.2) & (adv > 0) & real).any() and ((ratio < 0.8) & (adv < 0) & real).any()
    assert ((ratio > 3.0) & (adv < 0) & real).any()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_grpo_loss_is_verls_grpo_advantage_and_policy_loss(mode, seed):
    G = 4
    logprobs, old, mask, rewards = random_batch(seed, G=G)
    B, T = mask.shape
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(B), mask.sum(1).long() - 1] = rewards  # verl puts the score on the last token
    index = np.repeat(np.arange(B // G), G)  # verl's uid: one per prompt
    adv, _ = verl_compute_grpo_outcome_advantage(token_rewards.clone(), mask, index)
    ours = value_and_grad(lambda x: pacs.grpo_loss(x, old, mask, rewards, G, 0.2, 3.0, mode, max_len=T), logprobs)
    theirs = value_and_grad(lambda x: verl_compute_policy_loss(old, x, adv, mask, cliprange=0.2, clip_ratio_c=3.0,
                                                               loss_agg_mode=mode), logprobs)
    assert_same(ours, theirs, norm_scale(mode, B))
    assert theirs[1][:G].abs().max() == 0 < theirs[1][G:].abs().max()  # the one-class group has no gradient


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (1.0, 0.5)])
@pytest.mark.parametrize("dense", [False, True])
def test_gae_is_verls_compute_gae_advantage_return(gamma, lam, dense):
    _, _, mask, rewards = random_batch(3)
    g = torch.Generator().manual_seed(11)
    values = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask  # V(s_t), 0 past each response
    if dense:  # the general form: a reward on any token
        token_rewards = torch.randn(mask.shape, generator=g, dtype=torch.float64) * mask
    else:  # the outcome reward on the last token, as train_step places it
        token_rewards = torch.zeros_like(mask)
        token_rewards[torch.arange(len(mask)), mask.sum(1).long() - 1] = rewards
    ours = pacs.gae(token_rewards, values, mask, gamma, lam)
    theirs = verl_compute_gae_advantage_return(token_rewards, values, mask, gamma, lam)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ours[1], theirs[1], atol=1e-6, rtol=1e-6)
    real = mask.bool()
    assert abs(ours[0][real].mean().item()) < 1e-9 and ours[0][real].std().item() == pytest.approx(1.0)  # whitened


def test_gae_at_gamma_lambda_one_is_the_outcome_minus_the_value():
    """The paper's setting: with gamma = lam = 1 and R on the last token, A_t = R - V(s_t) before whitening and
    the return of every response token is R (the Monte Carlo return)."""
    _, _, mask, rewards = random_batch(5)
    values = torch.rand(mask.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * mask
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(len(mask)), mask.sum(1).long() - 1] = rewards
    _, returns = pacs.gae(token_rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(returns * mask, rewards[:, None] * mask, atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("mode", MODES)
def test_value_loss_is_verls_compute_value_loss(mode, seed):
    _, _, mask, _ = random_batch(seed)
    g = torch.Generator().manual_seed(seed + 3)
    old_values = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    values = old_values + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.6  # past +-0.5 often
    returns = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    T = mask.shape[1]
    ours = value_and_grad(lambda v: pacs.value_loss(v, old_values, returns, mask, 0.5, mode, max_len=T), values)
    theirs = value_and_grad(lambda v: verl_compute_value_loss(v, returns, old_values, mask, 0.5, mode), values)
    assert_same(ours, theirs, norm_scale(mode, mask.shape[0]))
    clipped = ((values - old_values).abs() > 0.5) & mask.bool()
    assert clipped.any() and (~clipped & mask.bool()).any()


def test_dual_clip_caps_the_loss_of_a_negative_advantage():
    """A token with A < 0 and ratio 5: PPO-clip alone would charge -A * 5; the dual clip caps it at -A * 3
    and its gradient is 0. With clip_c = 0 the cap is off."""
    old, mask, adv = (torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64),
                      torch.tensor([[-1.0]]))
    lp = torch.tensor([[np.log(5.0)]], dtype=torch.float64)
    capped = value_and_grad(lambda x: pacs.ppo_loss(x, old, adv.double(), mask, 0.2, 3.0), lp)
    free = value_and_grad(lambda x: pacs.ppo_loss(x, old, adv.double(), mask, 0.2, 0.0), lp)
    assert capped[0].item() == pytest.approx(3.0) and capped[1].item() == 0.0
    assert free[0].item() == pytest.approx(5.0) and free[1].item() == pytest.approx(5.0)


def test_official_settings_per_algo_and_flags_that_override_them():
    for algo, agg, clip in (("grpo", "seq-mean-token-sum-norm", 1.0), ("ppo", "seq-mean-token-sum-norm", 1.0),
                            ("pacs", None, 0.0), ("reinforce", "token-mean", 0.0)):
        cfg = pacs.parse_args(["--algo", algo])
        assert (cfg.loss_agg, cfg.max_grad_norm, cfg.clip_eps, cfg.clip_c) == (agg, clip, 0.2, 3.0), algo
    cfg = pacs.parse_args(["--algo", "ppo"])
    assert (cfg.critic_lr, cfg.value_clip, cfg.gamma, cfg.lam) == (1e-5, 0.5, 1.0, 1.0)
    cfg = pacs.parse_args(["--algo", "grpo", "--loss-agg", "token-mean", "--max-grad-norm", "0", "--clip-c", "0"])
    assert (cfg.loss_agg, cfg.max_grad_norm, cfg.clip_c) == ("token-mean", 0.0, 0.0)


# ---------------------------------------------------------------------------------------------------
# 2. In train_step: micro-batches, the critic's step, checkpoints and resume
# ---------------------------------------------------------------------------------------------------
def mini_batch_grads(model_dir, roll, rewards, algo, mode, micro_batch_size):
    """.grad of every actor parameter after accumulate_mini_batch on the whole digit_rollout, with pi_old moved off the
    current weights (ratios != 1) and, for PPO, fixed random advantages."""
    model, _ = plumbing.load_model(model_dir)
    model.train()
    cfg = pacs.Config(group_size=4, prompts_per_step=2, num_mini_batches=1, micro_batch_size=micro_batch_size,
                      algo=algo, loss_agg=mode, max_new_tokens=6, temperature=0.9)
    mask = roll["response_mask"].float()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        old = pacs.response_logprobs(model, roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"],
                                     roll["response_mask"], 0.9)[0]
    old = old + 0.3 * torch.randn(mask.shape, generator=g) * mask
    adv = torch.randn(mask.shape, generator=g) if algo == "ppo" else None
    pacs.accumulate_mini_batch(cfg, model, roll, old, mask, rewards, slice(0, 8), False, torch.device("cpu"), adv)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_mini_batch_gradient_does_not_depend_on_the_micro_batch_size(digit_model, digit_rollout, algo, mode):
    roll, rewards = digit_rollout
    whole = mini_batch_grads(digit_model, roll, rewards, algo, mode, 8)
    assert sum(g.norm() for g in whole) > 0
    for mb in (4, 2, 1):  # whole groups, and a group split in 2 and in 4
        for a, b in zip(whole, mini_batch_grads(digit_model, roll, rewards, algo, mode, mb)):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def critic_grads(model_dir, roll, mode, micro_batch_size):
    cfg = pacs.Config(group_size=4, prompts_per_step=2, num_mini_batches=1, micro_batch_size=micro_batch_size,
                      algo="ppo", loss_agg=mode, max_new_tokens=6)
    critic = plumbing.load_value_model(cfg, model_dir, torch.device("cpu")).train()
    mask = roll["response_mask"].float()
    g = torch.Generator().manual_seed(1)
    old_values = (torch.randn(mask.shape, generator=g) * 0.5) * mask
    returns = torch.randn(mask.shape, generator=g) * mask
    loss, clipped = pacs.accumulate_critic(cfg, critic, roll, old_values, returns, mask, slice(0, 8),
                                           torch.device("cpu"))
    return [p.grad.clone() for p in critic.parameters()], loss, clipped


@pytest.mark.parametrize("mode", MODES)
def test_critic_gradient_does_not_depend_on_the_micro_batch_size(digit_model, digit_rollout, mode):
    roll, _ = digit_rollout
    whole, loss, clipped = critic_grads(digit_model, roll, mode, 8)
    assert clipped > 0 and sum(g.norm() for g in whole) > 0
    for mb in (4, 2, 1):
        grads, loss_mb, clipped_mb = critic_grads(digit_model, roll, mode, mb)
        assert loss_mb.item() == pytest.approx(loss.item(), rel=1e-5) and clipped_mb == clipped
        for a, b in zip(whole, grads):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-6)


def test_the_value_model_is_verls_and_reads_the_state_before_each_token(digit_model, digit_rollout):
    """AutoModelForTokenClassification with one label; V(s_t) is its head on the hidden state at the position
    before response token t, 0 past the response, the same on the shared-prompt and the full-row routes."""
    roll, _ = digit_rollout
    cfg = pacs.Config(group_size=4, algo="ppo")
    critic = plumbing.load_value_model(cfg, digit_model, torch.device("cpu"))
    assert type(critic).__name__ == "Qwen2ForTokenClassification" and critic.config.num_labels == 1
    rows = slice(0, 4)
    shared = pacs.response_values(critic, *plumbing.rollout_rows(roll, rows), group_size=4)
    full = pacs.response_values(critic, *plumbing.rollout_rows(roll, rows), group_size=4, shared_prompt=False)
    torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
    # by hand: one plain forward over prompt + response, the score head's output at position Lp - 1 + t
    ids = torch.cat([roll["prompt_ids"][rows], roll["response_ids"][rows]], 1)
    attn = torch.cat([roll["prompt_mask"][rows], roll["response_mask"][rows]], 1)
    with torch.no_grad():
        logits = critic(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(1) - 1).clamp(min=0)).logits
    Lp, T = roll["prompt_ids"].shape[1], roll["response_ids"].shape[1]
    by_hand = logits[:, Lp - 1:Lp - 1 + T, 0] * roll["response_mask"][rows]
    torch.testing.assert_close(full, by_hand, atol=1e-5, rtol=1e-5)
    assert (full[roll["response_mask"][rows] == 0] == 0).all()


def test_the_value_models_head_does_not_move_the_sampling_rng(digit_model):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    plumbing.load_value_model(pacs.Config(algo="ppo", seed=5), digit_model, torch.device("cpu"))
    assert torch.equal(torch.rand(3), expected)  # step 0 samples what every other --algo samples
    a = plumbing.load_value_model(pacs.Config(algo="ppo", seed=5), digit_model, torch.device("cpu"))
    b = plumbing.load_value_model(pacs.Config(algo="ppo", seed=5), digit_model, torch.device("cpu"))
    assert torch.equal(a.score.weight, b.score.weight)  # and the head is a function of --seed


def mixed_rewards(texts, answers):
    return torch.tensor([float(i % 2) for i in range(len(texts))])


def run(model, out_dir, *extra):
    argv = ["--model", model, "--dataset", "synthetic", "--out-dir", str(out_dir), "--group-size", "4",
            "--prompts-per-step", "4", "--num-mini-batches", "2", "--max-new-tokens", "4", "--lr", "1e-2",
            "--critic-lr", "1e-2", "--weight-decay", "0", "--eval-every", "0", "--log-samples-every", "0",
            "--temperature", "1.5", "--algo", "ppo", *extra]
    pacs.main(argv)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_one_ppo_step_moves_both_models_and_logs_the_critic(digit_model, tmp_path, monkeypatch):
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(mixed_rewards))
    rows = run(digit_model, tmp_path, "--steps", "1")
    ckpt = plumbing.latest_checkpoint(str(tmp_path))
    cfg = pacs.parse_args(["--algo", "ppo"])
    before_actor, _ = plumbing.load_model(digit_model)
    before_critic = plumbing.load_value_model(cfg, digit_model, torch.device("cpu"))
    after_actor, _ = plumbing.load_model(ckpt)
    after_critic = plumbing.load_value_model(cfg, os.path.join(ckpt, "critic"), torch.device("cpu"))
    for before, after in ((before_actor, after_actor), (before_critic, after_critic)):
        moved = {n for n, p in after.named_parameters() if not torch.equal(p, dict(before.named_parameters())[n])}
        assert moved, type(before).__name__
    assert not torch.equal(before_critic.score.weight, after_critic.score.weight)  # the head learnt
    # the decoder the critic starts from is the policy's
    assert torch.equal(before_critic.model.layers[0].mlp.up_proj.weight,
                       before_actor.model.layers[0].mlp.up_proj.weight)
    r = rows[0]
    for key in ("value_loss", "value_clip_frac", "explained_var", "critic_grad_norm", "value_first_mae"):
        assert r[key] is not None, key
    assert r["critic_pairs"] > 0 and 0 <= r["critic_auc"] <= 1 and r["psi_std"] is None


def test_a_killed_ppo_run_resumes_to_the_uninterrupted_one(digit_model, tmp_path, monkeypatch):
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(mixed_rewards))
    timing = {"time_generate", "time_verify", "time_old_logprobs", "time_update", "time_eval", "time_save",
              "step_time", "samples_per_s"}
    strip = lambda rows: [{k: v for k, v in r.items() if k not in timing} for r in rows]
    full = run(digit_model, tmp_path / "full", "--steps", "4", "--save-every", "2")
    run(digit_model, tmp_path / "part", "--steps", "2", "--save-every", "2")  # killed after step 1's checkpoint
    resumed = run(digit_model, tmp_path / "part", "--steps", "4", "--save-every", "2", "--resume")
    assert strip(resumed) == strip(full)
    assert full[-1]["value_loss"] != full[0]["value_loss"]  # the critic (and its AdamW) carried over
    a = plumbing.load_value_model(pacs.Config(algo="ppo"),
                              os.path.join(plumbing.latest_checkpoint(str(tmp_path / "full")), "critic"),
                              torch.device("cpu"))
    b = plumbing.load_value_model(pacs.Config(algo="ppo"),
                              os.path.join(plumbing.latest_checkpoint(str(tmp_path / "part")), "critic"),
                              torch.device("cpu"))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_ppo_out_of_memory_in_the_critic_halves_the_micro_batch_and_redoes_it_from_clean_gradients(
        digit_model, tmp_path, monkeypatch, capsys):
    """The critic's OOM strikes after its first micro-batch has already run backward: the retried mini-batch
    must start from zero gradients, so the run equals one that used the smaller size from the start."""
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(mixed_rewards))
    reference = run(digit_model, tmp_path / "ref", "--steps", "2", "--micro-batch-size", "2")
    real, calls = pacs.response_values, {"n": 0}

    def small_memory(critic, prompt_ids, *a, **k):  # the second grad-enabled critic forward of 4 rows fails
        if torch.is_grad_enabled() and prompt_ids.shape[0] == 4:
            calls["n"] += 1
            if calls["n"] == 2:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(critic, prompt_ids, *a, **k)

    monkeypatch.setattr(pacs, "response_values", small_memory)
    rows = run(digit_model, tmp_path / "oom", "--steps", "2", "--micro-batch-size", "4")
    assert "critic mini-batch 0: --micro-batch-size 4 -> 2" in capsys.readouterr().out
    # Equal up to float noise: step 0's old log-probs and value targets ran at 4 rows a forward here, at 2 in the
    # reference, and a matmul of other shape sums in another order (1.1e-5 apart under ATEN_CPU_CAPABILITY=default);
    # gradients left over from the failed micro-batch would count it twice (far above 1e-4)
    for r, ref in zip(rows, reference):  # (the actor's loss sums advantages of both signs: compared by its grad norm)
        assert r["micro_batch_size"] == 2
        for key in ("value_loss", "critic_grad_norm", "grad_norm"):
            assert r[key] == pytest.approx(ref[key], rel=1e-4), key


def test_ppo_puts_the_outcome_reward_on_each_responses_last_token(digit_model, digit_rollout, tmp_path, monkeypatch):
    # verl's placement, before GAE: R_i on the last real token of response i, for a response stopped by EOS and
    # for one cut at --max-new-tokens alike. At gamma = lam = 1 the return is then R_i at every token of the
    # response (the TD errors telescope to R_i - V(s_t)); R on any other token changes the returns after it.
    roll, rewards = digit_rollout
    lengths = roll["response_mask"].sum(1).long()  # (B,)
    T = roll["response_ids"].shape[1]
    assert (lengths < T).any() and roll["truncated"].any()  # both kinds of ending are in the rollout
    monkeypatch.setattr(pacs, "sample", lambda *a, **k: {key: v.clone() for key, v in roll.items()})
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(lambda texts, answers: rewards.clone()))
    seen, real_gae = {}, pacs.gae

    def spy(token_rewards, values, mask, gamma, lam):
        seen.update(token_rewards=token_rewards.clone(), mask=mask.clone(), gamma=gamma, lam=lam)
        advantages, returns = real_gae(token_rewards, values, mask, gamma, lam)
        seen["returns"] = returns.clone()
        return advantages, returns

    monkeypatch.setattr(pacs, "gae", spy)
    run(digit_model, tmp_path, "--steps", "1", "--prompts-per-step", "2", "--max-new-tokens", str(T))
    assert (seen["gamma"], seen["lam"]) == (1.0, 1.0)
    expected_rewards = torch.zeros(len(rewards), T)
    for i, n in enumerate(lengths.tolist()):
        expected_rewards[i, n - 1] = rewards[i]
    assert torch.equal(seen["token_rewards"], expected_rewards)
    real = seen["mask"].bool()
    assert torch.allclose(seen["returns"][real], rewards[:, None].expand(-1, T)[real], atol=1e-6)


@pytest.mark.parametrize("algo, norm, applied_norm", [("grpo", 10.0, 1.0),   # above the bound: clipped to it
                                                      ("ppo", 10.0, 1.0),
                                                      ("grpo", 0.5, 0.5),    # below it: untouched
                                                      ("pacs", 10.0, 10.0)])  # PACS's default: no clipping
def test_the_applied_update_is_the_clipped_gradient_when_its_norm_is_above_max_grad_norm(algo, norm, applied_norm):
    # the official scripts: max_grad_norm 1.0 for GRPO and PPO, none for PACS. With SGD at lr 1 the applied
    # update is minus the gradient optimizer_update hands to the optimizer.
    cfg = pacs.Config(algo=algo)
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    direction = [torch.randn_like(p) for p in layer.parameters()]
    scale = norm / torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in direction]))
    before = [p.detach().clone() for p in layer.parameters()]
    backward = lambda: sum((p * d * scale).sum() for p, d in zip(layer.parameters(), direction)).backward()
    for attempt in plumbing.shrinking(cfg, plumbing.Sizes.typed(cfg), "test", layer):
        with attempt:
            backward()
    grad_norm, applied = pacs.optimizer_update(cfg, layer, torch.optim.SGD(layer.parameters(), lr=1.0), "test")
    assert applied and grad_norm == pytest.approx(norm, rel=1e-5)  # the norm before clipping is what is logged
    for b, p, d in zip(before, layer.parameters(), direction):
        torch.testing.assert_close(b - p.detach(), d * scale * applied_norm / norm, rtol=1e-5, atol=1e-6)
