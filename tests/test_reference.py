"""PACS's reference policy (--ref-reset-every K, --no-ref-reset-optimizer), on a tiny random model (CPU, no network):
K = 1 is the official code's pi_old and the run it always was; K >= 2 scores r_hat against a frozen copy of the
weights that is hard-reset to pi_theta, with AdamW's state, at steps K, 2K, ... (paper v2); K = 0 never resets (Eq. 7's
fixed pi_ref). The rows of each loss call are mapped as tests/test_training.py maps them: by counting rows."""
import copy
import json
import os
import random

import numpy as np
import pytest
import torch

import pacs

import plumbing
import conftest

G, P, M = 8, 8, 2  # 8 prompts x 8 samples; 2 mini-batches of 32 rows, one micro-batch each
ROWS_PER_MINI = P * G // M


def flags(model, dataset, out_dir, *extra):
    return ["--model", model, "--dataset", dataset, "--out-dir", str(out_dir), "--group-size", str(G),
            "--prompts-per-step", str(P), "--num-mini-batches", str(M), "--micro-batch-size", "32",
            "--max-new-tokens", "2", "--lr", "1e-2", "--eval-every", "0", "--log-samples-every", "0", *extra]


def run(model, dataset, out_dir, *extra):
    pacs.main(flags(model, dataset, out_dir, *extra))
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def no_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_") and k not in ("step_time", "samples_per_s")}
            for r in rows]


def final_weights(out_dir):
    model, _ = plumbing.load_model(plumbing.latest_checkpoint(str(out_dir)))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


class Recorder:
    """Wraps pacs.sample and pacs.algo_loss: each rollout, and each loss call's rows, log-probs and reference."""

    def __init__(self, monkeypatch):
        self.rolls, self.calls, self.row = [], [], 0
        real_sample, real_loss = pacs.sample, pacs.algo_loss

        def sample(*args, **kwargs):
            roll = real_sample(*args, **kwargs)
            self.rolls.append({k: v.clone() for k, v in roll.items()})
            self.row = 0
            return roll

        def algo_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages=None):
            rows = range(self.row, self.row + logprobs.shape[0])
            self.row = rows.stop
            self.calls.append({"step": len(self.rolls) - 1, "mini": rows.start // ROWS_PER_MINI, "rows": rows,
                               "logprobs": logprobs.detach().clone(), "ref": old_logprobs.detach().clone(),
                               "mask": mask.detach().clone()})
            return real_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages)

        monkeypatch.setattr(pacs, "sample", sample)
        monkeypatch.setattr(pacs, "algo_loss", algo_loss)
        monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(lambda texts, answers: torch.tensor(
            [float(i % 3 == 0) for i in range(len(texts))])))  # mixed groups: every mini-batch has a gradient

    def psi(self, call):
        return pacs.pacs_score(call["logprobs"], call["ref"], call["mask"], G)

    def of(self, step, mini):
        return [c for c in self.calls if c["step"] == step and c["mini"] == mini]


def logprobs_of(model, roll, rows, width):
    model.eval()
    with torch.no_grad():
        lp, _ = pacs.response_logprobs(model, roll["prompt_ids"][rows], roll["prompt_mask"][rows],
                                       roll["response_ids"][rows], roll["response_mask"][rows], group_size=G)
    return lp[:, :width] * roll["response_mask"][rows, :width]


# ---- K = 1 is the official code's run ------------------------------------------------------------------------
def test_k1_is_the_run_without_a_reference_model_bit_for_bit(digit_model, const7_file, tmp_path):
    # pacs.py's loop at the default K = 1 against the same loop written out without any reference machinery:
    # train_step with no ref_model after train_step, one AdamW state: the same metrics and weights, bit for bit
    rows = run(digit_model, const7_file, tmp_path / "k1", "--steps", "3", "--seed", "2")
    cfg = pacs.parse_args(flags(digit_model, const7_file, tmp_path / "by_hand", "--steps", "3", "--seed", "2"))
    torch.manual_seed(2)
    random.seed(2)
    np.random.seed(2)
    model, tok = plumbing.load_model(digit_model)
    problems = plumbing.load_problems(const7_file)
    optimizer = pacs.make_optimizer(cfg, model)
    by_hand = []
    for step in range(3):
        metrics, _ = pacs.train_step(cfg, model, tok, optimizer, problems, step, torch.device("cpu"))
        by_hand.append(json.loads(json.dumps(metrics)))
    sizes = ("micro_batch_size", "gen_batch_prompts")  # the plan's in the run, as typed by hand: not the method's
    assert [{k: v for k, v in r.items() if k not in sizes} for r in no_timing(rows)] == \
        [{k: v for k, v in r.items() if k not in sizes} for r in no_timing(by_hand)]
    trained = final_weights(tmp_path / "k1")
    assert all(torch.equal(p, trained[n]) for n, p in model.named_parameters())
    assert "critic_auc_first" not in rows[-1]  # psi == 0 on mini-batch 0 at K = 1: no first-mini-batch critic


# ---- between resets pi_ref stays put; at a reset it is pi_theta, and AdamW starts over ----------------------------
def test_reference_is_frozen_between_resets_and_reset_to_the_policy(digit_model, const7_file, tmp_path, monkeypatch):
    rec = Recorder(monkeypatch)
    snapshots = {}  # step -> the weights train_step starts from (pi_old of that rollout)
    real_step = pacs.train_step

    def train_step(cfg, model, *args, **kwargs):
        snapshots[args[3]] = copy.deepcopy(model)
        return real_step(cfg, model, *args, **kwargs)

    monkeypatch.setattr(pacs, "train_step", train_step)
    rows = run(digit_model, const7_file, tmp_path, "--steps", "5", "--ref-reset-every", "3")
    ref_at = {0: snapshots[0], 1: snapshots[0], 2: snapshots[0], 3: snapshots[3], 4: snapshots[3]}
    for c in rec.calls:
        roll, width = rec.rolls[c["step"]], c["mask"].shape[1]
        want = logprobs_of(ref_at[c["step"]], roll, c["rows"], width)
        torch.testing.assert_close(c["ref"] * c["mask"], want, atol=1e-5, rtol=1e-5)
        psi = rec.psi(c)
        if c["step"] in (0, 3) and c["mini"] == 0:  # pi_ref == pi_old == pi_theta: psi is 0 bit for bit
            assert torch.equal(psi, torch.zeros_like(psi))
        else:  # pi_theta has moved away from pi_ref: the critic acts from the first mini-batch on
            assert psi.abs().max() > 1e-3, (c["step"], c["mini"])
    # pi_theta moves while pi_ref holds: step 2's policy is not step 0's
    assert any(not torch.equal(a, b) for a, b in zip(snapshots[2].parameters(), snapshots[0].parameters()))
    assert rows[1]["critic_auc_first"] is not None or rows[1]["critic_pairs"] == 0
    assert "critic_auc_first" not in rows[3]  # a reset step: psi == 0 on mini-batch 0
    assert rows[4]["psi_abs"] > 0


def adam_steps(monkeypatch):
    """The AdamW step count of the first parameter after every optimizer step, in order."""
    counts = []
    real = torch.optim.AdamW.step

    def step(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        counts.append(int(self.state[self.param_groups[0]["params"][0]]["step"]))
        return out

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    return counts


@pytest.mark.parametrize("keep", [False, True])
def test_a_reset_clears_adamw_at_steps_k_2k_unless_kept(digit_model, const7_file, tmp_path, monkeypatch, keep):
    counts = adam_steps(monkeypatch)
    run(digit_model, const7_file, tmp_path, "--steps", "5", "--ref-reset-every", "2",
        *(["--no-ref-reset-optimizer"] if keep else []))
    # M = 2 optimizer steps a rollout; resets before rollout steps 2 and 4
    assert counts == ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10] if keep else [1, 2, 3, 4, 1, 2, 3, 4, 1, 2])


def test_reset_reference_copies_the_weights_and_clears_the_moments(digit_model):
    model, _ = plumbing.load_model(digit_model)
    ref = copy.deepcopy(model).requires_grad_(False)
    cfg = pacs.Config(ref_reset_every=3)
    optimizer = pacs.make_optimizer(cfg, model)
    model(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    assert optimizer.state and any(not torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    frozen = [p.clone() for p in ref.parameters()]
    for step in (1, 2, 4, 5):  # not a multiple of K: nothing happens
        assert pacs.reset_reference(cfg, step, model, ref, optimizer) is False
        assert optimizer.state and all(torch.equal(a, b) for a, b in zip(ref.parameters(), frozen))
    assert pacs.reset_reference(cfg, 3, model, ref, optimizer) is True
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    assert not optimizer.state  # moments and step count gone: the next step() starts AdamW afresh
    never = pacs.Config(ref_reset_every=0)
    assert pacs.reset_reference(never, 0, model, ref, optimizer) is True  # the starting model is pi_old at step 0
    assert not any(pacs.reset_reference(never, s, model, ref, optimizer) for s in (1, 16, 150))
    official = pacs.Config()
    assert all(pacs.reset_reference(official, s, model, None, optimizer) for s in range(5))


# ---- a resume in the middle of a reset period continues exactly ------------------------------------------------
def test_resume_mid_period_equals_the_uninterrupted_run(digit_model, const7_file, tmp_path):
    extra = ("--ref-reset-every", "3", "--save-every", "2")
    full = run(digit_model, const7_file, tmp_path / "full", "--steps", "6", *extra)
    part = tmp_path / "part"
    run(digit_model, const7_file, part, "--steps", "4", *extra)  # killed after step 3's checkpoint: mid period 2
    resumed = run(digit_model, const7_file, part, "--steps", "6", "--resume", *extra)
    assert no_timing(resumed) == no_timing(full)
    a, b = final_weights(tmp_path / "full"), final_weights(part)
    assert all(torch.equal(a[n], b[n]) for n in a)


# ---- flags, plan ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("extra, message", [
    (["--ref-reset-every", "-1"], "--ref-reset-every must be >= 0"),
    (["--algo", "grpo", "--ref-reset-every", "4"], "--ref-reset-every is PACS's reference policy"),
])
def test_bad_reference_flags_are_one_line_errors(digit_model, const7_file, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        pacs.main(flags(digit_model, const7_file, tmp_path, "--steps", "1", *extra))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_the_plan_holds_the_reference_copy():
    from transformers import Qwen2Config
    c = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2)
    n = 10 ** 6
    official = plumbing.memory_plan(pacs.Config(), c, n, "cpu", 8, 1)
    paper = plumbing.memory_plan(pacs.Config(ref_reset_every=16), c, n, "cpu", 8, 1)
    assert official["reference copy (fp32)"] == 0
    assert paper["state (held throughout)"] - official["state (held throughout)"] == 4 * n
    assert paper["peak"] - official["peak"] == 4 * n
