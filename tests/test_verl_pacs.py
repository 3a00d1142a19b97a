"""examples/verl_pacs.py in verl's own training engine, on the CPU: the update it makes equals pacs.py's.

One fixed rollout (tests/trl_fixed_rollout.py: 4 prompts x G = 4, mixed, all-wrong and truncated responses) goes
through the path a verl run takes: verl's trainer config (hydra, verl/trainer/config/ppo_trainer.yaml) with the
settings docs/porting.md prescribes, the actor worker verl's trainer starts (engine_workers.ActorRolloutRefWorker,
role actor: a TrainingWorker over the FSDP2 engine), pi_old from that worker's compute_log_prob, the advantages from
the registered estimator `pacs_label`, and update_actor -> train_mini_batch -> train_batch -> forward_backward_batch
-> ppo_loss -> the registered loss `pacs`. Two mini-batches of 2 prompts, micro-batches of one group (so the engine
sums two micro-batch losses per step), plain SGD at lr 1; the second mini-batch is scored after the first update
(psi's std ~1.5: the critic acts). pacs.train_step trains a plain HF copy on the same rollout in the same order.

verl has no CPU platform, so this file registers one with verl's platform layer (PlatformCPU below: the test's,
not the plugin's); VERL_ENGINE_DEVICE=cuda finds the FSDP engine, which is registered for cuda and npu only. The
run is FSDP2 (FSDP1 refuses CPU parameters with sync_module_states), fp32 mixed precision (else the forward
autocasts to bf16), eager attention, no torch.compile. Skips without verl: pip install -r
examples/requirements-verl.txt && pip install --no-deps verl==0.9.1.
"""
import contextlib
import importlib.util
import os
import sys
import types

import numpy as np
import pytest
import torch

INSTALL = "pip install -r examples/requirements-verl.txt && pip install --no-deps verl==0.9.1"
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason=f"verl is not installed: {INSTALL}"),
              pytest.mark.usefixtures("verl_on_cpu")]  # every test: verl resolves its platform once, to this one

from trl_fixed_rollout import PROBLEMS, RecordingSGD, make_rollout, patch_pacs, prompt_ids  # noqa: E402

import pacs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
G, M, LR = 4, 2, 1.0


def cpu_device_module():
    """What verl asks of torch.cuda, answered for the CPU: no device memory to report, nothing to synchronise."""
    mod = types.ModuleType("verl_cpu_device")
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(mod, name, lambda *a, **k: 0)
    for name in ("empty_cache", "synchronize", "reset_peak_memory_stats", "set_device", "manual_seed",
                 "manual_seed_all"):
        setattr(mod, name, lambda *a, **k: None)
    mod.is_available, mod.device_count = (lambda: True), (lambda: 1)
    mod.current_device, mod.get_device_name = (lambda: "cpu"), (lambda *a: "CPU")
    mod.mem_get_info = lambda *a: (0, 0)
    return mod


def cpu_platform():
    """An instance of a CPU platform for verl's platform layer (verl.plugin.platform), registered as 'cpu'.
    current_device() is "cpu": verl moves micro-batches with .to(get_device_id())."""
    from verl.plugin.platform import PlatformBase, PlatformRegistry

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: cpu_device_module())

        def is_available(self): return True
        def current_device(self): return "cpu"
        def device_count(self): return 1
        def set_device(self, device_index): pass
        def synchronize(self, device_index=None): pass
        def manual_seed(self, seed): torch.manual_seed(seed)
        def manual_seed_all(self, seed): torch.manual_seed(seed)
        def set_allocator_settings(self, settings): pass
        def empty_cache(self): pass
        def get_device_capability(self, device_index=0): return None, None
        def communication_backend_name(self): return "gloo"
        def visible_devices_envvar(self): return "CUDA_VISIBLE_DEVICES"
        def profiler_start(self): pass
        def profiler_stop(self): pass
        def ray_resource_name(self): return "CPU"
        def ray_noset_envvars(self): return []
        def is_ipc_supported(self): return False
        def cudart(self): return None

        @contextlib.contextmanager
        def nvtx_range(self, msg):
            yield

    return PlatformCPU()


@pytest.fixture(scope="module")
def verl_on_cpu():
    """verl's engine on the CPU for this module: the platform, one gloo process (rank 0 of 1), the env a Ray
    worker would have. Undone at the end (the process group destroyed, env, platform and patch restored)."""
    import torch.distributed as dist
    import verl.plugin.platform.platform_manager as platforms
    with pytest.MonkeyPatch.context() as mp:
        for key, value in dict(VERL_ENGINE_DEVICE="cuda", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                               MASTER_ADDR="127.0.0.1", MASTER_PORT="0").items():
            mp.setenv(key, value)
        # verl's platform singleton (what set_platform sets), before verl.workers.engine reads the device name
        mp.setattr(platforms, "_current_platform", cpu_platform())
        import verl.models.transformers.monkey_patch as verl_patches
        # verl 0.9.1 patches TRL's value-head model whenever trl is importable, from a module trl 1.16 (this
        # project's TRL pin) no longer has; the actor never uses it
        mp.setattr(verl_patches, "is_trl_available", lambda: False)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def verl_config(model_dir, remove_padding=True, overrides=()):
    """verl's trainer config (its own ppo_trainer.yaml through hydra) with the plugin's settings
    (docs/porting.md), the CPU's, and SGD at lr 1 without clipping so that gradients can be compared."""
    import verl
    from hydra import compose, initialize_config_dir
    actor = "actor_rollout_ref.actor"
    settings = [
        "algorithm.adv_estimator=pacs_label", f"{actor}.policy_loss.loss_mode=pacs",
        f"data.train_batch_size={len(PROBLEMS)}", f"actor_rollout_ref.rollout.n={G}",
        f"{actor}.ppo_mini_batch_size={len(PROBLEMS) // M}", f"{actor}.ppo_micro_batch_size_per_gpu={G}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={G}",
        f"{actor}.shuffle=False", f"{actor}.use_dynamic_bsz=False", f"{actor}.use_kl_loss=False",
        f"{actor}.entropy_coeff=0", f"{actor}.optim.clip_grad=1e9", "algorithm.use_kl_in_reward=False",
        # the CPU: FSDP2, fp32 compute, eager attention, no torch.compile
        f"{actor}.strategy=fsdp2", f"+{actor}.fsdp_config.mixed_precision.param_dtype=fp32",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        f"{actor}.use_torch_compile=False", f"{actor}.fsdp_config.use_torch_compile=False",
        # the comparison: plain SGD, the model of this test
        f"{actor}.optim.optimizer=SGD", f"{actor}.optim.lr={LR}", f"{actor}.optim.weight_decay=0",
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.model.use_remove_padding={remove_padding}",
        *overrides]
    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=settings)


def verl_batch(tokenizer, table, order):
    """The rollout as verl's agent loop hands it to the trainer: left-padded prompts, right-padded responses,
    G adjacent rows per prompt sharing a uid, the reward on each response's last token."""
    from verl import DataProto
    from verl.utils.model import compute_position_id_with_mask
    pad = tokenizer.pad_token_id
    rows = [(list(prompt_ids(tokenizer, p["problem"])), resp, r)
            for p in order for resp, r in table[prompt_ids(tokenizer, p["problem"])]]
    Lp, T, B = max(len(q) for q, _, _ in rows), max(len(a) for _, a, _ in rows), len(rows)
    prompts = torch.tensor([[pad] * (Lp - len(q)) + q for q, _, _ in rows])  # (B, Lp)
    responses = torch.tensor([a + [pad] * (T - len(a)) for _, a, _ in rows])  # (B, T)
    response_mask = torch.tensor([[1] * len(a) + [0] * (T - len(a)) for _, a, _ in rows])  # (B, T)
    attention = torch.cat([(prompts != pad).long(), response_mask], 1)  # (B, Lp + T)
    scores = torch.zeros(B, T)  # (B, T)
    scores[torch.arange(B), response_mask.sum(1) - 1] = torch.tensor([r for _, _, r in rows])
    tensors = {"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], 1),
               "attention_mask": attention, "position_ids": compute_position_id_with_mask(attention),
               "response_mask": response_mask, "token_level_rewards": scores}
    uids = np.array([f"prompt{i // G}" for i in range(B)], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uids}, meta_info={"temperature": 1.0})


def run_verl(cfg, tokenizer, table, order):
    """One rollout through verl's actor worker: (gradient of each optimizer step, weights after, metrics)."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    batch = verl_batch(tokenizer, table, order)
    # pi_old: the actor's log-probs right after sampling (RayPPOTrainer._compute_old_log_prob)
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    batch.batch["old_log_probs"] = no_padding_2_padding(tu.get(worker.compute_log_prob(td), "log_probs"), td).float()
    # the registered estimator, called with the keywords compute_advantage (ray_trainer.py) gives it
    advantages, returns = get_adv_estimator_fn(cfg.algorithm.adv_estimator)(
        token_level_rewards=batch.batch["token_level_rewards"], response_mask=batch.batch["response_mask"],
        config=cfg.algorithm, index=batch.non_tensor_batch["uid"])
    batch.batch["advantages"], batch.batch["returns"] = advantages, returns
    # the update, with the meta-data RayPPOTrainer._update_actor attaches
    actor = cfg.actor_rollout_ref.actor
    rows = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=rows, mini_batch_size=rows,
                         epochs=actor.ppo_epochs, seed=actor.data_loader_seed,
                         dataloader_kwargs={"shuffle": actor.shuffle}, compute_loss=True)
    grads = []  # the gradient each optimizer step applies (FSDP2: DTensors)
    engine.optimizer.register_step_pre_hook(lambda *_: grads.append(
        torch.cat([p.grad.full_tensor().reshape(-1).clone() for p in engine.module.parameters()])))
    metrics = tu.get(worker.update_actor(td), "metrics")
    weights = {name: p.full_tensor().detach().clone() for name, p in engine.module.named_parameters()}
    return grads, weights, metrics


def run_pacs(model_dir, table, monkeypatch):
    """pacs.train_step on the same rollout (plain HF model, SGD at lr 1): (gradients, weights after, metrics,
    the prompts in the order pacs.py trained them)."""
    model, tokenizer = pacs.load_model(model_dir, "cpu", torch.float32)
    patch_pacs(monkeypatch, tokenizer, table, G)
    cfg = pacs.Config(model=model_dir, dataset="synthetic", prompts_per_step=len(PROBLEMS), group_size=G,
                      num_mini_batches=M, micro_batch_size=G, max_new_tokens=64, lr=LR, device="cpu", eval_every=0)
    pacs.check_config(cfg)
    opt = RecordingSGD(model.parameters(), LR)
    metrics, _ = pacs.train_step(cfg, model, tokenizer, opt, PROBLEMS, 0, torch.device("cpu"))
    order = [PROBLEMS[i] for i in pacs.batch_indices(0, len(PROBLEMS), len(PROBLEMS), cfg.seed)]
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


@pytest.mark.parametrize("remove_padding", [True, False], ids=["remove-padding", "padded"])
def test_verl_engine_update_equals_pacs(reference, tiny_model_dir, remove_padding):
    from verl.utils.import_utils import import_external_libs
    import_external_libs("verl_pacs")  # what `import verl` does with VERL_USE_EXTERNAL_MODULES=verl_pacs
    pacs_grads, pacs_weights, pacs_metrics, order, tokenizer, table = reference
    cfg = verl_config(tiny_model_dir, remove_padding)
    grads, weights, metrics = run_verl(cfg, tokenizer, table, order)
    assert len(grads) == len(pacs_grads) == M
    for m in range(M):
        err = ((grads[m] - pacs_grads[m]).norm() / pacs_grads[m].norm()).item()
        print(f"{'remove-padding' if remove_padding else 'padded'} mini-batch {m}: |g_verl - g_pacs| / |g_pacs| = "
              f"{err:.1e}, max |diff| {(grads[m] - pacs_grads[m]).abs().max().item():.1e}")  # pytest -s shows it
        assert pacs_grads[m].norm() > 0
        assert err <= 1e-5, f"mini-batch {m}"
    assert weights.keys() == pacs_weights.keys()
    worst = max((weights[k] - pacs_weights[k]).abs().max().item() for k in weights)
    print(f"weights after both steps: max |w_verl - w_pacs| = {worst:.1e}")
    assert worst <= 1e-5
    # pi_old is the actor's: psi is exactly 0 on the first mini-batch, the critic acts on the second
    assert metrics["pacs/psi_std"][0] == 0 and metrics["pacs/psi_std"][1] > 0.05 and pacs_metrics["psi_std"] > 0.05
    # the logged loss is the mini-batch's mean of w * BCE: ln 2 where psi = 0
    assert metrics["loss"][0] == pytest.approx(np.log(2), abs=1e-6)


ACTOR = "actor_rollout_ref.actor"
REFUSED = [
    ([f"{ACTOR}.shuffle=True"], "shuffle=True"),
    ([f"{ACTOR}.use_dynamic_bsz=True"], "use_dynamic_bsz=True"),
    ([f"{ACTOR}.ppo_micro_batch_size_per_gpu=6"], "not a multiple of rollout.n=4"),
    ([f"{ACTOR}.use_kl_loss=True"], "no KL or entropy term"),
    ([f"{ACTOR}.ppo_mini_batch_size={len(PROBLEMS)}"], "one optimizer step per rollout"),
    (["algorithm.rollout_correction.bypass_mode=True"], "bypass_mode=True"),
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
