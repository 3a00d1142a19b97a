"""examples/trl_pacs.py: PACS inside TRL's GRPOTrainer gives the update pacs.py gives, on one and two processes."""
import os
import socket
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("trl", reason="TRL is not installed: pip install -r examples/requirements.txt")

from trl_fixed_rollout import PROBLEMS, make_rollout, run_pacs, run_trl  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
G = 4


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    from transformers import AutoTokenizer
    return make_rollout(AutoTokenizer.from_pretrained(tiny_model_dir), G, 12)


@pytest.mark.parametrize("num_mini_batches", [1, 2])
def test_same_gradient_as_pacs_train_step(tiny_model_dir, rollout, tmp_path, monkeypatch, num_mini_batches):
    """One rollout of 4 prompts x G=4, micro-batches of one group. M=1: one optimizer step over 4 accumulated
    micro-batches (psi = 0). M=2: the second mini-batch, trained after the first update, psi != 0 (critic)."""
    torch.set_num_threads(1)
    lr = 1.0  # SGD: the second mini-batch's psi std is ~1.5 on the tiny model (the critic clearly active)
    pacs_grads, metrics, order = run_pacs(tiny_model_dir, rollout, G, num_mini_batches, lr, monkeypatch)
    trl_grads, trainer = run_trl(tiny_model_dir, rollout, order, G, per_device=G,
                                 grad_accum=len(PROBLEMS) // num_mini_batches, num_mini_batches=num_mini_batches,
                                 lr=lr, out_dir=str(tmp_path))
    assert len(pacs_grads) == len(trl_grads) == num_mini_batches
    for m in range(num_mini_batches):
        err = rel_err(trl_grads[m], pacs_grads[m])
        print(f"M={num_mini_batches} mini-batch {m}: |g_trl - g_pacs| / |g_pacs| = {err:.1e}")  # pytest -s shows it
        assert pacs_grads[m].norm() > 0
        assert err <= 1e-5, f"mini-batch {m}"
    if num_mini_batches == 2:  # the critic was active: psi of the second mini-batch is far from 0
        assert metrics["psi_std"] > 0.05
        psi_std = [row["pacs/psi_std"] for row in trainer.state.log_history if "pacs/psi_std" in row]
        print(f"psi std per mini-batch (TRL): {psi_std}")
        assert psi_std[0] < 1e-4 < 0.05 < psi_std[1]
        # the critic's AUC on mini-batch 1, pooled over its pairs as pacs.py pools it (none on mini-batch 0)
        auc = [row.get("pacs/critic_auc") for row in trainer.state.log_history if "pacs/psi_std" in row]
        assert auc[0] is None and auc[1] == pytest.approx(metrics["critic_auc"], abs=1e-6) and metrics["critic_pairs"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_processes(script_and_args, attempts=3):
    """`accelerate launch` of two CPU processes on a free port. The port is free when picked, then released for
    torchrun to bind seconds later (5 to 8 s on a loaded 2-core machine): a socket that takes it meanwhile without
    listening (a connection's local port) makes the bind fail with EADDRINUSE, and only then is the launch retried
    on another port. (A listening socket is caught by accelerate, which then picks a port itself.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    for _ in range(attempts):
        port = free_port()
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), *script_and_args]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stderr:
            return proc
        warnings.warn(f"port {port} was taken before torchrun bound it (EADDRINUSE): launching again")
    return proc


def test_two_processes_same_update_as_one(tiny_model_dir, rollout, tmp_path):
    """Two CPU processes (gloo): each holds 2 of the 4 groups, M = 2 optimizer steps of one group per process;
    the same gradients as one process training on the same groups, where mini-batch m holds process 0's and
    process 1's m-th group (rollout order 0, 2, 1, 3). Launched with `accelerate launch --multi_gpu
    --num_processes 2` (torchrun) and the trainer's use_cpu=True: `accelerate launch --cpu` hands a
    multi-process CPU run to mpirun and, without it, starts a single process."""
    out = tmp_path / "grads.pt"
    proc = launch_two_processes([os.path.join(ROOT, "tests", "trl_fixed_rollout.py"), "--model-dir", tiny_model_dir,
                                 "--out", str(out), "--group-size", str(G), "--per-device", str(G),
                                 "--grad-accum", "1", "--num-mini-batches", "2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    two = torch.load(out)
    assert two["num_processes"] == 2 and two["backend"] == "gloo"
    torch.set_num_threads(1)
    one, _ = run_trl(tiny_model_dir, rollout, [PROBLEMS[i] for i in (0, 2, 1, 3)], G, per_device=G, grad_accum=2,
                     num_mini_batches=2, lr=1.0, out_dir=str(tmp_path / "one"))
    assert len(one) == len(two["grads"]) == 2
    for m in range(2):
        err = rel_err(two["grads"][m], one[m])
        print(f"2 processes vs 1, mini-batch {m}: relative gradient difference {err:.1e}")
        assert err <= 1e-5, f"mini-batch {m}"


def test_shuffle_groups_keeps_groups_whole():
    from trl_pacs import shuffle_groups
    torch.manual_seed(0)
    n = 6 * G
    batch = {"completion_ids": torch.arange(n)[:, None].repeat(1, 3), "pacs_group_ids": torch.arange(n) // G,
             "num_items_in_batch": torch.tensor(7), "rows": list(range(n))}
    out = shuffle_groups(batch, G)
    groups = out["pacs_group_ids"].view(-1, G)
    assert (groups == groups[:, :1]).all()  # every block of G rows is one group
    assert sorted(out["rows"]) == list(range(n)) and out["rows"] != list(range(n))  # a permutation, not the identity
    assert torch.equal(out["completion_ids"][:, 0], torch.tensor(out["rows"]))  # all per-row fields move together
    assert out["num_items_in_batch"].item() == 7


@pytest.mark.parametrize("overrides, message", [
    ({"per_device_train_batch_size": 6}, "not a multiple of num_generations"),
    ({"beta": 0.04}, "TRL's KL coefficient"),
    ({"steps_per_generation": 3}, "set num_mini_batches"),
    ({"mask_truncated_completions": True}, "mask_truncated_completions"),
    ({"pacs_estimator": "gae"}, "pacs_estimator"),
])
def test_config_refuses_settings_that_break_pacs(tmp_path, overrides, message):
    from trl_pacs import PACSConfig
    kwargs = {"output_dir": str(tmp_path), "use_cpu": True, "bf16": False, "report_to": "none",
              "activation_checkpointing": False, "num_generations": G, "per_device_train_batch_size": G, **overrides}
    with pytest.raises(ValueError, match=message):
        PACSConfig(**kwargs)


def test_refuses_rewards_outside_0_1(tiny_model_dir, rollout, tmp_path):
    with pytest.raises(ValueError, match=r"rewards in \{0, 1\}"):
        run_trl(tiny_model_dir, rollout, PROBLEMS, G, per_device=G, grad_accum=4, num_mini_batches=1, lr=1.0,
                out_dir=str(tmp_path), reward_override=0.5)
