"""Tests for the PACS loss (pacs_score, class_balance_weights, pacs_loss) and the grpo / reinforce baselines.

The reference below is written from the spec alone, in plain Python floats (math.log / math.exp, explicit
loops, class weights by counting), independent of the code under test. Its gradient is taken by central
finite differences in float64; for RLOO it is also checked against the closed form of the derivation.
"""
import ast
import inspect
import math
import random
import re
import textwrap
import zlib

import pytest
import torch
import torch.nn.functional as F

import pacs
from pacs import class_balance_weights, grpo_loss, pacs_loss, pacs_score, reinforce_loss

ESTIMATORS = ["rloo", "grpo", "drgrpo", "none"]
SHAPES = [(6, 2, 3), (9, 3, 4), (12, 4, 5), (10, 5, 2)]  # (B, G, T); every shape has >= 2 groups


# ---------------------------------------------------------------------------------------------------
# Independent reference, plain Python
# ---------------------------------------------------------------------------------------------------
def ref_reward_proxy(lp, old, mask, beta):
    """r_hat_i = beta * sum_t mask * (lp - old): a plain sum over response tokens, no length normalisation."""
    r = []
    for i in range(len(lp)):
        s = 0.0
        for t in range(len(lp[i])):
            if mask[i][t]:
                s += lp[i][t] - old[i][t]
        r.append(beta * s)
    return r


def ref_scores(r_hat, G, estimator):
    psi = []
    for g in range(len(r_hat) // G):
        r = r_hat[g * G:(g + 1) * G]
        mean = sum(r) / G
        for i in range(G):
            if estimator == "rloo":
                others = sum(r[j] for j in range(G) if j != i)
                psi.append(r[i] - others / (G - 1))
            elif estimator == "grpo":
                std = math.sqrt(sum((x - mean) ** 2 for x in r) / (G - 1))  # unbiased
                psi.append((r[i] - mean) / (std + 1e-6))
            elif estimator == "drgrpo":
                psi.append(r[i] - mean)
            elif estimator == "none":
                psi.append(r[i])
            else:
                raise AssertionError(estimator)
    return psi


def ref_weights(rewards, G):
    """Count the correct samples k of each group: G/(2k) on correct, G/(2(G-k)) on wrong, 1 if one class."""
    w = []
    for g in range(len(rewards) // G):
        R = rewards[g * G:(g + 1) * G]
        k = sum(1 for x in R if x == 1)
        for x in R:
            if k == 0 or k == G:
                w.append(1.0)
            elif x == 1:
                w.append(G / (2 * k))
            else:
                w.append(G / (2 * (G - k)))
    return w


def ref_bce_with_logits(x, y):
    return max(x, 0.0) - x * y + math.log(1.0 + math.exp(-abs(x)))


def ref_loss(lp, old, mask, rewards, G, beta=1.0, estimator="rloo", balance=True):
    r_hat = ref_reward_proxy(lp, old, mask, beta)
    psi = ref_scores(r_hat, G, estimator)
    w = ref_weights(rewards, G) if balance else [1.0] * len(rewards)
    return sum(w[i] * ref_bce_with_logits(psi[i], rewards[i]) for i in range(len(rewards))) / len(rewards)


def ref_grad_fd(lp, old, mask, rewards, G, beta, estimator, balance, h=1e-5):
    """Central finite differences of ref_loss w.r.t. every logprob entry (float64)."""
    grad = [[0.0] * len(row) for row in lp]
    for i in range(len(lp)):
        for t in range(len(lp[i])):
            plus = [row[:] for row in lp]
            minus = [row[:] for row in lp]
            plus[i][t] += h
            minus[i][t] -= h
            grad[i][t] = (ref_loss(plus, old, mask, rewards, G, beta, estimator, balance)
                          - ref_loss(minus, old, mask, rewards, G, beta, estimator, balance)) / (2 * h)
    return grad


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def closed_form_rloo_grad(lp, old, mask, rewards, G, beta, balance):
    """dL/dlogprobs[k,t] = beta G/(B(G-1)) (c_k - mean_group(c)) mask[k,t], c_k = w_k (sigma(psi_k) - R_k)."""
    B = len(lp)
    psi = ref_scores(ref_reward_proxy(lp, old, mask, beta), G, "rloo")
    w = ref_weights(rewards, G) if balance else [1.0] * B
    c = [w[k] * (sigmoid(psi[k]) - rewards[k]) for k in range(B)]
    grad = []
    for k in range(B):
        g = k // G
        mean_c = sum(c[g * G:(g + 1) * G]) / G
        coef = beta * G / (B * (G - 1)) * (c[k] - mean_c)
        grad.append([coef * m for m in mask[k]])
    return grad


# ---------------------------------------------------------------------------------------------------
# Random problems
# ---------------------------------------------------------------------------------------------------
def group_rewards(B, G, rng):
    """Group 0 all wrong, group 1 all right, the rest mixed (0 < k < G)."""
    R = []
    for g in range(B // G):
        if g == 0:
            R += [0] * G
        elif g == 1:
            R += [1] * G
        else:
            k = rng.randint(1, G - 1)
            grp = [1] * k + [0] * (G - k)
            rng.shuffle(grp)
            R += grp
    return R


def random_problem(B, G, T, seed, beta=1.0, distinct_r=False):
    """Plain-Python lists: logprobs, old_logprobs, prefix masks (lengths 1..T, short rows included), rewards."""
    rng = random.Random(seed)
    while True:
        lp = [[-abs(rng.gauss(1.0, 0.8)) for _ in range(T)] for _ in range(B)]
        old = [[x + rng.gauss(0.0, 0.5) for x in row] for row in lp]
        lengths = [rng.randint(1, T) for _ in range(B)]
        lengths[0] = 1  # always one very short response
        mask = [[1.0 if t < n else 0.0 for t in range(T)] for n in lengths]
        if not distinct_r:
            break
        # GRPO's std is non-differentiable at 0 and ill-conditioned near it: keep r_hat apart in each group
        r = ref_reward_proxy(lp, old, mask, beta)
        gaps = [abs(r[a] - r[b]) for g in range(B // G) for a in range(g * G, g * G + G)
                for b in range(a + 1, g * G + G)]
        if min(gaps) > 0.1:
            break
    return lp, old, mask, group_rewards(B, G, rng)


def to_t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def pacs_loss_and_grad(lp, old, mask, rewards, G, **kw):
    lp_t = to_t(lp, grad=True)
    loss = pacs_loss(lp_t, to_t(old), to_t(mask), to_t(rewards), G, **kw)
    loss.backward()
    return loss, lp_t.grad


# ---------------------------------------------------------------------------------------------------
# 1. pacs_loss == the reference, loss and gradient, every estimator / beta / balance
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,G,T", SHAPES)
@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_matches_reference(estimator, beta, balance, B, G, T):
    seed = zlib.crc32(repr((estimator, beta, balance, B, G, T)).encode())
    lp, old, mask, R = random_problem(B, G, T, seed, beta, distinct_r=(estimator == "grpo"))
    loss, grad = pacs_loss_and_grad(lp, old, mask, R, G, beta=beta, estimator=estimator, balance=balance)
    assert loss.dim() == 0
    assert loss.dtype == torch.float64
    expected = ref_loss(lp, old, mask, R, G, beta, estimator, balance)
    assert abs(loss.item() - expected) < 1e-6
    expected_grad = to_t(ref_grad_fd(lp, old, mask, R, G, beta, estimator, balance))
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
    if estimator == "rloo":
        torch.testing.assert_close(grad, to_t(closed_form_rloo_grad(lp, old, mask, R, G, beta, balance)),
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_scores_match_reference(estimator):
    lp, old, mask, _ = random_problem(12, 4, 5, seed=7, beta=1.5, distinct_r=True)
    psi = pacs_score(to_t(lp), to_t(old), to_t(mask), 4, beta=1.5, estimator=estimator)
    expected = ref_scores(ref_reward_proxy(lp, old, mask, 1.5), 4, estimator)
    torch.testing.assert_close(psi, to_t(expected), atol=1e-10, rtol=0)


def test_defaults_are_rloo_beta1_balanced():
    lp, old, mask, R = random_problem(12, 4, 5, seed=3)
    args = (to_t(lp), to_t(old), to_t(mask), to_t(R), 4)
    explicit = pacs_loss(*args, beta=1.0, estimator="rloo", balance=True)
    assert pacs_loss(*args).item() == explicit.item()
    assert abs(explicit.item() - ref_loss(lp, old, mask, R, 4)) < 1e-10


def test_mask_and_reward_dtypes():
    """bool / int masks and long rewards give the same loss as float ones."""
    lp, old, mask, R = random_problem(8, 4, 5, seed=11)
    base = pacs_loss(to_t(lp), to_t(old), to_t(mask), to_t(R), 4)
    mask_bool = torch.tensor(mask) > 0.5
    for m in (mask_bool, mask_bool.long()):
        for r in (torch.tensor(R, dtype=torch.long), torch.tensor(R, dtype=torch.float32)):
            assert pacs_loss(to_t(lp), to_t(old), m, r, 4).item() == pytest.approx(base.item(), abs=1e-12)


def test_float32_close_to_float64():
    lp, old, mask, R = random_problem(12, 4, 5, seed=5)
    l64 = pacs_loss(to_t(lp), to_t(old), to_t(mask), to_t(R), 4)
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    l32 = pacs_loss(f32(lp), f32(old), f32(mask), f32(R), 4)
    assert l32.dtype == torch.float32
    assert abs(l32.item() - l64.item()) < 1e-5


# ---------------------------------------------------------------------------------------------------
# 2. A case small enough to do by hand
# ---------------------------------------------------------------------------------------------------
def test_hand_computed_value():
    # B = 4, G = 2, T = 2, beta = 1, rloo, balance on. Two groups: rows 0-1 and rows 2-3.
    lp = [[-1.0, -2.0], [-0.5, -1.5], [-0.2, -0.3], [-1.0, -1.0]]
    old = [[-1.5, -2.0], [-0.5, -1.0], [-0.2, -0.3], [-2.0, -1.0]]
    mask = [[1, 1], [1, 0], [1, 1], [1, 1]]
    R = [1, 0, 1, 1]
    # reward proxy r_hat = sum_t mask * (lp - old):
    #   r0 = (-1.0 + 1.5) + (-2.0 + 2.0) = 0.5
    #   r1 = (-0.5 + 0.5) + [masked: -1.5 vs -1.0 ignored] = 0.0
    #   r2 = 0 + 0 = 0.0
    #   r3 = (-1.0 + 2.0) + 0 = 1.0
    # RLOO with G = 2: psi_i = r_i - r_other
    #   psi = [0.5, -0.5, -1.0, 1.0]
    # weights: group 0 has k = 1 of G = 2 -> G/(2k) = 1 and G/(2(G-k)) = 1; group 1 is all correct -> 1
    # BCEWithLogits(x, y) = softplus(x) - x*y = log(1 + e^x) - x*y:
    #   row 0: log(1 + e^0.5) - 0.5  = log(1 + e^-0.5) = 0.4740769841801067
    #   row 1: log(1 + e^-0.5)                          = 0.4740769841801067
    #   row 2: log(1 + e^-1) + 1      = log(1 + e^1)    = 1.3132616875182228
    #   row 3: log(1 + e^1) - 1       = log(1 + e^-1)   = 0.3132616875182228
    # loss = (0.47407698 + 0.47407698 + 1.31326169 + 0.31326169) / 4 = 2.57467734 / 4 = 0.64366933
    psi = pacs_score(to_t(lp), to_t(old), to_t(mask), 2)
    torch.testing.assert_close(psi, to_t([0.5, -0.5, -1.0, 1.0]), atol=1e-12, rtol=0)
    loss = pacs_loss(to_t(lp), to_t(old), to_t(mask), to_t(R), 2)
    expected = (2 * math.log(1 + math.exp(-0.5)) + math.log(1 + math.e) + math.log(1 + math.exp(-1))) / 4
    assert expected == pytest.approx(0.6436693354, abs=1e-9)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    # beta = 2 doubles every r_hat and so every psi: psi = [1, -1, -2, 2]
    #   loss = (2 log(1 + e^-1) + log(1 + e^2) + log(1 + e^-2)) / 4
    loss2 = pacs_loss(to_t(lp), to_t(old), to_t(mask), to_t(R), 2, beta=2.0)
    expected2 = (2 * math.log(1 + math.exp(-1)) + math.log(1 + math.exp(2)) + math.log(1 + math.exp(-2))) / 4
    assert loss2.item() == pytest.approx(expected2, abs=1e-12)


def test_hand_computed_balanced_value():
    # B = 4, G = 4 (one group), T = 1, beta = 1, rloo, rewards [1, 0, 0, 0]: k = 1
    #   weights: correct G/(2k) = 2, wrong G/(2(G-k)) = 4/6 = 2/3 each
    # logprob - old = [0.3, 0, 0, 0] -> r_hat = [0.3, 0, 0, 0]
    #   psi_0 = 0.3 - 0 = 0.3;  psi_j = 0 - 0.3/3 = -0.1 for j = 1, 2, 3
    # loss = (2 * BCE(0.3, 1) + 3 * (2/3) * BCE(-0.1, 0)) / 4
    #      = (2 log(1 + e^-0.3) + 2 log(1 + e^-0.1)) / 4
    lp = [[0.3], [0.0], [0.0], [0.0]]
    old = [[0.0], [0.0], [0.0], [0.0]]
    mask = [[1], [1], [1], [1]]
    loss = pacs_loss(to_t(lp), to_t(old), to_t(mask), to_t([1, 0, 0, 0]), 4)
    expected = (2 * math.log(1 + math.exp(-0.3)) + 2 * math.log(1 + math.exp(-0.1))) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-7)
    unbalanced = pacs_loss(to_t(lp), to_t(old), to_t(mask), to_t([1, 0, 0, 0]), 4, balance=False)
    expected_u = (math.log(1 + math.exp(-0.3)) + 3 * math.log(1 + math.exp(-0.1))) / 4
    assert unbalanced.item() == pytest.approx(expected_u, abs=1e-12)


# ---------------------------------------------------------------------------------------------------
# 3. class_balance_weights
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rewards,G,expected", [
    ([1, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0], 4, [2, 2 / 3, 2 / 3, 2 / 3, 1, 1, 1, 1, 1, 1, 1, 1]),
    ([0, 0, 0, 0, 0, 1, 1, 1], 4, [1, 1, 1, 1, 2, 2 / 3, 2 / 3, 2 / 3]),
    ([0, 1, 1, 0, 0, 0], 3, [1.5, 0.75, 0.75, 1, 1, 1]),
    ([1, 0, 0, 1, 1, 1, 0, 0], 2, [1, 1, 1, 1, 1, 1, 1, 1]),
    ([1, 0, 0, 0, 0, 0, 0, 0], 8, [4] + [8 / 14] * 7),
])
def test_class_balance_weights_values(rewards, G, expected):
    for dtype in (torch.float64, torch.float32, torch.long):
        w = class_balance_weights(torch.tensor(rewards, dtype=dtype), G)
        assert w.shape == (len(rewards),)
        torch.testing.assert_close(w.double(), to_t(expected), atol=1e-6, rtol=0)
        assert ref_weights(rewards, G) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("G", [2, 3, 4, 5, 8])
def test_class_balance_weights_equal_class_totals(G):
    rng = random.Random(G)
    R = [rng.randint(0, 1) for _ in range(G * 40)]
    w = class_balance_weights(to_t(R), G).tolist()
    for g in range(len(R) // G):
        Rg, wg = R[g * G:(g + 1) * G], w[g * G:(g + 1) * G]
        k = sum(Rg)
        if 0 < k < G:
            pos = sum(wi for wi, r in zip(wg, Rg) if r == 1)
            neg = sum(wi for wi, r in zip(wg, Rg) if r == 0)
            assert pos == pytest.approx(G / 2, abs=1e-6)
            assert neg == pytest.approx(G / 2, abs=1e-6)
        else:
            assert wg == [1.0] * G
        assert sum(wg) == pytest.approx(G, abs=1e-6)  # the weights keep the group's total mass at G


def test_float64_loss_keeps_float64_weights():
    """In float64 the balanced loss and its gradient match the formulas to float64 precision: the weights
    G/(2k) must not pass through float32 (2/3 in float32 is off by ~2e-8)."""
    lp, old, mask, R = random_problem(12, 4, 5, seed=13)  # groups: all wrong, all right, mixed
    R[8:12] = [1, 0, 0, 0]  # weights 2 and 2/3: 2/3 is not a float32 number
    w = class_balance_weights(to_t(R), 4)
    torch.testing.assert_close(w.double(), to_t(ref_weights(R, 4)), atol=1e-15, rtol=0)
    loss, grad = pacs_loss_and_grad(lp, old, mask, R, 4)
    assert abs(loss.item() - ref_loss(lp, old, mask, R, 4)) < 1e-13
    torch.testing.assert_close(grad, to_t(closed_form_rloo_grad(lp, old, mask, R, 4, 1.0, True)),
                               atol=1e-15, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------
# 4. The gradient identity of the derivation
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,G", [(4, 2), (6, 3), (12, 4), (10, 5), (16, 8)])
@pytest.mark.parametrize("beta", [0.25, 1.0, 3.0])
@pytest.mark.parametrize("balance", [True, False])
def test_gradient_identity_rloo(B, G, beta, balance):
    T = 6
    g = torch.Generator().manual_seed(B * 100 + G * 10 + int(beta * 4) + balance)
    lp = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    old = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[1] = 1
    lengths[-1] = 2
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    R = torch.randint(0, 2, (B,), generator=g).double()
    R[:G] = 0.0  # one all-wrong group
    lp.requires_grad_(True)
    loss = pacs_loss(lp, old, mask, R, G, beta=beta, balance=balance)
    loss.backward()
    with torch.no_grad():  # closed form, written with torch here (the loop version is checked above)
        r_hat = beta * ((lp - old) * mask).sum(1)
        r = r_hat.view(-1, G)
        psi = (r - (r.sum(1, keepdim=True) - r) / (G - 1)).reshape(-1)
        w = to_t(ref_weights(R.long().tolist(), G)) if balance else torch.ones(B, dtype=torch.float64)
        c = w * (torch.sigmoid(psi) - R)
        c_centred = (c.view(-1, G) - c.view(-1, G).mean(1, keepdim=True)).reshape(-1)
        expected = beta * G / (B * (G - 1)) * c_centred[:, None] * mask
    torch.testing.assert_close(lp.grad, expected, atol=1e-6, rtol=0)
    assert torch.all(lp.grad[mask == 0] == 0)


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("beta", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("G", [2, 3, 4, 8])
def test_gradient_at_psi_zero(G, beta, balance):
    """pi_theta == pi_old (first mini-batch): one-class groups get zero gradient; a mixed group gets
    REINFORCE with a group-mean baseline: -beta G/(B(G-1)) A_k mask with A_k = w_k (R_k - 1/2) - mean."""
    T = 5
    rng = random.Random(G * 7 + int(beta * 2) + balance)
    R = [0] * G + [1] * G  # group 0 all wrong, group 1 all right
    for _ in range(2):  # two mixed groups
        k = rng.randint(1, G - 1)
        grp = [1] * k + [0] * (G - k)
        rng.shuffle(grp)
        R += grp
    B = len(R)
    lp_list = [[-abs(rng.gauss(1, 1)) for _ in range(T)] for _ in range(B)]
    lengths = [rng.randint(1, T) for _ in range(B)]
    mask = to_t([[1.0 if t < n else 0.0 for t in range(T)] for n in lengths])
    lp = to_t(lp_list, grad=True)
    old = to_t(lp_list)
    loss = pacs_loss(lp, old, mask, to_t(R), G, beta=beta, balance=balance)
    loss.backward()
    # psi == 0 for every row: each row's BCE is log 2, whatever its weight; mean weight is 1 -> loss log 2
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
    # one-class groups: exactly zero gradient
    assert torch.all(lp.grad[:2 * G] == 0)
    coef = beta * G / (B * (G - 1))
    for g in (2, 3):
        rows = range(g * G, (g + 1) * G)
        Rg = [R[i] for i in rows]
        k = sum(Rg)
        if balance:  # +G/(4k) on each correct, -G/(4(G-k)) on each wrong sample
            A = [G / (4 * k) if r == 1 else -G / (4 * (G - k)) for r in Rg]
        else:  # R_k - mean(R)
            A = [r - k / G for r in Rg]
        # the same thing via c_k = w_k (1/2 - R_k)
        w = ref_weights(Rg, G) if balance else [1.0] * G
        c = [w[j] * (0.5 - Rg[j]) for j in range(G)]
        assert [ci - sum(c) / G for ci in c] == pytest.approx([-a for a in A], abs=1e-12)
        for j, i in enumerate(rows):
            torch.testing.assert_close(lp.grad[i], -coef * A[j] * mask[i], atol=1e-9, rtol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo"])
def test_one_class_group_zero_gradient_at_psi_zero_other_centred_estimators(estimator):
    """For the other centred estimators too, an all-right or all-wrong group gives no gradient at psi == 0."""
    B, G, T = 8, 4, 3
    lp_list = [[-0.1 * (i + t + 1) for t in range(T)] for i in range(B)]
    lp = to_t(lp_list, grad=True)
    R = [0] * G + [1] * G
    # grpo at r_hat all equal: std = 0, psi = 0/(0 + 1e-6) = 0; the loss is still finite
    loss = pacs_loss(lp, to_t(lp_list), torch.ones(B, T, dtype=torch.float64), to_t(R), G, estimator=estimator)
    loss.backward()
    assert torch.isfinite(loss)
    assert torch.all(torch.isfinite(lp.grad))
    assert lp.grad.abs().max().item() < 1e-9


# ---------------------------------------------------------------------------------------------------
# 5. The mask; no length normalisation
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_masked_tokens_do_not_matter(estimator):
    lp, old, mask, R = random_problem(12, 4, 6, seed=21, distinct_r=True)
    loss, grad = pacs_loss_and_grad(lp, old, mask, R, 4, estimator=estimator)
    m = to_t(mask)
    gen = torch.Generator().manual_seed(0)
    wild_lp = torch.where(m > 0, to_t(lp), 1e4 * torch.randn(12, 6, generator=gen, dtype=torch.float64))
    wild_old = torch.where(m > 0, to_t(old), -1e4 * torch.rand(12, 6, generator=gen, dtype=torch.float64))
    wild_lp.requires_grad_(True)
    loss2 = pacs_loss(wild_lp, wild_old, m, to_t(R), 4, estimator=estimator)
    loss2.backward()
    assert loss2.item() == loss.item()
    assert torch.equal(wild_lp.grad, grad)
    assert torch.all(wild_lp.grad[m == 0] == 0)
    assert (m == 0).any() and (grad[m > 0] != 0).any()


def test_reward_proxy_is_a_sum_not_a_mean():
    lp, old, mask, _ = random_problem(8, 4, 5, seed=2)
    beta = 0.7
    r = pacs_score(to_t(lp), to_t(old), to_t(mask), 4, beta=beta, estimator="none")
    torch.testing.assert_close(r, to_t(ref_reward_proxy(lp, old, mask, beta)), atol=1e-12, rtol=0)
    # the same response written twice (twice the tokens, each with the same log-ratio): r_hat doubles
    T = len(lp[0])
    lp2, old2, mask2 = [], [], []
    for i in range(8):
        n = int(sum(mask[i]))  # the mask is a prefix of n ones
        pad = [-9.0] * (2 * T - 2 * n)
        lp2.append(lp[i][:n] * 2 + pad)
        old2.append(old[i][:n] * 2 + pad)
        mask2.append([1.0] * (2 * n) + [0.0] * (2 * T - 2 * n))
    r2 = pacs_score(to_t(lp2), to_t(old2), to_t(mask2), 4, beta=beta, estimator="none")
    torch.testing.assert_close(r2, 2 * r, atol=1e-12, rtol=0)
    # doubling every log-ratio on the masked tokens doubles r_hat too
    lp3 = [[o + 2 * (l - o) for l, o in zip(rl, ro)] for rl, ro in zip(lp, old)]
    r3 = pacs_score(to_t(lp3), to_t(old), to_t(mask), 4, beta=beta, estimator="none")
    torch.testing.assert_close(r3, 2 * r, atol=1e-12, rtol=0)
    # a length-1 response and a length-4 one with the same per-token log-ratio: r_hat differs by 4x
    lp4 = to_t([[0.1] * 4, [0.1] * 4])
    m4 = to_t([[1, 0, 0, 0], [1, 1, 1, 1]])
    r4 = pacs_score(lp4, torch.zeros(2, 4, dtype=torch.float64), m4, 2, estimator="none")
    torch.testing.assert_close(r4, to_t([0.1, 0.4]), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------
# 6. Errors
# ---------------------------------------------------------------------------------------------------
def _args(B, T=3):
    z = torch.zeros(B, T, dtype=torch.float64)
    return z.clone().requires_grad_(True), z, torch.ones(B, T), torch.zeros(B)


def test_error_batch_not_divisible():
    lp, old, mask, R = _args(7)
    with pytest.raises(ValueError) as e:
        pacs_loss(lp, old, mask, R, 3)
    msg = str(e.value)
    assert re.search(r"\b7\b", msg) and re.search(r"\b3\b", msg), msg
    assert "\n" not in msg and msg.strip()
    with pytest.raises(ValueError):
        pacs_score(lp, old, mask, 3)


@pytest.mark.parametrize("G", [1, 0, -2])
def test_error_group_too_small(G):
    lp, old, mask, R = _args(4)
    with pytest.raises(ValueError) as e:
        pacs_loss(lp, old, mask, R, G)
    msg = str(e.value)
    assert "\n" not in msg and msg.strip()
    assert str(G) in msg


def test_error_unknown_estimator():
    lp, old, mask, R = _args(4)
    with pytest.raises(ValueError) as e:
        pacs_loss(lp, old, mask, R, 2, estimator="ppo")
    msg = str(e.value)
    assert "ppo" in msg and "\n" not in msg


def test_error_rewards_shape():
    lp, old, mask, _ = _args(4)
    with pytest.raises(ValueError) as e:
        pacs_loss(lp, old, mask, torch.zeros(4, 1), 2)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------------
# 7. The baselines
# ---------------------------------------------------------------------------------------------------
def ref_grpo_adv(R, G):
    A = []
    for g in range(len(R) // G):
        Rg = R[g * G:(g + 1) * G]
        mean = sum(Rg) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in Rg) / (G - 1))
        A += [(x - mean) / (std + 1e-6) for x in Rg]
    return A


def ref_rloo_adv(R, G):
    A = []
    for g in range(len(R) // G):
        Rg = R[g * G:(g + 1) * G]
        A += [Rg[i] - sum(Rg[j] for j in range(G) if j != i) / (G - 1) for i in range(G)]
    return A


@pytest.mark.parametrize("B,G", [(6, 2), (12, 4), (9, 3)])
@pytest.mark.parametrize("which", ["grpo", "reinforce"])
def test_baseline_gradient_at_ratio_one(which, B, G):
    T = 5
    rng = random.Random(B * G)
    R = group_rewards(B, G, rng)
    lp_list = [[-abs(rng.gauss(1, 1)) for _ in range(T)] for _ in range(B)]
    lengths = [rng.randint(1, T) for _ in range(B)]
    mask_list = [[1.0 if t < n else 0.0 for t in range(T)] for n in lengths]
    lp = to_t(lp_list, grad=True)
    fn = grpo_loss if which == "grpo" else reinforce_loss
    loss = fn(lp, to_t(lp_list), to_t(mask_list), to_t(R), G, loss_agg="token-mean")
    loss.backward()
    A = ref_grpo_adv(R, G) if which == "grpo" else ref_rloo_adv(R, G)
    N = sum(lengths)
    expected = to_t([[-A[k] * m / N for m in mask_list[k]] for k in range(B)])
    torch.testing.assert_close(lp.grad, expected, atol=1e-12, rtol=1e-10)
    # at ratio 1 the surrogate is -sum_k A_k n_k / N
    assert loss.item() == pytest.approx(-sum(A[k] * lengths[k] for k in range(B)) / N, abs=1e-12)


def test_grpo_clipping():
    # one group of G = 2, rewards [1, 0]: A = [+1/sqrt(1/2), -1/sqrt(1/2)] / (1 + tiny), N = 4 tokens
    eps = 0.2
    old = torch.zeros(2, 2, dtype=torch.float64)
    lp = to_t([[math.log(1.5), 0.0],  # token (0,0): ratio 1.5 > 1 + eps, A > 0 -> clipped, zero grad
               [math.log(0.5), math.log(1.5)]], grad=True)  # (1,0): ratio 0.5 < 1 - eps, A < 0 -> clipped
    mask = torch.ones(2, 2, dtype=torch.float64)
    loss = grpo_loss(lp, old, mask, to_t([1, 0]), 2, clip_eps=eps, loss_agg="token-mean")
    loss.backward()
    A = ref_grpo_adv([1, 0], 2)
    assert A[0] > 0 > A[1]
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[1, 0].item() == 0.0
    # unclipped tokens: d/dlp of -(ratio * A)/N = -ratio * A / N
    assert lp.grad[0, 1].item() == pytest.approx(-1.0 * A[0] / 4, abs=1e-12)
    # ratio 1.5 with A < 0 is not clipped (min picks the more pessimistic ratio * A)
    assert lp.grad[1, 1].item() == pytest.approx(-1.5 * A[1] / 4, abs=1e-12)
    # the clipped value enters the loss as a constant (1 + eps) * A
    expected = -((1 + eps) * A[0] + 1.0 * A[0] + (1 - eps) * A[1] + 1.5 * A[1]) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_reinforce_not_clipped():
    old = torch.zeros(2, 1, dtype=torch.float64)
    lp = to_t([[math.log(3.0)], [0.0]], grad=True)
    loss = reinforce_loss(lp, old, torch.ones(2, 1), to_t([1, 0]), 2)
    loss.backward()
    # A = [1, -1], N = 2: grad = -ratio * A / N
    torch.testing.assert_close(lp.grad, to_t([[-3.0 * 1 / 2], [-1.0 * -1 / 2]]), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------
# 8. The loss is copy-pasteable: it needs only torch and F
# ---------------------------------------------------------------------------------------------------
LOSS_FNS = [pacs_score, class_balance_weights, pacs_loss]
ALLOWED = {"torch", "F", "pacs_score", "class_balance_weights"}


@pytest.mark.parametrize("fn", LOSS_FNS, ids=lambda f: f.__name__)
def test_loss_functions_use_only_torch_and_each_other(fn):
    cv = inspect.getclosurevars(fn)
    assert set(cv.globals) <= ALLOWED, set(cv.globals) - ALLOWED
    assert not cv.nonlocals
    # the same by reading the source: every free name it loads is a builtin, torch, F or a loss function
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    func = tree.body[0]
    assert isinstance(func, ast.FunctionDef) and not func.decorator_list
    bound = {a.arg for a in func.args.args + func.args.kwonlyargs}
    bound |= {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    loaded = {n.id for n in ast.walk(func) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    import builtins
    free = loaded - bound - set(dir(builtins))
    assert free <= ALLOWED, free - ALLOWED


def test_loss_functions_run_pasted_alone():
    """Exec the three functions' source in a namespace holding only torch and F: same results."""
    ns = {"torch": torch, "F": F}
    for fn in LOSS_FNS:
        exec(compile(textwrap.dedent(inspect.getsource(fn)), "<pasted>", "exec"), ns)
    assert pacs.F is torch.nn.functional
    lp, old, mask, R = random_problem(12, 4, 5, seed=9, distinct_r=True)
    for estimator in ESTIMATORS:
        for balance in (True, False):
            args = (to_t(lp), to_t(old), to_t(mask), to_t(R), 4)
            a = ns["pacs_loss"](*args, beta=1.3, estimator=estimator, balance=balance)
            b = pacs_loss(*args, beta=1.3, estimator=estimator, balance=balance)
            assert a.item() == b.item()
