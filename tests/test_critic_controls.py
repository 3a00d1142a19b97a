"""The critic controls (experiments/critic_controls.py): sigma(psi) permuted within classes or within groups in PACS's
gradient. Checked against the derivation above pacs.pacs_score, against critic-off (p = 1/2) bit for bit, and the
class-shuffled substitute's ranking against sigma(psi)'s."""
import json
import os
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import critic_controls as cc  # noqa: E402
import pacs  # noqa: E402
import plumbing
import conftest  # noqa: E402  (reward_stand_in: pacs.reward_fn's stand-in)


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
    return load_file(os.path.join(plumbing.latest_checkpoint(str(out)), "model.safetensors"))


def _mixed_rewards(responses, answers):
    """1 for every third response: each group of 4 holds both classes, so class- and group-shuffled differ."""
    return torch.tensor([float(i % 3 == 0) for i in range(len(responses))])


def test_a_control_run_differs_from_pacs_and_critic_off_only_after_the_first_mini_batch(digit_model, digit_problems,
                                                                                      tmp_path, monkeypatch):
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(_mixed_rewards))
    weights = {name: _run(digit_model, digit_problems, tmp_path / name, *flags, control=control)
               for name, flags, control in [("pacs", [], None), ("off", ["--no-implicit-critic"], None),
                                            ("class", [], "class-shuffled"), ("group", [], "group-shuffled")]}
    differ = lambda a, b: any(not torch.equal(weights[a][k], weights[b][k]) for k in weights[a])
    assert differ("pacs", "off")  # mini-batch 1 saw psi != 0
    assert differ("class", "pacs") and differ("class", "off") and differ("group", "class")
    assert pacs.algo_loss is cc.ORIGINAL["algo_loss"] and pacs.train_step is cc.ORIGINAL["train_step"]
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


# ---- the summaries: the decomposition, and the critic over the same first rollouts at every mini-batch ----------
import lab_summary  # noqa: E402


def _result(path, method, seed, prompts, lr, auc, pairs, shift, change, steps=None):
    """A result file with the per-step critic metrics given (lists, one value per step)."""
    steps = steps or len(auc)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    json.dump({"method": method, "seed": seed, "settings": {"prompts": prompts, "num_mini_batches": 4, "lr": lr},
               "metrics": {"reward": [0.1] * steps, "critic_auc": auc, "critic_pairs": pairs, "critic_shift": shift,
                           "critic_adv_change": change}}, open(path, "w"))


def test_critic_window_reads_every_run_over_the_same_first_steps(tmp_path):
    root = tmp_path / "results"
    assert lab_summary.critic_window(str(root)) is None  # no axis-p*/ run: no entry
    # the sweep (8 prompts per mini-batch), 2 seeds, 3 steps; step 3 is outside a window of 2 and must not count
    _result(root / "test-p32" / "pacs-s0.json", "pacs", 0, 32, 1e-4, [0.5, 0.7, 0.0], [10, 30, 100], [0.02, 0.04, 9],
            [0.1, 0.3, 9])
    _result(root / "test-p32" / "pacs-s1.json", "pacs", 1, 32, 1e-4, [0.6, None, 0.0], [20, 0, 100], [0.03, None, 9],
            [0.2, None, 9])
    _result(root / "test-p32" / "grpo-s0.json", "grpo", 0, 32, 1e-4, [None] * 3, [0] * 3, [None] * 3, [None] * 3)
    _result(root / "axis-p1024" / "pacs-s0.json", "pacs", 0, 1024, 1e-4, [0.8, 0.6], [100, 100], [0.05, 0.07],
            [0.2, 0.4])
    w = lab_summary.critic_window(str(root), window=2)
    assert w["window_steps"] == 2 and [p["prompts_per_mini_batch"] for p in w["points"]] == [8, 256]
    p8, p256 = w["points"]
    assert p8["seeds"] == [0, 1] and p8["lr"] == 1e-4
    aucs = [(0.5 * 10 + 0.7 * 30) / 40, 0.6]  # per run, pooled over its pairs in the window
    assert p8["critic_auc"][0] == pytest.approx(np.mean(aucs), abs=1e-5)
    assert p8["critic_auc_pooled"] == pytest.approx((0.5 * 10 + 0.7 * 30 + 0.6 * 20) / 60, abs=1e-5)
    assert p8["critic_pairs"] == 60
    assert p8["critic_shift"][0] == pytest.approx(np.mean([0.03, 0.03]), abs=1e-5)  # a run's mean over logged steps
    assert p256["critic_auc"][0] == pytest.approx(0.7) and p256["critic_adv_change"][0] == pytest.approx(0.3)
    with pytest.raises(lab_summary.SweepError, match="ran 2 steps, fewer than the window's 3"):
        lab_summary.critic_window(str(root), window=3)


def test_the_decomposition_adds_up_to_pacs_minus_critic_off_seed_by_seed(tmp_path):
    rng = np.random.default_rng(0)
    methods = ["pacs", "pacs-critic-class-shuffled", "pacs-critic-group-shuffled", "pacs-critic-off"]
    runs = [{"method": m, "seed": s, "pass@1": float(rng.uniform(0.4, 0.6)), "pass@64": float(rng.uniform(0.9, 1)),
             "final_entropy": float(rng.uniform(0.08, 0.1))} for m in methods for s in range(6)]
    summary = {"settings": {"prompts": 32, "num_mini_batches": 4}, "runs": runs}
    root = tmp_path / "results"
    for m in methods:
        for s in range(6):
            _result(root / "test-p32" / f"{m}-s{s}.json", m, s, 32, 1e-4, [0.5 + 0.01 * s], [10], [0.02 * (s + 1)],
                    [0.1])
    d = lab_summary.decomposition_summary(str(root), summary)
    by = {(p["part"], p["metric"]): p for p in d["parts"]}
    assert {p for p, _ in by} == {"self-damping", "ranking", "values", "total"}
    for metric in ("pass@1", "pass@64", "final_entropy"):
        parts = sum(by[(p, metric)]["mean"] for p in ("self-damping", "ranking", "values"))
        assert parts == pytest.approx(by[("total", metric)]["mean"], abs=3e-5)
        value = lambda m: np.mean([r[metric] for r in runs if r["method"] == m])
        assert by[("ranking", metric)]["mean"] == pytest.approx(
            value("pacs-critic-class-shuffled") - value("pacs-critic-group-shuffled"), abs=1e-5)
    assert d["critic"]["pacs"]["seeds"] == 6
    assert d["critic"]["pacs"]["critic_auc"][0] == pytest.approx(np.mean([0.5 + 0.01 * s for s in range(6)]), abs=1e-5)
    assert d["critic"]["pacs"]["critic_shift"][0] == pytest.approx(0.07, abs=1e-5)
    no_controls = {**summary, "runs": [r for r in runs if r["method"] in ("pacs", "pacs-critic-off")]}
    assert lab_summary.decomposition_summary(str(root), no_controls) is None


def test_the_critic_figure_is_written_from_summaries_and_refuses_ones_without_its_entries(tmp_path, capsys):
    import figures
    parts = [{"part": p, "metric": "pass@1", "mean": 0.01 * i, "ci95_t": [0.01 * i - 0.005, 0.01 * i + 0.005],
              "seeds": 16} for i, p in enumerate(figures.PART_ORDER)]
    window = {"window_steps": 5, "points": [
        {"prompts_per_mini_batch": ppm, "lr": 1e-4, "seeds": [0, 1, 2, 3], "critic_auc": [auc, auc - 0.01, auc + 0.01]}
        for ppm, auc in ((1, 0.5), (8, 0.52), (256, 0.6))]}
    for tag, entry in (("lab", {"decomposition": {"parts": parts}, "critic_window": window}),
                       ("lab2", {"decomposition": {"parts": parts}})):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "summary.json").write_text(json.dumps(entry))
    out = tmp_path / "critic.png"
    figures.main(["critic", str(tmp_path / "lab" / "summary.json"), str(tmp_path / "lab2" / "summary.json"),
                  "--out", str(out)])
    assert out.stat().st_size > 10_000 and f"figure: {out}" in capsys.readouterr().out
    one_seed = {"decomposition": {"parts": [{**p, "seeds": 1, "ci95_t": [None, None]} for p in parts]}}
    (tmp_path / "lab3").mkdir()
    (tmp_path / "lab3" / "summary.json").write_text(json.dumps(one_seed))  # no interval yet: left out, no error
    figures.main(["critic", str(tmp_path / "lab" / "summary.json"), str(tmp_path / "lab3" / "summary.json"),
                  "--out", str(out)])
    (tmp_path / "none.json").write_text("{}")
    with pytest.raises(SystemExit, match="no summary has a decomposition or a critic_window entry"):
        figures.main(["critic", str(tmp_path / "none.json"), "--out", str(out)])
