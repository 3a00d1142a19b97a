"""The implicit critic made visible: what sigma(psi) knows (AUC within groups), how far it moves off 1/2, how much of
the update it rewrites, PPO's value model scored the same way, and PACS with the critic switched off
(--no-implicit-critic: 1/2 in place of sigma(psi) in the gradient)."""
import itertools
import json
import math
import random

import pytest
import torch

import pacs

import plumbing
from conftest import make_tiny_model_dir
from critic_probe import rollout_updates  # experiments/, on the path by conftest
import conftest


# ---------------------------------------------------------------------------------------------------
# 1. The metrics against brute force and hand computation
# ---------------------------------------------------------------------------------------------------
def brute_force_auc(scores, rewards, G):
    """Every (right, wrong) pair inside every group, one by one: 1 if the right one scores higher, 1/2 on a tie."""
    won = pairs = 0
    for g in range(len(scores) // G):
        idx = range(g * G, (g + 1) * G)
        for i, j in itertools.product(idx, idx):
            if rewards[i] == 1 and rewards[j] == 0:
                pairs += 1
                won += 1.0 if scores[i] > scores[j] else 0.5 if scores[i] == scores[j] else 0.0
    return won, pairs


@pytest.mark.parametrize("seed", range(20))
def test_group_auc_counts_every_right_wrong_pair_within_groups(seed):
    rng = random.Random(seed)
    G = rng.choice([2, 4, 8])
    B = G * rng.randint(1, 5)
    rewards = [float(rng.random() < 0.5) for _ in range(B)]
    scores = [float(rng.randint(-2, 2)) for _ in range(B)]  # small integers: ties happen
    won, pairs = pacs.group_auc(torch.tensor(scores), torch.tensor(rewards), G)
    assert (won.item(), pairs.item()) == brute_force_auc(scores, rewards, G)


def test_group_auc_never_compares_across_groups():
    # group 0 scores its right response above its wrong one; group 1's wrong response outscores everything:
    # within groups the ranking is perfect, so the AUC is 1
    won, pairs = pacs.group_auc(torch.tensor([1.0, 0.0, 9.0, 10.0]), torch.tensor([1.0, 0, 0, 1]), 2)
    assert (won.item(), pairs.item()) == (2.0, 2)
    assert pacs.group_auc(torch.tensor([0.3, 0.1]), torch.tensor([1.0, 1.0]), 2)[1] == 0  # one class: no pair


def hand_adv_change(psi, rewards, G, balance):
    """|A - A0|^2 and |A0|^2 with A_k = y_k - mean_group(y), y_k = w_k (R_k - sigma(psi_k)), A0 at sigma = 1/2."""
    diff2 = base2 = 0.0
    for g in range(len(psi) // G):
        R = rewards[g * G:(g + 1) * G]
        k = sum(R)
        w = [(G / (2 * k) if r else G / (2 * (G - k))) if balance and 0 < k < G else 1.0 for r in R]
        y = [w[i] * (R[i] - 1 / (1 + math.exp(-psi[g * G + i]))) for i in range(G)]
        y0 = [w[i] * (R[i] - 0.5) for i in range(G)]
        A = [v - sum(y) / G for v in y]
        A0 = [v - sum(y0) / G for v in y0]
        diff2 += sum((a - a0) ** 2 for a, a0 in zip(A, A0))
        base2 += sum(a0 ** 2 for a0 in A0)
    return diff2, base2


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("seed", range(5))
def test_critic_change_is_the_share_of_the_advantage_the_critic_rewrote(seed, balance):
    rng = random.Random(seed)
    G, B = 4, 16
    psi = [rng.gauss(0, 1) for _ in range(B)]
    rewards = [float(rng.random() < 0.5) for _ in range(B)]
    diff2, base2 = pacs.critic_change(torch.tensor(psi, dtype=torch.float64),
                                      torch.tensor(rewards, dtype=torch.float64), G, balance)
    want = hand_adv_change(psi, rewards, G, balance)
    assert diff2.item() == pytest.approx(want[0], rel=1e-12) and base2.item() == pytest.approx(want[1], rel=1e-12)
    metrics = pacs.implicit_critic_metrics(torch.tensor(psi, dtype=torch.float64),
                                           torch.tensor(rewards, dtype=torch.float64), G, balance)
    assert metrics["critic_adv_change"] == pytest.approx(math.sqrt(want[0] / want[1]), rel=1e-12)
    assert metrics["critic_shift"] == pytest.approx(sum(abs(1 / (1 + math.exp(-p)) - 0.5) for p in psi) / B, rel=1e-12)
    won, pairs = brute_force_auc(psi, rewards, G)
    assert metrics["critic_auc"] == pytest.approx(won / pairs) and metrics["critic_pairs"] == pairs


def test_where_the_critic_does_not_act_its_metrics_are_none_or_zero():
    none = pacs.implicit_critic_metrics(torch.zeros(0), torch.zeros(0), 4, True)  # M = 1
    assert none == {"critic_auc": None, "critic_pairs": 0, "critic_shift": None, "critic_adv_change": None,
                    "critic_calibration": None}
    at_zero = pacs.implicit_critic_metrics(torch.zeros(8), torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1]), 4, True)
    assert at_zero["critic_auc"] == 0.5 and at_zero["critic_shift"] == 0 and at_zero["critic_adv_change"] == 0


def test_calibration_counts_bin_sigma_psi_and_count_the_right_responses():
    """Each response lands in the CALIBRATION_EDGES bin of its sigma(psi) (sigma exactly 1/2 in [0.5, 0.51)); per bin:
    how many, their summed sigma(psi), how many were right. Against a loop over the responses."""
    torch.manual_seed(0)
    psi = torch.cat([torch.randn(200) * 0.1, torch.randn(50) * 2, torch.zeros(6), torch.tensor([-30.0, 30.0])])  # (B,)
    rewards = (torch.rand(len(psi)) < 0.6).float()  # (B,)
    c = pacs.calibration_counts(psi, rewards)
    edges, k = pacs.CALIBRATION_EDGES, len(pacs.CALIBRATION_EDGES) - 1
    n, sigma, right = [0] * k, [0.0] * k, [0] * k
    for p, r in zip(torch.sigmoid(psi).tolist(), rewards.tolist()):
        b = next(i for i in range(k) if edges[i] <= p < edges[i + 1] or i == k - 1)
        n[b], sigma[b], right[b] = n[b] + 1, sigma[b] + p, right[b] + int(r)
    assert c["n"] == n and c["right"] == right and c["sigma"] == pytest.approx(sigma, abs=1e-5)
    assert sum(c["n"]) == len(psi) and c["n"][edges.index(0.5)] >= 6 and c["n"][0] >= 1 and c["n"][-1] >= 1
    assert list(edges) == sorted(edges) and all(abs(a + b - 1) < 1e-12 for a, b in zip(edges, edges[::-1]))


def test_value_model_metrics_by_hand():
    """V at each response's last token ranks the pairs; explained variance over the real tokens; V(s_0), one per
    prompt, against the group's success rate."""
    G = 2
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]])
    values = torch.tensor([[0.2, 0.9, 0], [0.2, 0, 0], [0.6, 0.1, 0.3], [0.6, 0.7, 0]])
    rewards = torch.tensor([1.0, 0, 0, 1])
    returns = rewards[:, None] * mask
    updates = [((torch.tensor(0.5), torch.tensor(2.0)), 1.5, True),
               ((torch.tensor(0.3), torch.tensor(1.0)), 2.5, False)]
    m = pacs.value_model_metrics(values, returns, mask, rewards, G, slice(0, 4), updates)
    # last-token values: row 0 0.9 (right) > row 1 0.2 (wrong); row 3 0.7 (right) > row 2 0.3 (wrong)
    assert m["critic_auc"] == 1.0 and m["critic_pairs"] == 2
    real = mask.bool()
    ev = 1 - (returns - values)[real].var() / (returns[real].var() + 1e-5)
    assert m["explained_var"] == pytest.approx(ev.item())
    assert m["value_first_mae"] == pytest.approx((abs(0.2 - 0.5) + abs(0.6 - 0.5)) / 2)
    assert m["value_first_corr"] is None  # two prompts with the same success rate: no correlation to speak of
    assert (m["value_loss"], m["value_clip_frac"], m["critic_grad_norm"], m["critic_skipped"]) == \
        (pytest.approx(0.4), pytest.approx(3 / 8), 2.0, 1)  # 3 clipped of 8 tokens


# ---------------------------------------------------------------------------------------------------
# 2. PACS with the critic switched off
# ---------------------------------------------------------------------------------------------------
def random_batch(seed, dtype, B=12, G=4, T=5, moved=True):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).to(dtype)
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    lp = old + torch.randn(B, T, generator=g, dtype=dtype) * 0.3 if moved else old.clone()
    rewards = (torch.rand(B, generator=g) < 0.5).to(dtype)
    return lp, old, mask, rewards


def loss_and_grad(lp, old, mask, rewards, G, **kw):
    lp = lp.clone().requires_grad_()
    loss = pacs.pacs_loss(lp, old, mask, rewards, G, **kw)
    return loss.detach(), torch.autograd.grad(loss, lp)[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_critic_off_equals_pacs_bit_for_bit_where_psi_is_zero(seed, balance, dtype):
    lp, old, mask, rewards = random_batch(seed, dtype, moved=False)  # pi_theta == pi_old: mini-batch 0
    on = loss_and_grad(lp, old, mask, rewards, 4, balance=balance)
    off = loss_and_grad(lp, old, mask, rewards, 4, balance=balance, implicit_critic=False)
    assert torch.equal(on[0], off[0]) and torch.equal(on[1], off[1])
    assert on[1].abs().max() > 0


@pytest.mark.parametrize("beta", [1.0, 2.0])
@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_critic_off_differs_from_pacs_by_exactly_the_critic_term(seed, balance, beta):
    """dL/dlogprobs[k,t] (PACS) - dL/dlogprobs[k,t] (critic off) = beta G/(B(G-1)) (d_k - mean_group(d)) mask[k,t]
    with d_k = w_k (sigma(psi_k) - 1/2): the derivation above pacs_score."""
    G, dtype = 4, torch.float64
    lp, old, mask, rewards = random_batch(seed, dtype)
    B = len(rewards)
    on = loss_and_grad(lp, old, mask, rewards, G, beta=beta, balance=balance)
    off = loss_and_grad(lp, old, mask, rewards, G, beta=beta, balance=balance, implicit_critic=False)
    psi = pacs.pacs_score(lp, old, mask, G, beta)
    w = pacs.class_balance_weights(rewards, G) if balance else torch.ones(B, dtype=dtype)
    d = (w * (torch.sigmoid(psi) - 0.5)).view(-1, G)
    critic_term = beta * G / (B * (G - 1)) * (d - d.mean(-1, keepdim=True)).reshape(-1, 1) * mask
    torch.testing.assert_close(on[1] - off[1], critic_term, atol=1e-13, rtol=0)
    assert critic_term.abs().max() > 1e-3  # the critic was on: a real difference was compared
    # and critic off is PACS's mini-batch-0 advantage on every mini-batch: A_k = w_k (R_k - 1/2) - mean
    y0 = (w * (rewards - 0.5)).view(-1, G)
    A0 = (y0 - y0.mean(-1, keepdim=True)).reshape(-1, 1)
    torch.testing.assert_close(-off[1], beta * G / (B * (G - 1)) * A0 * mask, atol=1e-13, rtol=0)


def test_critic_off_in_train_step_gives_mini_batch_0_pacs_gradient_exactly(tmp_path):
    """accumulate_mini_batch on a real model: on mini-batch 0 (first=True) the two flags give the same .grad bit
    for bit; on a later mini-batch (pi_old off the current weights) they differ."""
    model_dir = make_tiny_model_dir(tmp_path / "m", chars="0123456789 +?=")
    model, tok = plumbing.load_model(model_dir)
    torch.manual_seed(0)
    roll = pacs.sample(model, tok, [plumbing.build_prompt(tok, "1 + 6 ="), plumbing.build_prompt(tok, "2 + 2 =")],
                       group_size=4, max_new_tokens=5)
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    mask = roll["response_mask"].float()

    def grads(critic_on, first):
        model, _ = plumbing.load_model(model_dir)
        model.train()
        cfg = pacs.Config(group_size=4, prompts_per_step=2, num_mini_batches=1, micro_batch_size=8,
                          implicit_critic=critic_on)
        old = torch.zeros_like(mask)
        if not first:
            with torch.no_grad():
                old = pacs.step_logprobs(cfg, model, roll, slice(0, 8))[0] + 0.1 * mask
        pacs.accumulate_mini_batch(cfg, model, roll, old, mask, rewards, slice(0, 8), first, torch.device("cpu"))
        return [p.grad.clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(True, True), grads(False, True)))
    assert not all(torch.equal(a, b) for a, b in zip(grads(True, False), grads(False, False)))


# ---------------------------------------------------------------------------------------------------
# 3. Logged by pacs.py
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("critic", [[], ["--no-implicit-critic"]])
def test_a_pacs_run_logs_the_critic_metrics_on_the_later_mini_batches(tmp_path, monkeypatch, capsys, critic):
    model_dir = make_tiny_model_dir(tmp_path / "m", chars="0123456789 +?=")
    mixed = conftest.reward_stand_in(lambda texts, answers: torch.arange(len(texts)) % 2.0)
    monkeypatch.setattr(pacs, "reward_fn", mixed)
    pacs.main(["--model", model_dir, "--dataset", "synthetic", "--out-dir", str(tmp_path / "run"), "--group-size", "4",
               "--prompts-per-step", "4", "--num-mini-batches", "2", "--max-new-tokens", "4", "--lr", "1e-2",
               "--steps", "2", "--eval-every", "0", "--log-samples-every", "0", "--temperature", "1.5", *critic])
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for r in rows:
        assert r["critic_pairs"] == 8 and 0 <= r["critic_auc"] <= 1  # 2 mixed groups x 2 x 2 pairs in mini-batch 1
        assert 0 < r["critic_shift"] < 0.5 and r["critic_adv_change"] > 0
        assert sum(r["critic_calibration"]["n"]) == 8 and sum(r["critic_calibration"]["right"]) == 4  # mini-batch 1
    assert "critic auc" in capsys.readouterr().out
    pacs.main(["--model", model_dir, "--dataset", "synthetic", "--out-dir", str(tmp_path / "m1"), "--group-size", "4",
               "--prompts-per-step", "4", "--num-mini-batches", "1", "--max-new-tokens", "4", "--steps", "1",
               "--eval-every", "0", "--log-samples-every", "0", *critic])
    (row,) = [json.loads(line) for line in open(tmp_path / "m1" / "metrics.jsonl")]
    assert row["critic_auc"] is None and row["psi_std"] == 0.0  # M = 1: the critic never acts


def test_no_implicit_critic_is_a_pacs_flag():
    with pytest.raises(plumbing.ConfigError, match="--no-implicit-critic"):
        plumbing.check_config(pacs.parse_args(["--algo", "grpo", "--no-implicit-critic"]))


# ---------------------------------------------------------------------------------------------------
# 4. For the reader (docs/pacs.ipynb): the derivation's advantage, and the critic on one rollout's mini-batches
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("critic", [True, False])
@pytest.mark.parametrize("beta", [0.5, 2.0])
@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("seed", range(3))
def test_pacs_advantage_is_the_loss_gradient_of_the_derivation(seed, balance, beta, critic):
    """-dL/dlogprobs[k,t] = beta G/(B(G-1)) A_k mask[k,t] for the loss with and without its critic, and A, A0 are
    the advantages whose distance critic_change measures."""
    G = 4
    lp, old, mask, rewards = random_batch(seed, torch.float64)
    B = len(rewards)
    _, grad = loss_and_grad(lp, old, mask, rewards, G, beta=beta, balance=balance, implicit_critic=critic)
    psi = pacs.pacs_score(lp, old, mask, G, beta)
    A = pacs.pacs_advantage(psi, rewards, G, balance, implicit_critic=critic)
    assert A.shape == (B,) and A.dtype == torch.float64
    torch.testing.assert_close(-grad, beta * G / (B * (G - 1)) * A[:, None] * mask, atol=1e-13, rtol=0)
    assert A.abs().max() > 1e-2  # a real gradient was compared
    A_on, A_off = pacs.pacs_advantage(psi, rewards, G, balance), pacs.pacs_advantage(psi, rewards, G, balance, False)
    diff2, base2 = pacs.critic_change(psi, rewards, G, balance)
    torch.testing.assert_close(((A_on - A_off) ** 2).sum(), diff2)
    torch.testing.assert_close((A_off ** 2).sum(), base2)


def test_rollout_updates_are_train_steps_phases_3_and_4(tmp_path, monkeypatch):
    """rollout_updates on the rollout train_step samples (the same prompts, the same seed) gives the psi and losses
    train_step logs and leaves the same weights, bit for bit; psi is 0 on mini-batch 0 only."""
    model_dir = make_tiny_model_dir(tmp_path / "m", chars="0123456789 +?=")
    monkeypatch.setattr(pacs, "reward_fn",
                        conftest.reward_stand_in(lambda texts, answers: torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0] * 4)))
    problems = [{"problem": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)]
    cfg = pacs.Config(group_size=4, prompts_per_step=8, num_mini_batches=4, max_new_tokens=5, micro_batch_size=8,
                      lr=1e-2, seed=3)
    device = torch.device("cpu")

    model, tok = plumbing.load_model(model_dir)
    torch.manual_seed(0)
    metrics, _ = pacs.train_step(cfg, model, tok, pacs.make_optimizer(cfg, model), problems, 1, device)

    again, tok = plumbing.load_model(model_dir)
    batch = [problems[i] for i in plumbing.batch_indices(1, len(problems), cfg.prompts_per_step, cfg.seed)]
    torch.manual_seed(0)
    roll = pacs.sample(again, tok, [plumbing.build_prompt(tok, p["problem"]) for p in batch], cfg.group_size,
                       cfg.max_new_tokens, batch_prompts=cfg.gen_batch_prompts)
    rewards = pacs.reward_fn(None, None)
    updates = rollout_updates(cfg, again, pacs.make_optimizer(cfg, again), roll, rewards, device)

    assert len(updates) == cfg.num_mini_batches and all(psi.shape == (8,) for psi, _ in updates)
    psi = torch.cat([p for p, _ in updates])
    assert torch.equal(updates[0][0], torch.zeros(8)) and updates[0][1] == pytest.approx(math.log(2))
    assert all(p.abs().max() > 0 for p, _ in updates[1:])  # the critic reads the earlier updates
    assert (psi.mean().item(), psi.std().item()) == (metrics["psi_mean"], metrics["psi_std"])
    assert sum(loss for _, loss in updates) / len(updates) == pytest.approx(metrics["loss"], abs=1e-7)
    won, pairs = pacs.group_auc(psi[8:], rewards[8:], cfg.group_size)
    assert (won / pairs).item() == metrics["critic_auc"]
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert not again.training
