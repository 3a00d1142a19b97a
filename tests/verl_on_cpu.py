"""verl's training engine on the CPU, for tests/test_verl_pacs.py: a CPU platform for verl's platform layer, verl's
trainer config with examples/verl_pacs.py's settings, the fixed rollout (tests/trl_fixed_rollout.py) as verl's
batch, the row orders verl's trainers make (their own balancing code), and one rollout through verl's actor worker
on each data-parallel rank.

Run as a script, it starts the ranks as processes of one gloo group (a FileStore: no port to pick) and rank 0
writes what the update did:
    python tests/verl_on_cpu.py --model-dir DIR --out grads.pt --ranks 2 --order 0,2,1,3
"""
import argparse
import ast
import contextlib
import math
import os
import pickle
import sys
import tempfile
import types
from unittest import mock

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "examples"))

from trl_fixed_rollout import PROBLEMS, make_rollout, prompt_ids  # noqa: E402

G, M, LR = 4, 2, 1.0  # group size, optimizer steps per rollout, SGD's lr
ACTOR = "actor_rollout_ref.actor"


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


@contextlib.contextmanager
def verl_on_cpu(rank=0, world_size=1):
    """verl's engine on the CPU in this process: the CPU platform, the env a Ray worker of rank `rank` would have.
    The caller makes the process group. Undone on exit (env, platform and patch restored)."""
    import verl.models.transformers.monkey_patch as verl_patches
    import verl.plugin.platform.platform_manager as platforms
    env = dict(VERL_ENGINE_DEVICE="cuda", RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    # VERL_ENGINE_DEVICE=cuda finds the FSDP engine (registered for cuda and npu only); verl's platform singleton
    # (what set_platform sets) before verl.workers.engine reads the device name; verl 0.9.1 patches TRL's value-head
    # model whenever trl is importable, from a module trl 1.16 (this project's pin) no longer has: the actor never
    # uses it
    with mock.patch.dict(os.environ, env), mock.patch.object(platforms, "_current_platform", cpu_platform()), \
            mock.patch.object(verl_patches, "is_trl_available", lambda: False):
        yield


def verl_config(model_dir, remove_padding=True, overrides=(), ranks=1):
    """verl's trainer config (its own ppo_trainer.yaml through hydra) with the plugin's settings for `ranks`
    data-parallel ranks (docs/porting.md), the CPU's, and SGD at lr 1 without clipping so that gradients can be
    compared; `overrides` (hydra's key=value) replace them."""
    import verl
    from hydra import compose, initialize_config_dir
    settings = [
        "algorithm.adv_estimator=pacs_label", f"{ACTOR}.policy_loss.loss_mode=pacs",
        f"data.train_batch_size={len(PROBLEMS)}", f"actor_rollout_ref.rollout.n={G}",
        f"{ACTOR}.ppo_mini_batch_size={len(PROBLEMS) // M}", f"{ACTOR}.ppo_micro_batch_size_per_gpu={G}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={G}",
        f"{ACTOR}.shuffle=False", f"{ACTOR}.use_dynamic_bsz=False", f"{ACTOR}.use_kl_loss=False",
        f"{ACTOR}.entropy_coeff=0", f"{ACTOR}.optim.clip_grad=1e9", "algorithm.use_kl_in_reward=False",
        f"trainer.n_gpus_per_node={ranks}", "trainer.nnodes=1",
        *(["trainer.use_v1=False", "trainer.balance_batch=False"] if ranks > 1 else []),
        # the CPU: FSDP2, fp32 compute, eager attention, no torch.compile
        f"{ACTOR}.strategy=fsdp2", f"+{ACTOR}.fsdp_config.mixed_precision.param_dtype=fp32",
        "+actor_rollout_ref.model.override_config.attn_implementation=eager",
        f"{ACTOR}.use_torch_compile=False", f"{ACTOR}.fsdp_config.use_torch_compile=False",
        # the comparison: plain SGD, the model of this test
        f"{ACTOR}.optim.optimizer=SGD", f"{ACTOR}.optim.lr={LR}", f"{ACTOR}.optim.weight_decay=0",
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.model.use_remove_padding={remove_padding}"]
    overridden = {o.split("=")[0].lstrip("+") for o in overrides}  # hydra refuses a key given twice
    settings = [s for s in settings if s.split("=")[0].lstrip("+") not in overridden] + list(overrides)
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


def trainer_method(module, cls, name):
    """verl's own method `cls.name` from verl/trainer/ppo/`module`, compiled alone: importing its module needs
    packages the actor does not (transfer_queue for the V1 trainer, torchdata for the legacy one)."""
    import verl
    from verl import DataProto
    from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions, log_seqlen_unbalance
    from verl.utils.transferqueue_utils import KVBatchMeta
    path = os.path.join(os.path.dirname(verl.__file__), "trainer", "ppo", module)
    with open(path) as f:
        tree = ast.parse(f.read())
    owner = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    method = next(n for n in owner.body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = dict(torch=torch, math=math, DataProto=DataProto, KVBatchMeta=KVBatchMeta,
                     calculate_workload=calculate_workload, log_seqlen_unbalance=log_seqlen_unbalance,
                     get_seqlen_balanced_partitions=get_seqlen_balanced_partitions,
                     upsample_batch_to_divisible_size=upsample_batch_to_divisible_size)
    exec(compile(ast.Module(body=[method], type_ignores=[]), path, "exec"), namespace)
    return namespace[name]


def balanced_rows(batch, cfg, dp_size, trainer):
    """The row order verl's trainer hands to dispatch after balancing the batch by sequence length across dp_size
    ranks (row indices into `batch`), made by the trainer's own _balance_batch: "v1" (v1/trainer_base.py, at every
    step) or "legacy" (ray_trainer.py, with trainer.balance_batch=True)."""
    wg = types.SimpleNamespace(_dispatch_info={"actor": list(range(dp_size))})
    if trainer == "legacy":
        rows = batch.select_idxs(list(range(len(batch))))
        rows.batch["row"] = torch.arange(len(batch))  # (B,)
        this = types.SimpleNamespace(_get_dp_size=lambda *_: dp_size, actor_rollout_wg=wg, config=cfg)
        trainer_method("ray_trainer.py", "RayPPOTrainer", "_balance_batch")(this, rows, metrics={})
        return rows.batch["row"].tolist()
    # the V1 trainer's tag seq_len: the prompt's and the response's tokens, unpadded
    rows = KVRows(range(len(batch)), [{"seq_len": n} for n in batch.batch["attention_mask"].sum(-1).tolist()])
    this = types.SimpleNamespace(actor_rollout_wg=wg, config=cfg, use_critic=False, global_steps=1,
                                 tokenizer=types.SimpleNamespace(eos_token_id=None))
    multiple = trainer_method("v1/trainer_base.py", "PPOTrainer", "_get_required_batch_multiple")
    this._get_required_batch_multiple = lambda dp: multiple(this, dp)
    trainer_method("v1/trainer_base.py", "PPOTrainer", "_balance_batch")(this, rows, metrics={})
    return rows.keys


class KVRows:
    """What the V1 trainer's balancing uses of transfer_queue's KVBatchMeta: a key and a tag per row."""

    def __init__(self, keys, tags):
        self.keys, self.tags = list(keys), list(tags)

    def __len__(self):
        return len(self.keys)

    def reorder(self, indices):
        self.keys, self.tags = [self.keys[i] for i in indices], [self.tags[i] for i in indices]


def dispatch(td, rank):
    """This rank's share of a batch the driver sends to the actor worker group: verl's dispatch (decorator.py,
    make_nd_compute_dataproto_dispatch_fn) cuts it into dp_size contiguous chunks, chunk r to dp rank r, and Ray's
    object store carries it there pickled (which also unlocks the chunk, consolidated and locked by chunk)."""
    import torch.distributed as dist
    from verl.protocol import BatchData
    return pickle.loads(pickle.dumps(BatchData(td).chunk(dist.get_world_size())[rank]))


def collect(td):
    """The driver's view of a worker group's output: every rank's chunk, concatenated in rank order (verl's
    collect_nd_compute_dataproto); here gathered onto every rank, which then plays the driver."""
    import torch.distributed as dist
    from verl.protocol import BatchData
    chunks = [None] * dist.get_world_size()
    dist.all_gather_object(chunks, td)
    return BatchData(chunks).concat()


def run_verl(cfg, tokenizer, table, order, rows=None):
    """One rollout through verl's actor worker on this process's rank, the driver's part done identically on every
    rank: (gradient of each optimizer step, weights after, metrics of this rank). rows: the order in which the
    trainer hands the rollout's rows to dispatch (a trainer's balancing), row indices; None: the rollout's order."""
    import torch.distributed as dist
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker
    from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding
    rank = dist.get_rank()
    worker = ActorRolloutRefWorker(cfg.actor_rollout_ref, role="actor")
    worker.init_model()
    engine = worker.actor.engine
    batch = verl_batch(tokenizer, table, order)
    if rows is not None:
        batch.reorder(torch.tensor(rows))
    # pi_old: the actor's log-probs right after sampling (RayPPOTrainer._compute_old_log_prob)
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=True, compute_loss=False)
    log_probs = tu.get(collect(worker.compute_log_prob(dispatch(td, rank))), "log_probs")
    batch.batch["old_log_probs"] = no_padding_2_padding(log_probs, td).float()
    # the registered estimator on the whole rollout, called with the keywords compute_advantage gives it
    advantages, returns = get_adv_estimator_fn(cfg.algorithm.adv_estimator)(
        token_level_rewards=batch.batch["token_level_rewards"], response_mask=batch.batch["response_mask"],
        config=cfg.algorithm, index=batch.non_tensor_batch["uid"])
    batch.batch["advantages"], batch.batch["returns"] = advantages, returns
    # the update, with the meta-data RayPPOTrainer._update_actor attaches
    actor = cfg.actor_rollout_ref.actor
    mini_batch_rows = actor.ppo_mini_batch_size * cfg.actor_rollout_ref.rollout.n
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=False, global_batch_size=mini_batch_rows,
                         mini_batch_size=mini_batch_rows, epochs=actor.ppo_epochs, seed=actor.data_loader_seed,
                         dataloader_kwargs={"shuffle": actor.shuffle}, compute_loss=True)
    grads = []  # the gradient each optimizer step applies, whole (FSDP2 shards it: DTensors)
    engine.optimizer.register_step_pre_hook(lambda *_: grads.append(
        torch.cat([p.grad.full_tensor().reshape(-1).clone() for p in engine.module.parameters()])))
    metrics = tu.get(worker.update_actor(dispatch(td, rank)), "metrics")
    weights = {name: p.full_tensor().detach().clone() for name, p in engine.module.named_parameters()}
    return grads, weights, metrics


def run_rank(rank, world_size, store_path, model_dir, order, rows, out):
    """One data-parallel rank (a process of torch.multiprocessing.spawn): rank 0 saves what the update did."""
    import torch.distributed as dist
    from transformers import AutoTokenizer
    from verl.utils.import_utils import import_external_libs
    torch.set_num_threads(1)
    with verl_on_cpu(rank, world_size):
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world_size), rank=rank,
                                world_size=world_size)
        try:
            import_external_libs("verl_pacs")  # what `import verl` does with VERL_USE_EXTERNAL_MODULES=verl_pacs
            tokenizer = AutoTokenizer.from_pretrained(model_dir)
            table = make_rollout(tokenizer, G, 12)
            cfg = verl_config(model_dir, ranks=world_size)
            grads, weights, metrics = run_verl(cfg, tokenizer, table, [PROBLEMS[i] for i in order], rows)
            if rank == 0:
                torch.save({"grads": grads, "weights": weights, "metrics": metrics, "ranks": world_size,
                            "backend": dist.get_backend()}, out)
        finally:
            dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True, help="rank 0 writes the gradients, weights and metrics here")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--order", default="0,1,2,3", help="the prompts of the rollout, in this order")
    parser.add_argument("--rows", default=None, help="the order of its rows at dispatch (default: the rollout's)")
    args = parser.parse_args()
    order = [int(i) for i in args.order.split(",")]
    rows = None if args.rows is None else [int(i) for i in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(run_rank, nprocs=args.ranks, args=(
            args.ranks, os.path.join(tmp, "store"), args.model_dir, order, rows, args.out))


if __name__ == "__main__":
    main()
