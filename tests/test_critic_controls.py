"""The critic controls (experiments/critic_controls.py): sigma(psi) permuted within classes or within groups in PACS's
gradient. Checked against the derivation above pacs.pacs_score, against critic-off (p = 1/2) bit for bit, and the
class-shuffled substitute's ranking against sigma(psi)'s."""
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import critic_controls as cc  # noqa: E402
import pacs  # noqa: E402


def _batch(seed=0, groups=5, G=6, T=7, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    old = -torch.rand(B, T, generator=g, dtype=dtype) * 3
    logprobs = (old + 0.3 * torch.randn(B, T, generator=g, dtype=dtype)).requires_grad_()
    mask = (torch.rand(B, T, generator=g) < 0.8).to(dtype)
    mask[:, 0] = 1
    rewards = (torch.rand(B, generator=g) < 0.4).to(dtype)
    rewards[:G] = torch.tensor([1, 0] * (G // 2), dtype=dtype)  # one group surely mixed
    rewards[G:2 * G] = 0  # one all wrong
    return logprobs, old, mask, rewards, G


@pytest.mark.parametrize("balance", [True, False])
@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_the_gradient_with_a_given_prediction_is_the_derivations(balance, beta):
    """-dL/dlogprobs[k,t] = beta G/(B(G-1)) (y_k - mean_group(y)) mask[k,t], y_k = w_k (R_k - p_k)."""
    logprobs, old, mask, rewards, G = _batch()
    B = len(rewards)
    p = torch.rand(B, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    loss = cc.pacs_loss_given_prediction(logprobs, old, mask, rewards, G, p, beta=beta, balance=balance)
    (grad,) = torch.autograd.grad(loss, logprobs)
    w = pacs.class_balance_weights(rewards, G) if balance else torch.ones(B, dtype=torch.float64)
    y = (w * (rewards - p)).view(-1, G)
    A = (y - y.mean(-1, keepdim=True)).reshape(-1)
    torch.testing.assert_close(-grad, beta * G / (B * (G - 1)) * A[:, None] * mask, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("balance", [True, False])
def test_a_prediction_of_one_half_is_critic_off_bit_for_bit(balance, dtype):
    logprobs, old, mask, rewards, G = _batch(seed=2, dtype=dtype)
    ours = cc.pacs_loss_given_prediction(logprobs, old, mask, rewards, G, torch.full_like(rewards, 0.5),
                                         balance=balance)
    off = pacs.pacs_loss(logprobs, old, mask, rewards, G, balance=balance, implicit_critic=False)
    (g_ours,), (g_off,) = torch.autograd.grad(ours, logprobs), torch.autograd.grad(off, logprobs)
    assert torch.equal(ours, off) and torch.equal(g_ours, g_off)


def test_sigma_psi_as_the_prediction_gives_pacs_gradient():
    logprobs, old, mask, rewards, G = _batch(seed=3)
    psi = pacs.pacs_score(logprobs.detach(), old, mask, G)
    ours = cc.pacs_loss_given_prediction(logprobs, old, mask, rewards, G, torch.sigmoid(psi))
    (g_ours,) = torch.autograd.grad(ours, logprobs)
    (g_pacs,) = torch.autograd.grad(pacs.pacs_loss(logprobs, old, mask, rewards, G), logprobs)
    torch.testing.assert_close(g_ours, g_pacs, rtol=1e-10, atol=1e-14)


def test_the_prediction_carries_no_gradient():
    logprobs, old, mask, rewards, G = _batch(seed=4)
    p = torch.full((len(rewards),), 0.3, dtype=torch.float64, requires_grad=True)
    loss = cc.pacs_loss_given_prediction(logprobs, old, mask, rewards, G, p)
    loss.backward()
    assert p.grad is None and logprobs.grad is not None


def _auc(values, rewards, G):
    won, pairs = pacs.group_auc(values, rewards, G)
    return won / pairs


@pytest.mark.parametrize("seed", range(5))
def test_class_shuffled_keeps_each_classs_values_and_so_the_auc_exactly(seed):
    g = torch.Generator().manual_seed(seed)
    G, groups = 8, 40
    values = torch.rand(G * groups, generator=g, dtype=torch.float64)
    rewards = (torch.rand(G * groups, generator=g) < 0.5).double()
    out = cc.class_shuffled(values, rewards, G, torch.Generator().manual_seed(seed))
    for s in range(0, len(values), G):
        for cls in (0.0, 1.0):
            rows = rewards[s:s + G] == cls
            assert torch.equal(out[s:s + G][rows].sort().values, values[s:s + G][rows].sort().values)
    assert _auc(out, rewards, G) == _auc(values, rewards, G)
    assert (out != values).float().mean() > 0.5  # each response's own value is gone (a no-op would keep it)


@pytest.mark.parametrize("seed", range(5))
def test_group_shuffled_keeps_each_groups_values_but_not_the_ranking(seed):
    g = torch.Generator().manual_seed(seed)
    G, groups = 8, 200
    rewards = (torch.rand(G * groups, generator=g) < 0.5).double()
    values = torch.rand(G * groups, generator=g, dtype=torch.float64) + rewards  # ranks perfectly: AUC 1
    out = cc.group_shuffled(values, rewards, G, torch.Generator().manual_seed(seed))
    for s in range(0, len(values), G):
        assert torch.equal(out[s:s + G].sort().values, values[s:s + G].sort().values)
    assert _auc(values, rewards, G) == 1.0
    assert abs(_auc(out, rewards, G) - 0.5) < 0.05  # 3,000-odd pairs: chance, within about 3 standard errors


def test_the_permutation_is_a_function_of_seed_step_and_call():
    values, rewards = torch.arange(16.0), torch.tensor([1.0, 0] * 8)
    draw = lambda *key: cc.group_shuffled(values, rewards, 8, cc.step_generator(*key))
    assert torch.equal(draw(0, 3, 1), draw(0, 3, 1))
    assert not torch.equal(draw(0, 3, 1), draw(0, 4, 1)) and not torch.equal(draw(0, 3, 1), draw(1, 3, 1))
    assert not torch.equal(draw(0, 3, 1), draw(0, 3, 2))


# ---- the script: pacs.py with the control in its loss ------------------------------------------------------------
@pytest.fixture(scope="module")
def digit_problems(tmp_path_factory):
    path = tmp_path_factory.mktemp("digits") / "train.jsonl"
    rows = [{"id": f"d{i}", "problem": f"{i} + {j} =", "answer": str(i + j)} for i in range(1, 5) for j in range(1, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run(digit_model, digit_problems, out, *flags, control=None):
    argv = ["--model", digit_model, "--dataset", digit_problems, "--steps", "1", "--prompts-per-step", "4",
            "--group-size", "4", "--num-mini-batches", "2", "--max-new-tokens", "4", "--lr", "1e-2",
            "--eval-every", "0", "--device", "cpu", "--seed", "5", "--out-dir", str(out), "--resume", *flags]
    if control:
        cc.main(["--critic-control", control, *argv])
    else:
        pacs.main(argv)
    return load_file(os.path.join(pacs.latest_checkpoint(str(out)), "model.safetensors"))


def _mixed_rewards(responses, answers):
    """1 for every third response: each group of 4 holds both classes, so class- and group-shuffled differ."""
    return torch.tensor([float(i % 3 == 0) for i in range(len(responses))])


def test_a_control_run_differs_from_pacs_and_critic_off_only_after_the_first_mini_batch(digit_model, digit_problems,
                                                                                      tmp_path, monkeypatch):
    monkeypatch.setattr(pacs, "reward_fn", _mixed_rewards)
    weights = {name: _run(digit_model, digit_problems, tmp_path / name, *flags, control=control)
               for name, flags, control in [("pacs", [], None), ("off", ["--no-implicit-critic"], None),
                                            ("class", [], "class-shuffled"), ("group", [], "group-shuffled")]}
    differ = lambda a, b: any(not torch.equal(weights[a][k], weights[b][k]) for k in weights[a])
    assert differ("pacs", "off")  # mini-batch 1 saw psi != 0
    assert differ("class", "pacs") and differ("class", "off") and differ("group", "class")
    assert pacs.algo_loss is cc._original["algo_loss"] and pacs.train_step is cc._original["train_step"]
    rows = [json.loads(line) for line in open(tmp_path / "class" / "metrics.jsonl")]
    assert rows[0]["psi_std"] > 0  # the run logs sigma(psi)'s own metrics, as PACS's do
    # the same control again from scratch: the same weights (the permutation is seeded by the run, step and call)
    again = _run(digit_model, digit_problems, tmp_path / "class2", control="class-shuffled")
    assert all(torch.equal(again[k], weights["class"][k]) for k in again)
    # M = 1: psi == 0 on the only mini-batch, every sigma(psi) is 1/2 and so is any permutation of them: critic-off
    one = [_run(digit_model, digit_problems, tmp_path / f"m1-{c}", "--num-mini-batches", "1", *flags, control=c)
           for c, flags in (("group-shuffled", []), (None, ["--no-implicit-critic"]))]
    assert all(torch.equal(one[0][k], one[1][k]) for k in one[0])


def test_a_resume_with_another_control_is_refused(digit_model, digit_problems, tmp_path):
    _run(digit_model, digit_problems, tmp_path / "run", control="class-shuffled")
    with pytest.raises(SystemExit, match="made with --critic-control class-shuffled, not group-shuffled"):
        _run(digit_model, digit_problems, tmp_path / "run", control="group-shuffled")
    _run(digit_model, digit_problems, tmp_path / "plain")
    with pytest.raises(SystemExit, match="made without --critic-control"):
        _run(digit_model, digit_problems, tmp_path / "plain", control="group-shuffled")


@pytest.mark.parametrize("argv, message", [
    (["--steps", "1"], "--critic-control {class-shuffled,group-shuffled} is required"),
    (["--critic-control", "ranked"], "--critic-control 'ranked': use one of class-shuffled, group-shuffled"),
    (["--critic-control", "class-shuffled", "--algo", "grpo"], "needs --algo pacs with the implicit critic on"),
    (["--critic-control", "class-shuffled", "--no-implicit-critic"], "needs --algo pacs with the implicit critic"),
])
def test_bad_flags_are_one_line_errors(argv, message):
    with pytest.raises(SystemExit, match=message.replace("{", r"\{").replace("}", r"\}").replace("(", r"\(")):
        cc.main(argv)
