"""The GPU road's numerics, emulated on the CPU: wherever the weights have not moved, pi_theta's log-probs equal
pi_old's bit for bit under bf16 autocast, on every route a step can take.

With --lr 0 (and no weight decay) no update moves the weights, so psi must be exactly 0 on every mini-batch and
GRPO's and PPO's ratios exactly 1. PACS sums up to 1,024 token log-ratios into psi: if pi_old's log-probs (phase
3) and the training forward's (phase 4) came from different routes (the shared-prompt path against full rows, or
other micro-batch shapes), bf16 rounding would make psi != 0 there, and the BCE would read that noise as critic
signal. `--autocast bf16` runs the CPU forwards under torch.autocast("cpu", bfloat16), CUDA's default here. The
model is wide enough (hidden 128) that the two routes round differently in bf16; at hidden 64 they happen to agree.
"""
import json
import os

import pytest
import torch

import pacs

import plumbing
from conftest import make_tiny_model_dir
import conftest

G, P, M = 4, 4, 2  # 16 rows, mini-batches of 8 rows (two groups)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("wide_model"), chars="0123456789 +?=", hidden=128)


def mixed_rewards(texts, answers):
    return torch.tensor([float(i % 2) for i in range(len(texts))])


def run_recording(model_dir, out_dir, monkeypatch, *extra):
    """pacs.main for 1 step with every algo_loss call's (logprobs, old_logprobs, mask) recorded."""
    calls, real = [], pacs.algo_loss

    def algo_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages=None):
        calls.append((logprobs.detach().clone(), old_logprobs.clone(), mask.clone()))
        return real(cfg, logprobs, old_logprobs, mask, rewards, advantages)

    monkeypatch.setattr(pacs, "algo_loss", algo_loss)
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(mixed_rewards))
    pacs.main(["--model", model_dir, "--dataset", "synthetic", "--out-dir", str(out_dir), "--group-size", str(G),
               "--prompts-per-step", str(P), "--num-mini-batches", str(M), "--max-new-tokens", "10",
               "--temperature", "1.5", "--lr", "0", "--critic-lr", "0", "--weight-decay", "0", "--steps", "1",
               "--eval-every", "0", "--log-samples-every", "0", "--save-every", "0", "--save-minutes", "0", *extra])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return calls, [json.loads(line) for line in f]


def out_of_memory_once(monkeypatch, strike):
    """pacs.response_logprobs raises a simulated CUDA OOM once, on the call strike(n_call, grad, training)
    picks: phase 3 runs without grad in eval mode, phase 4 in training mode."""
    real, seen = pacs.response_logprobs, {"n": 0, "done": False}

    def flaky(model, *a, **k):
        seen["n"] += 1
        if not seen["done"] and strike(seen["n"], torch.is_grad_enabled(), model.training):
            seen["done"] = True
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, *a, **k)

    monkeypatch.setattr(pacs, "response_logprobs", flaky)
    return seen


ROUTES = {  # name -> (pacs.py flags, OOM strike or None)
    "whole groups": (["--micro-batch-size", "8"], None),
    "two micro-batches": (["--micro-batch-size", "4"], None),
    "split groups": (["--micro-batch-size", "2"], None),
    "gradient checkpointing": (["--micro-batch-size", "8", "--gradient-checkpointing"], None),
    # phase 3 fails on its first forward: it is redone with 4-row micro-batches, and so is all of phase 4
    "OOM in phase 3": (["--micro-batch-size", "8"], lambda n, grad, training: not training),
    # calls: phase 3's forwards, then each mini-batch's. Mini-batch 1's second micro-batch fails after its first
    # one ran backward: the mini-batch is redone in 2-row micro-batches, its values still from phase 3's 4-row forwards
    "OOM in phase 4": (["--micro-batch-size", "4"], lambda n, grad, training: training and grad and n >= 6),
    # mini-batch 1 (one 8-row micro-batch) fails: redone in 4-row micro-batches, still whole groups
    "OOM in phase 4, whole groups": (["--micro-batch-size", "8"],
                                     lambda n, grad, training: training and grad and n >= 3),
}


@pytest.mark.parametrize("algo", ["pacs", "grpo", "ppo"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_where_the_weights_have_not_moved_the_log_ratio_is_exactly_zero_under_bf16(wide_model, tmp_path, monkeypatch,
                                                                                  capsys, algo, route):
    flags, strike = ROUTES[route]
    oom = out_of_memory_once(monkeypatch, strike) if strike else None
    calls, rows = run_recording(wide_model, tmp_path, monkeypatch, "--algo", algo, "--autocast", "bf16", *flags)
    if oom is not None:
        assert oom["done"] and "[memory] out of memory" in capsys.readouterr().out
    assert len(calls) >= M  # at least one loss call per mini-batch
    for logprobs, old, mask in calls:
        real = mask.bool()
        assert torch.equal(logprobs[real], old[real]), f"{algo}, {route}: pi_theta != pi_old at lr 0"
    if algo == "pacs":
        assert all(r["psi_std"] == 0.0 and r["sigma_psi"] == 0.5 for r in rows)
        assert all(r["critic_shift"] == 0.0 for r in rows)
    if algo == "ppo":
        assert all(r["value_clip_frac"] == 0.0 for r in rows)


def test_the_routes_do_round_differently_in_bf16(wide_model):
    """What the test above guards against is real at this width: the shared-prompt route and full rows give
    log-probs that differ in bf16 (and agree in fp32), on torch's vectorised CPU kernels (AVX2, AVX-512, NEON, ...).
    Its scalar kernels (ATEN_CPU_CAPABILITY=default) round both routes alike here: nothing to show there."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("ATEN_CPU_CAPABILITY=default: the scalar kernels round both routes alike at this width")
    model, tok = plumbing.load_model(wide_model)
    torch.manual_seed(0)
    prompts = [plumbing.build_prompt(tok, "12 + 7 ="), plumbing.build_prompt(tok, "3 + 4 =")]
    roll = pacs.sample(model, tok, prompts, group_size=G, max_new_tokens=12, temperature=1.5)
    rows = plumbing.rollout_rows(roll, slice(0, 2 * G))
    for dtype, equal in ((torch.bfloat16, False), (None, True)):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype is not None):
            shared, _ = pacs.response_logprobs(model, *rows, group_size=G, shared_prompt=True)
            full, _ = pacs.response_logprobs(model, *rows, group_size=G, shared_prompt=False)
        if equal:
            torch.testing.assert_close(shared, full, atol=1e-5, rtol=1e-5)
        else:
            assert not torch.equal(shared, full)
