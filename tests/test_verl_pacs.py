"""examples/verl_pacs.py in verl's own training engine, on the CPU: the update it makes equals pacs.py's, on one
data-parallel rank and on two.

One fixed rollout (tests/trl_fixed_rollout.py: 4 prompts x G = 4, mixed, all-wrong and truncated responses) goes
through the path a verl run takes (tests/verl_on_cpu.py): verl's trainer config (hydra,
verl/trainer/config/ppo_trainer.yaml) with the settings docs/porting.md prescribes, the actor worker verl's trainer
starts (engine_workers.ActorRolloutRefWorker, role actor: a TrainingWorker over the FSDP2 engine), pi_old from that
worker's compute_log_prob, the advantages from the registered estimator `pacs_label`, and update_actor ->
train_mini_batch -> train_batch -> forward_backward_batch -> ppo_loss -> the registered loss `pacs`. Two
mini-batches of 2 prompts, micro-batches of one group, plain SGD at lr 1; the second mini-batch is scored after the
first update (psi's std ~1.5: the critic acts). pacs.train_step trains a plain HF copy on the same rollout.

One rank: this process, a gloo group of one; the engine sums two micro-batch losses per step. Two ranks: two
processes of one gloo group (tests/verl_on_cpu.py run as a script), each batch cut between them as verl's dispatch
cuts it, FSDP2 sharding the model over both and averaging their gradients; each rank's micro-batch is one group of
the global mini-batch of 2. The row orders verl's trainers make by balancing lengths across ranks come from the
trainers' own code, and the plugin refuses them.

verl has no CPU platform: tests/verl_on_cpu.py registers one (the test's, not the plugin's). The run is FSDP2 (FSDP1
refuses CPU parameters with sync_module_states), fp32 mixed precision (else the forward autocasts to bf16), eager
attention, no torch.compile. Skips without verl: pip install -r examples/requirements-verl.txt && pip install
--no-deps verl==0.9.1.
"""
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

INSTALL = "pip install -r examples/requirements-verl.txt && pip install --no-deps verl==0.9.1"
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason=f"verl is not installed: {INSTALL}"),
              pytest.mark.usefixtures("verl_one_rank")]  # every test: verl resolves its platform once, to this one

from trl_fixed_rollout import PROBLEMS, RecordingSGD, make_rollout, patch_pacs  # noqa: E402
from verl_on_cpu import ACTOR, LR, G, M, balanced_rows, run_verl, verl_batch, verl_config, verl_on_cpu  # noqa: E402

import pacs  # noqa: E402
import plumbing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))


@pytest.fixture(scope="module")
def verl_one_rank():
    """verl's engine on the CPU in this process for this module: one gloo process group (rank 0 of 1). Undone at
    the end (the process group destroyed, env, platform and patch restored)."""
    import torch.distributed as dist
    with verl_on_cpu():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def run_pacs(model_dir, table, monkeypatch):
    """pacs.train_step on the same rollout (plain HF model, SGD at lr 1): (gradients, weights after, metrics,
    the prompts in the order pacs.py trained them)."""
    model, tokenizer = plumbing.load_model(model_dir, "cpu", torch.float32)
    patch_pacs(monkeypatch, tokenizer, table, G)
    cfg = pacs.Config(model=model_dir, dataset="synthetic", prompts_per_step=len(PROBLEMS), group_size=G,
                      num_mini_batches=M, micro_batch_size=G, max_new_tokens=64, lr=LR, device="cpu", eval_every=0)
    plumbing.check_config(cfg)
    opt = RecordingSGD(model.parameters(), LR)
    metrics, _ = pacs.train_step(cfg, model, tokenizer, opt, PROBLEMS, 0, torch.device("cpu"))
    order = [PROBLEMS[i] for i in plumbing.batch_indices(0, len(PROBLEMS), len(PROBLEMS), cfg.seed)]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return opt.grads, weights, metrics, order


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """pacs.py's update and the rollout: (grads, weights, metrics, order, tokenizer, table)."""
    from transformers import AutoTokenizer
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    table = make_rollout(tokenizer, G, 12)
    with pytest.MonkeyPatch.context() as mp:
        grads, weights, metrics, order = run_pacs(tiny_model_dir, table, mp)
    return grads, weights, metrics, order, tokenizer, table


def assert_same_update(grads, weights, pacs_grads, pacs_weights, label):
    """verl's gradient of each optimizer step and its weights after them equal pacs.py's, in float32."""
    assert len(grads) == len(pacs_grads) == M
    for m in range(M):
        err = ((grads[m] - pacs_grads[m]).norm() / pacs_grads[m].norm()).item()
        print(f"{label} mini-batch {m}: |g_verl - g_pacs| / |g_pacs| = {err:.1e}, "
              f"max |diff| {(grads[m] - pacs_grads[m]).abs().max().item():.1e}")  # pytest -s shows it
        assert pacs_grads[m].norm() > 0
        assert err <= 1e-5, f"{label} mini-batch {m}"
    assert weights.keys() == pacs_weights.keys()
    worst = max((weights[k] - pacs_weights[k]).abs().max().item() for k in weights)
    print(f"{label} weights after both steps: max |w_verl - w_pacs| = {worst:.1e}")
    assert worst <= 1e-5


def assert_critic_acts(metrics):
    """pi_old is the actor's: psi is exactly 0 on the first mini-batch, the critic acts on the second; the logged
    loss is the global mini-batch's mean of w * BCE: ln 2 where psi = 0."""
    assert metrics["pacs/psi_std"][0] == 0 and metrics["pacs/psi_std"][1] > 0.05
    assert metrics["loss"][0] == pytest.approx(np.log(2), abs=1e-6)


@pytest.mark.parametrize("remove_padding", [True, False], ids=["remove-padding", "padded"])
def test_verl_engine_update_equals_pacs(reference, tiny_model_dir, remove_padding):
    from verl.utils.import_utils import import_external_libs
    import_external_libs("verl_pacs")  # what `import verl` does with VERL_USE_EXTERNAL_MODULES=verl_pacs
    pacs_grads, pacs_weights, pacs_metrics, order, tokenizer, table = reference
    cfg = verl_config(tiny_model_dir, remove_padding)
    grads, weights, metrics = run_verl(cfg, tokenizer, table, order)
    assert_same_update(grads, weights, pacs_grads, pacs_weights, "remove-padding" if remove_padding else "padded")
    assert_critic_acts(metrics)
    assert pacs_metrics["psi_std"] > 0.05


def run_two_ranks(model_dir, out, prompts, rows=None):
    """tests/verl_on_cpu.py as a script: two data-parallel ranks, two processes of one gloo group; what rank 0
    saved."""
    cmd = [sys.executable, os.path.join(ROOT, "tests", "verl_on_cpu.py"), "--model-dir", model_dir, "--out",
           str(out), "--ranks", "2", "--order", ",".join(map(str, prompts))]
    cmd += [] if rows is None else ["--rows", ",".join(map(str, rows))]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out, weights_only=False)


def test_two_ranks_update_equals_pacs_on_the_global_batch(reference, tiny_model_dir, tmp_path):
    """Two data-parallel ranks in verl's engine (FSDP2 sharding the model over two gloo processes, settings
    trainer.n_gpus_per_node=2 trainer.use_v1=False trainer.balance_batch=False): the same update as pacs.train_step
    on the whole rollout in one process. verl's dispatch hands rank r the r-th half of the rollout and each rank
    cuts its half into mini-batches of ppo_mini_batch_size / 2 prompts, so global mini-batch m is every rank's m-th
    group: with the prompts in the order o0, o2, o1, o3 it holds the 2 prompts of pacs.py's mini-batch m. The loss's
    scale (b * dp_size / global_batch_size) undoes the average FSDP's reduce-scatter takes over the ranks."""
    pacs_grads, pacs_weights, _, order, _, _ = reference
    two = run_two_ranks(tiny_model_dir, tmp_path / "two_ranks.pt", [PROBLEMS.index(order[i]) for i in (0, 2, 1, 3)])
    assert two["ranks"] == 2 and two["backend"] == "gloo"
    assert_same_update(two["grads"], two["weights"], pacs_grads, pacs_weights, "2 ranks")
    assert_critic_acts(two["metrics"])


@pytest.mark.parametrize("trainer, ranks", [("v1", 2), ("v1", 4), ("legacy", 2), ("legacy", 1)])
def test_estimator_refuses_the_orders_verl_balancing_makes(reference, tiny_model_dir, trainer, ranks):
    """verl's trainers balance sequence lengths across the data-parallel ranks with their own _balance_batch (run
    here from their source): the V1 trainer at every step, the legacy one with trainer.balance_batch=True (which
    also reorders rows within a rank). The order each makes of this rollout splits groups, and the estimator, which
    sees the rows in that order before any update, refuses it with one line."""
    import verl_pacs
    _, _, _, order, tokenizer, table = reference
    cfg = verl_config(tiny_model_dir)
    batch = verl_batch(tokenizer, table, order)
    rows = balanced_rows(batch, cfg, ranks, trainer)
    assert sorted(rows) == list(range(len(PROBLEMS) * G)) and rows != sorted(rows)
    rewards, mask = batch.batch["token_level_rewards"][rows], batch.batch["response_mask"][rows]  # (B, T)
    with pytest.raises(ValueError, match="not groups of 4 adjacent rows"):
        verl_pacs.pacs_label_advantage(rewards, mask, index=batch.non_tensor_batch["uid"][rows], config=cfg.algorithm)


def test_v1_balancing_on_one_rank_keeps_the_order(reference, tiny_model_dir):
    """The plugin's one-GPU setting, the V1 trainer's default: its balancing over one rank is the identity."""
    import verl_pacs
    _, _, _, order, tokenizer, table = reference
    cfg = verl_config(tiny_model_dir)
    batch = verl_batch(tokenizer, table, order)
    assert balanced_rows(batch, cfg, 1, "v1") == list(range(len(PROBLEMS) * G))
    advantages, _ = verl_pacs.pacs_label_advantage(batch.batch["token_level_rewards"], batch.batch["response_mask"],
                                                   index=batch.non_tensor_batch["uid"], config=cfg.algorithm)
    assert advantages.shape == batch.batch["response_mask"].shape


REFUSED = [
    ([f"{ACTOR}.shuffle=True"], "shuffle=True"),
    ([f"{ACTOR}.use_dynamic_bsz=True"], "use_dynamic_bsz=True"),
    ([f"{ACTOR}.ppo_micro_batch_size_per_gpu=6"], "not a multiple of rollout.n=4"),
    ([f"{ACTOR}.use_kl_loss=True"], "no KL or entropy term"),
    ([f"{ACTOR}.ppo_mini_batch_size={len(PROBLEMS)}"], "one optimizer step per rollout"),
    (["algorithm.rollout_correction.bypass_mode=True"], "bypass_mode=True"),
    # several data-parallel ranks: a trainer that balances lengths, a mini-batch the ranks cannot share in groups
    (["trainer.n_gpus_per_node=2", "trainer.use_v1=True"], "use_v1=True on 2 data-parallel ranks"),
    (["trainer.use_v1=False", "trainer.balance_batch=True"], "balance_batch=True reorders rows"),
    (["trainer.n_gpus_per_node=4", "trainer.use_v1=False", "trainer.balance_batch=False"],
     "ppo_mini_batch_size=2 is not a multiple of the 4 data-parallel ranks"),
]


@pytest.mark.parametrize("overrides, message", REFUSED, ids=[m for _, m in REFUSED])
def test_estimator_refuses_settings_that_break_pacs(tiny_model_dir, overrides, message):
    """On the driver, from the trainer config, at the first rollout: before any update."""
    import verl_pacs
    cfg = verl_config(tiny_model_dir, overrides=overrides)
    B, T = len(PROBLEMS) * G, 3
    rewards = torch.zeros(B, T)  # (B, T)
    rewards[::2, -1] = 1.0
    uids = np.array([f"prompt{i // G}" for i in range(B)], dtype=object)
    with pytest.raises(ValueError, match=message):
        verl_pacs.pacs_label_advantage(rewards, torch.ones(B, T), index=uids, config=cfg.algorithm)


@pytest.mark.parametrize("overrides, message", REFUSED[:4], ids=[m for _, m in REFUSED[:4]])
def test_loss_refuses_actor_settings_that_break_pacs(tiny_model_dir, overrides, message):
    """In the workers, from the actor config every loss call gets (verl builds it with hydra's instantiate)."""
    import verl_pacs
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass
    extra = [f"{ACTOR}.ppo_max_token_len_per_gpu=64"] if "dynamic" in message else []
    actor = omega_conf_to_dataclass(verl_config(tiny_model_dir, overrides=overrides + extra).actor_rollout_ref.actor)
    lp = torch.zeros(G, 3)  # (b, T)
    with pytest.raises(ValueError, match=message):
        get_policy_loss_fn("pacs")(old_log_prob=lp, log_prob=lp, advantages=lp, response_mask=torch.ones(G, 3),
                                   loss_agg_mode="token-mean", config=actor, rollout_is_weights=None)
    assert get_policy_loss_fn("pacs").__module__ == verl_pacs.__name__


def test_estimator_refuses_non_binary_rewards_and_split_groups(tiny_model_dir):
    import verl_pacs
    cfg = verl_config(tiny_model_dir)
    B, T = len(PROBLEMS) * G, 3
    grouped = np.array([f"prompt{i // G}" for i in range(B)], dtype=object)
    rewards = torch.zeros(B, T)  # (B, T)
    rewards[0, -1] = 0.5
    with pytest.raises(ValueError, match=r"rewards in \{0, 1\}"):
        verl_pacs.pacs_label_advantage(rewards, torch.ones(B, T), index=grouped, config=cfg.algorithm)
    rewards[0, -1] = 1.0
    balanced = grouped[np.r_[0:B:2, 1:B:2]]  # two ranks' partitions, as the V1 trainer's balancing can cut them
    with pytest.raises(ValueError, match="not groups of 4 adjacent rows"):
        verl_pacs.pacs_label_advantage(rewards, torch.ones(B, T), index=balanced, config=cfg.algorithm)
    advantages, returns = verl_pacs.pacs_label_advantage(rewards, torch.ones(B, T), index=grouped,
                                                         config=cfg.algorithm)
    assert torch.equal(advantages, returns) and advantages[0].tolist() == [1.0] * T and advantages[1].sum() == 0


def test_estimator_refuses_a_rollout_the_ranks_cannot_share(tiny_model_dir):
    """verl's dispatch cuts a rollout into equal contiguous shares, one per data-parallel rank: 3 prompts on 2 ranks
    would split a group. The ranks are the GPUs over the sequence-parallel size (the engine's data-parallel size):
    2 GPUs of one sequence-parallel pair are one rank, whose V1 balancing keeps the order."""
    import verl_pacs
    T = 3

    def estimate(prompts, cfg):
        uids = np.array([f"prompt{i // G}" for i in range(prompts * G)], dtype=object)
        rewards = torch.zeros(prompts * G, T)  # (B, T)
        return verl_pacs.pacs_label_advantage(rewards, torch.ones(prompts * G, T), index=uids, config=cfg.algorithm)

    two_ranks = verl_config(tiny_model_dir, ranks=2)
    estimate(4, two_ranks)
    with pytest.raises(ValueError, match="a rollout of 3 prompts on 2 data-parallel ranks"):
        estimate(3, two_ranks)
    one_rank_on_two_gpus = verl_config(tiny_model_dir, overrides=[
        "trainer.n_gpus_per_node=2", f"{ACTOR}.ulysses_sequence_parallel_size=2", "trainer.use_v1=True"])
    estimate(3, one_rank_on_two_gpus)


def test_loss_refuses_advantages_that_are_not_labels(tiny_model_dir):
    import verl_pacs  # noqa: F401
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.utils.config import omega_conf_to_dataclass
    actor = omega_conf_to_dataclass(verl_config(tiny_model_dir).actor_rollout_ref.actor)
    actor.global_batch_info.update(dp_size=1, global_batch_size=G)  # as ppo_loss sets it before the call
    lp = torch.zeros(G, 3)  # (b, T)
    grpo_like = torch.full((G, 3), -0.87)  # (b, T): a normalised advantage, not a 0/1 label
    with pytest.raises(ValueError, match="adv_estimator=pacs_label"):
        get_policy_loss_fn("pacs")(old_log_prob=lp, log_prob=lp, advantages=grpo_like, response_mask=torch.ones(G, 3),
                                   loss_agg_mode="token-mean", config=actor, rollout_is_weights=None)
