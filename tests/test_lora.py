"""--lora-rank: PACS with a peft LoRA adapter on a frozen base, on the CPU with tiny Qwen2 models built from a config.

The adapter's gradient is autograd's through W + (alpha / r) B A; only the adapter moves and sits in AdamW; psi is
exactly 0 at --lr 0 under bf16 autocast with a bf16 base and a non-zero adapter on every route (peft starts B at 0,
where the adapter adds exactly 0 and such a test could not fail, so these tests draw B at random); a reset copies the
adapter and clears AdamW; a resume continues exactly; an adapter checkpoint evaluates as its merged export does.
"""
import copy
import dataclasses
import json
import os

import pytest
import torch

import pacs
import plumbing
from conftest import make_tiny_model_dir
from test_pacs import TIMING_KEYS
import conftest

G, P, M = 4, 4, 2  # 16 rows, mini-batches of 8 rows (two groups)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):  # hidden 128: the routes round differently in bf16 (tests/test_numerics.py)
    return make_tiny_model_dir(tmp_path_factory.mktemp("wide_lora"), chars="0123456789 +?=", hidden=128)


def strip_timing(row):
    return {k: v for k, v in row.items() if k not in TIMING_KEYS}


def randomize_adapter(model, seed=1):
    """Draw every LoRA A and B at random (peft's B = 0 would make the adapter add exactly nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def lora_cfg(model_dir, **kw):
    return pacs.Config(model=model_dir, lora_rank=4, group_size=G, prompts_per_step=P, num_mini_batches=M, **kw)


def test_the_adapters_gradient_is_autograd_through_w_plus_ba(digit_model, digit_rollout):
    roll, rewards = digit_rollout
    cfg = lora_cfg(digit_model, lora_alpha=6.0)
    base, _ = plumbing.load_model(digit_model)
    peft_model = randomize_adapter(plumbing.add_adapter(cfg, copy.deepcopy(base))).train()
    # the same function written out: each target Linear's weight is W + (alpha / r) B A, A and B leaves
    plain, scale, leaves = copy.deepcopy(base).train(), 6.0 / 4, {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            A = module.lora_A["default"].weight.detach().clone().requires_grad_(True)
            B = module.lora_B["default"].weight.detach().clone().requires_grad_(True)
            target = plain.get_submodule(name.removeprefix("base_model.model."))
            W = target.weight.detach()
            del target.weight
            leaves[name] = (A, B, target, W)
    plain.requires_grad_(False)

    def loss_of(model):
        for A, B, target, W in leaves.values():
            target.weight = W + scale * B @ A
        b = roll["response_ids"].shape[0]
        lp, _ = pacs.response_logprobs(model, *plumbing.rollout_rows(roll, slice(0, b)), group_size=4)
        mask = roll["response_mask"].float()
        return pacs.pacs_loss(lp, lp.detach() - 0.05 * mask, mask, rewards, 4)  # psi != 0: the critic acts

    loss_of(peft_model).backward()
    loss_of(plain).backward()
    assert len(leaves) == 2 * 7  # 2 layers x q, k, v, o, gate, up, down
    for name, (A, B, _, _) in leaves.items():
        module = peft_model.get_submodule(name)
        torch.testing.assert_close(module.lora_A["default"].weight.grad, A.grad, rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(module.lora_B["default"].weight.grad, B.grad, rtol=1e-4, atol=1e-7)
    assert all(p.grad is None for n, p in peft_model.named_parameters() if "lora_" not in n)  # the base: no grad


def test_only_the_adapter_moves_and_only_it_sits_in_adamw(digit_model, const7_file, tmp_path):
    cfg = pacs.parse_args(["--model", digit_model, "--dataset", const7_file, "--out-dir", str(tmp_path),
                           "--steps", "2",
                           "--group-size", "8", "--prompts-per-step", "8", "--num-mini-batches", "2",
                           "--max-new-tokens", "2", "--lr", "1e-2", "--eval-every", "0", "--lora-rank", "4",
                           "--temperature", "1.5"])
    model = pacs.train(cfg)
    base, _ = plumbing.load_model(digit_model)
    trained = {n.removeprefix("base_model.model.").replace(".base_layer", ""): p
               for n, p in model.named_parameters() if "lora_" not in n}
    assert trained.keys() == dict(base.named_parameters()).keys()
    for name, p in base.named_parameters():
        assert torch.equal(trained[name], p), f"{name}: the frozen base moved"
    lora_B = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_B and any(p.abs().max() > 0 for p in lora_B)  # peft starts B at 0: the adapter moved
    optimizer = pacs.make_optimizer(cfg, model)
    in_adamw = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_adamw == {id(p) for n, p in model.named_parameters() if "lora_" in n}


def run_recording(model_dir, out_dir, monkeypatch, *extra, steps=1, refs=None):
    """pacs.main for `steps` steps at --lr 0 with a random adapter; every pacs_loss input and the base's dtypes
    recorded, and in refs (a list) whether each step's phase 3 scored r_hat against a frozen pi_ref."""
    calls, real_loss, real_add, dtypes = [], pacs.algo_loss, plumbing.add_adapter, set()
    real_reference = pacs.reference_logprobs

    def reference_logprobs(cfg, model, ref_model, *args, **kwargs):
        (refs if refs is not None else []).append(ref_model is not None)
        return real_reference(cfg, model, ref_model, *args, **kwargs)

    def algo_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages=None):
        calls.append((logprobs.detach().clone(), old_logprobs.clone(), mask.clone()))
        return real_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages)

    def add_adapter(cfg, model, checkpoint=None):
        peft_model = randomize_adapter(real_add(cfg, model, checkpoint))
        dtypes.update(p.dtype for p in peft_model.parameters() if not p.requires_grad)
        return peft_model

    monkeypatch.setattr(pacs, "algo_loss", algo_loss)
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(lambda texts, answers: torch.tensor(
        [float(i % 2) for i in range(len(texts))])))
    monkeypatch.setattr(plumbing, "add_adapter", add_adapter)
    monkeypatch.setattr(pacs, "reference_logprobs", reference_logprobs)
    pacs.main(["--model", model_dir, "--dataset", "synthetic", "--out-dir", str(out_dir), "--group-size", str(G),
               "--prompts-per-step", str(P), "--num-mini-batches", str(M), "--max-new-tokens", "10",
               "--temperature", "1.5", "--lr", "0", "--weight-decay", "0", "--steps", str(steps), "--eval-every", "0",
               "--log-samples-every", "0", "--save-every", "0", "--save-minutes", "0", "--lora-rank", "4",
               "--autocast", "bf16", "--rollout-dtype", "bf16", *extra])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return calls, [json.loads(line) for line in f], dtypes


ROUTES = {"shared prompt, whole groups": ["--micro-batch-size", "8"],
          "split groups": ["--micro-batch-size", "2"],
          "gradient checkpointing": ["--micro-batch-size", "8", "--gradient-checkpointing"],
          "full rows": ["--micro-batch-size", "8", "--full-rows"],
          "frozen pi_ref (--ref-reset-every 0)": ["--micro-batch-size", "8", "--ref-reset-every", "0"],
          # the decoder layers compiled, the adapter's Linears inside them (PACS only: a compile takes ~30 s)
          "compiled layers, full rows": ["--micro-batch-size", "8", "--full-rows", "--compile-layers"]}


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # torch's own
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("algo", ["pacs", "grpo", "reinforce"])
def test_psi_is_exactly_zero_at_lr_0_with_a_random_adapter_on_a_bf16_base(wide_model, tmp_path, monkeypatch, route,
                                                                          algo):
    if algo != "pacs" and ("pi_ref" in route or "compiled" in route):
        pytest.skip("--ref-reset-every is PACS's; one compiled run is enough")
    # the frozen pi_ref is pi_old at step 0 (train_loop passes it from step 1 on): that route runs 3 steps, so that
    # phase 3 scores r_hat against the frozen copy, a module of its own whose forward must equal pi_theta's
    steps, refs = (3 if "pi_ref" in route else 1), []
    calls, rows, dtypes = run_recording(wide_model, tmp_path, monkeypatch, "--algo", algo, *ROUTES[route],
                                        steps=steps, refs=refs)
    assert dtypes == {torch.bfloat16}  # the base stored in bf16, as --rollout-dtype bf16 (CUDA's auto) keeps it
    assert len(calls) >= M * steps and len(rows) == steps
    assert refs == ([False, True, True] if "pi_ref" in route else [False])
    for logprobs, old, mask in calls:
        assert torch.equal(logprobs[mask.bool()], old[mask.bool()]), f"{route}: pi_theta != pi_old at lr 0"
        assert logprobs[mask.bool()].abs().max() > 0
    if algo == "pacs":
        assert all(r["psi_std"] == 0.0 and r["sigma_psi"] == 0.5 for r in rows)


def adapter_gradients(model_dir, roll, rewards, checkpointing, reentrant_without_hook=False):
    """The adapter's gradient of PACS's loss on the rollout's rows, on full rows (the route checkpointing takes) with
    a random adapter, psi != 0. reentrant_without_hook: transformers' reentrant checkpointing and no input hook."""
    cfg = lora_cfg(model_dir, gradient_checkpointing=checkpointing and not reentrant_without_hook, full_rows="on")
    model, _, _, sizes = plumbing.setup_model(cfg, model_dir, torch.device("cpu"))
    randomize_adapter(model).train()
    if reentrant_without_hook:  # in place of plumbing.enable_checkpointing: transformers hooks the input, unhooked
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True})
        model.disable_input_require_grads()
        cfg.gradient_checkpointing = True  # the route: full rows, as with the flag
    b, mask = roll["response_ids"].shape[0], roll["response_mask"].float()
    lp, _ = pacs.response_logprobs(model, *plumbing.rollout_rows(roll, slice(0, b)),
                                   **plumbing.step_route(cfg, slice(0, b), sizes))
    pacs.pacs_loss(lp, lp.detach() - 0.05 * mask, mask, rewards, G).backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_checkpointing_gives_the_adapter_the_gradient_it_gets_without(digit_model, digit_rollout):
    roll, rewards = digit_rollout
    plain = adapter_gradients(digit_model, roll, rewards, checkpointing=False)
    checkpointed = adapter_gradients(digit_model, roll, rewards, checkpointing=True)
    assert plain.keys() == checkpointed.keys() and len(plain) == 2 * 7 * 2  # A and B of 14 Linears
    for name, grad in plain.items():
        assert grad is not None and grad.abs().max() > 0, name
        # the recompute repeats the forward's fp32 arithmetic on the CPU: the same gradient (measured: bit-equal)
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-6, atol=1e-9)
    # what enable_checkpointing's explicit settings guard: reentrant checkpointing with the embedding's output not
    # requiring grad (a frozen base) runs each layer without a graph, so the adapter gets no gradient: here nothing
    # of the loss requires one and backward refuses (with a trained head or embedding the adapter's would be None)
    with pytest.raises(RuntimeError, match="does not require grad"), \
            pytest.warns(UserWarning, match="None of the inputs have requires_grad=True. Gradients will be None"):
        adapter_gradients(digit_model, roll, rewards, checkpointing=True, reentrant_without_hook=True)


def test_the_random_adapter_does_change_the_policy(wide_model):
    # what makes the test above able to fail: the drawn adapter moves the log-probs away from the base's
    base, tok = plumbing.load_model(wide_model)
    peft_model = randomize_adapter(plumbing.add_adapter(lora_cfg(wide_model), copy.deepcopy(base)))
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert (peft_model(input_ids=ids).logits - base(input_ids=ids).logits).abs().max() > 1e-2


def test_a_reset_copies_the_adapter_and_clears_adamw_on_a_shared_base(wide_model):
    cfg = lora_cfg(wide_model, ref_reset_every=2, lr=1e-2)
    model, _, _, _ = plumbing.setup_model(cfg, wide_model, torch.device("cpu"))
    ref = plumbing.frozen_copy(model)
    shared = [p for p in ref.parameters() if any(p is q for q in model.parameters())]
    assert shared and all(not p.requires_grad for p in shared)  # the base is one set of tensors
    assert len(shared) == sum(not p.requires_grad for p in model.parameters())
    optimizer = pacs.make_optimizer(cfg, model, fused=False)
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    optimizer.step()
    lora = lambda m: {n: p.detach().clone() for n, p in m.named_parameters() if "lora_" in n}  # noqa: E731
    assert any(not torch.equal(a, b) for a, b in zip(lora(model).values(), lora(ref).values()))
    assert optimizer.state
    assert pacs.reset_reference(cfg, 1, model, ref, optimizer) is False  # not a reset step
    assert pacs.reset_reference(cfg, 2, model, ref, optimizer) is True
    assert all(torch.equal(a, b) for a, b in zip(lora(model).values(), lora(ref).values()))
    assert not optimizer.state
    assert ref.get_decoder().layers[0].self_attn.q_proj.base_layer.weight is \
        model.get_decoder().layers[0].self_attn.q_proj.base_layer.weight


def test_a_resume_continues_exactly(digit_model, const7_file, tmp_path):
    # pi_ref is reset at steps 0 and 3 (K = 3) and the run is cut after step 1: the resumed step 2 scores r_hat
    # against the pi_ref the checkpoint restores (step 0's adapter, not the resumed one), which a resume must not lose
    argv = ["--model", digit_model, "--dataset", const7_file, "--group-size", "8", "--prompts-per-step", "8",
            "--num-mini-batches", "2", "--max-new-tokens", "2", "--lr", "1e-2", "--eval-every", "0",
            "--lora-rank", "4", "--temperature", "1.5", "--ref-reset-every", "3", "--log-samples-every", "0"]
    straight = tmp_path / "straight"
    pacs.main(argv + ["--out-dir", str(straight), "--steps", "4"])
    cut = tmp_path / "cut"
    pacs.main(argv + ["--out-dir", str(cut), "--steps", "2"])  # killed after step 1's checkpoint: resumed at 2
    pacs.main(argv + ["--out-dir", str(cut), "--steps", "4", "--resume"])
    read = lambda d: [strip_timing(json.loads(line)) for line in open(d / "metrics.jsonl")]  # noqa: E731
    assert len(read(cut)) == 4 and read(cut) == read(straight)
    # the wrong kind of checkpoint, or another prompt, is refused in one line before anything loads
    no_lora = [a for a in argv if a not in ("--lora-rank", "4")]
    for extra, needle in ((no_lora, "holds a LoRA adapter: resume with the run's --lora-rank"),
                          (argv + ["--prompt", "v2"], "trained with another prompt .*--prompt 'official' there")):
        with pytest.raises(SystemExit, match=needle):
            pacs.main(extra + ["--out-dir", str(cut), "--steps", "5", "--resume"])
    with pytest.raises(SystemExit, match="is a LoRA checkpoint: continue its run with --resume"):
        pacs.main(no_lora + ["--model", str(cut / "checkpoint-000003"), "--out-dir", str(tmp_path / "x")])
    assert os.path.isfile(cut / "checkpoint-000003" / "adapter_model.safetensors")
    assert not os.path.isfile(cut / "checkpoint-000003" / "model.safetensors")  # the adapter alone


def test_an_adapter_checkpoint_evaluates_as_its_merged_export(digit_model, const7_file, tmp_path):
    pacs.main(["--model", digit_model, "--dataset", const7_file, "--out-dir", str(tmp_path / "run"), "--steps", "2",
               "--group-size", "8", "--prompts-per-step", "8", "--num-mini-batches", "2", "--max-new-tokens", "2",
               "--lr", "1e-2", "--eval-every", "0", "--lora-rank", "4", "--temperature", "1.5"])
    checkpoint = str(tmp_path / "run" / "checkpoint-000001")
    plumbing.main(["merge", checkpoint, str(tmp_path / "merged")])
    assert not os.path.isfile(tmp_path / "merged" / "adapter_config.json")
    adapter, tok = plumbing.load_model(checkpoint)  # eval.py's loader: the base the adapter names, then the adapter
    merged, _ = plumbing.load_model(str(tmp_path / "merged"))
    assert plumbing.is_adapter(adapter) and not plumbing.is_adapter(merged)
    shape = lambda c: (c.model_type, c.hidden_size, c.num_hidden_layers, c.vocab_size)  # noqa: E731
    assert shape(plumbing.load_model_config(checkpoint)) == shape(merged.config)  # an adapter's config: its base's
    prompts = [plumbing.build_prompt(tok, f"{i} + {7 - i} =") for i in range(8)]
    a = pacs.sample(adapter, tok, prompts, 1, 12, greedy=True)
    b = pacs.sample(merged, tok, prompts, 1, 12, greedy=True)
    assert torch.equal(a["response_ids"], b["response_ids"])  # greedy tokens equal
    rows = plumbing.rollout_rows(a, slice(0, len(prompts)))
    with torch.no_grad():
        lp_a, _ = pacs.response_logprobs(adapter, *rows)
        lp_b, _ = pacs.response_logprobs(merged, *rows)
    # the merge's rounding: W + s B A rounded once to fp32 (relative 2^-24 per weight) against x W + s (x A) B;
    # through 2 layers and a softmax, log-probs agree to 1e-5 (measured: ~1e-6)
    assert (lp_a - lp_b).abs().max() <= 1e-5
    assert (lp_a - pacs.response_logprobs(plumbing.load_model(digit_model)[0], *rows)[0]).abs().max() > 1e-3
    # eval.py on the adapter checkpoint and on its export: the same seeded samples, problem by problem
    import eval as pacs_eval
    for name, model in (("eval_adapter", checkpoint), ("eval_merged", str(tmp_path / "merged"))):
        pacs_eval.main(["--model", model, "--datasets", const7_file, "--n", "2", "--k", "1", "--temperature", "1.0",
                        "--max-new-tokens", "6", "--batch-size", "8", "--device", "cpu",
                        "--out", str(tmp_path / name)])
    rows = [[json.loads(line)["responses"] for line in open(tmp_path / name / "samples.jsonl")]
            for name in ("eval_adapter", "eval_merged")]
    assert rows[0] == rows[1] and len(rows[0]) == 8


def test_bad_lora_input_gets_one_line(digit_model, wide_model, tmp_path, capsys):
    common = ["--model", digit_model, "--dataset", "synthetic", "--out-dir", str(tmp_path / "x"), "--steps", "1",
              "--device", "cpu"]
    for extra, needle in ((["--lora-rank", "-1"], "--lora-rank and --lora-alpha must be >= 0"),
                          (["--lora-rank", "4", "--lora-targets", "q_proj,qkv_proj"],
                           "--lora-targets qkv_proj: Qwen2ForCausalLM has no Linear of that name"),
                          (["--lora-rank", "4", "--algo", "ppo"], "PPO's value model is a second full model")):
        with pytest.raises(SystemExit, match=needle):
            pacs.main(common + extra)
    # an adapter checkpoint of another base: made on digit_model (hidden 64), pointed at wide_model (hidden 128)
    base, _ = plumbing.load_model(digit_model)
    plumbing.add_adapter(lora_cfg(digit_model), base).save_pretrained(tmp_path / "adapter")
    with pytest.raises(plumbing.ConfigError, match=r"the adapter in .* does not fit .*size mismatch"):
        plumbing.add_adapter(lora_cfg(wide_model), plumbing.load_model(wide_model)[0], str(tmp_path / "adapter"))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == os.path.abspath(digit_model)
    with pytest.raises(plumbing.ConfigError, match="resume with those --lora-\\* flags"):
        plumbing.add_adapter(pacs.Config(lora_rank=8), plumbing.load_model(digit_model)[0], str(tmp_path / "adapter"))
    with pytest.raises(SystemExit, match="holds no adapter"):
        plumbing.main(["merge", digit_model, str(tmp_path / "m")])


def test_the_plan_prices_the_frozen_base_and_the_fp32_adapter(digit_model):
    cfg = lora_cfg(digit_model)
    base, _ = plumbing.load_model(digit_model)
    peft_model = plumbing.add_adapter(cfg, base)
    n_adapter = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    n_base = sum(p.numel() for p in peft_model.parameters() if not p.requires_grad)
    assert plumbing.adapter_parameters(base.config, cfg) == n_adapter
    for device_type, base_bytes in (("cuda", 2), ("cpu", 4)):  # the rollout dtype: bf16 on CUDA, fp32 on the CPU
        parts = plumbing.memory_plan(cfg, base.config, n_base, device_type, 4, 1)
        assert parts["frozen base"] == base_bytes * n_base and parts["rollout copy"] == 0  # generate: this model
        assert (parts["weights (fp32)"], parts["AdamW moments (fp32)"], parts["gradients (fp32)"]) == (
            4 * n_adapter, 8 * n_adapter, 4 * n_adapter)
        assert parts["reference copy (fp32)"] == 0
    ref = plumbing.memory_plan(dataclasses.replace(cfg, ref_reset_every=0), base.config, n_base, "cuda", 4, 1)
    assert ref["reference copy (fp32)"] == 4 * n_adapter  # pi_ref: the adapter's copy, not a second model


@pytest.mark.parametrize("base_dtype,autocast", [("bf16", "bf16"), ("fp32", "off"), ("fp32", "bf16"),
                                                 ("bf16", "off")])
@pytest.mark.parametrize("full_rows", [False, True])
def test_the_plan_bounds_what_autograd_saves_with_an_adapter(digit_model, digit_rollout, base_dtype, autocast,
                                                             full_rows):
    # torch's own saved tensors of a LoRA micro-batch (autocast's weight copies counted apart), against the plan's
    # activations and masks: an upper bound on every dtype road (the CUDA road is bf16 and bf16)
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import plan_terms
    roll, _ = digit_rollout
    b, T = roll["response_ids"].shape
    cfg = lora_cfg(digit_model, autocast=autocast, rollout_dtype=base_dtype,
                   max_prompt_tokens=roll["prompt_ids"].shape[1], max_new_tokens=T,
                   full_rows="on" if full_rows else "off")
    base, _ = plumbing.load_model(digit_model, dtype=torch.bfloat16 if base_dtype == "bf16" else torch.float32)
    model = randomize_adapter(plumbing.add_adapter(cfg, base)).train()
    hooks, saved = plan_terms.saved_tensors(model)
    with hooks, plumbing.autocast_context(cfg, torch.device("cpu")):
        pacs.response_logprobs(model, *plumbing.rollout_rows(roll, slice(0, b)),
                               **plumbing.step_route(cfg, slice(0, b), plumbing.Sizes.typed(cfg)))
    activations, masks, _ = plan_terms.split(saved, model)
    n_base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    plan = plumbing.memory_plan(cfg, model.config, n_base, "cpu", b, 1)
    planned = plan["activations of a micro-batch"] + plan["attention masks (SDPA)"]
    assert activations + masks <= planned <= 3 * (activations + masks), (activations + masks, planned)


def test_a_lora_checkpoint_never_looks_its_base_up_on_the_hub(digit_model, tmp_path, monkeypatch):
    # peft's save_embedding_layers="auto" asks the hub for a base named by a hub id: with no network (or a slow one)
    # every save would wait on it. The adapter's embeddings never train: checkpoints say so.
    import peft.utils.save_and_load as save_and_load

    def no_hub(*args, **kwargs):
        raise AssertionError("a checkpoint save asked the hub")

    monkeypatch.setattr(save_and_load, "check_file_exists_on_hf_hub", no_hub)
    cfg = lora_cfg(digit_model, out_dir=str(tmp_path), ref_reset_every=0)
    model = plumbing.add_adapter(cfg, plumbing.load_model(digit_model)[0])
    model.peft_config["default"].base_model_name_or_path = "Qwen/Qwen2.5-0.5B-Instruct"  # a hub id, as users pass
    optimizer = pacs.make_optimizer(cfg, model, fused=False)
    _, tok = plumbing.load_model(digit_model)
    path = plumbing.save_checkpoint(cfg, model, tok, optimizer, 0, ref_model=plumbing.frozen_copy(model))
    assert os.path.isfile(os.path.join(path, "adapter_model.safetensors"))


def test_setup_model_puts_the_adapter_on_the_model_it_is_given(digit_model):
    # benchmarks/gpu_step.py hands setup_model a stand-in's directory while --model names the hub model: that
    # directory is the base (only a checkpoint of --model, with its trainer_state.pt, is a resume)
    cfg = lora_cfg("Qwen/Qwen2.5-0.5B-Instruct")
    model, rollout, _, _ = plumbing.setup_model(cfg, digit_model, torch.device("cpu"))
    assert plumbing.is_adapter(model) and rollout is model
    assert model.get_base_model().name_or_path == os.path.abspath(digit_model)


def test_all_linear_wraps_what_peft_wraps_every_linear_but_the_head(digit_model):
    from peft import LoraConfig, get_peft_model
    base, _ = plumbing.load_model(digit_model)
    ours = plumbing.add_adapter(lora_cfg(digit_model, lora_targets="all-linear"), copy.deepcopy(base))
    with plumbing.peft_quietly():
        peft_own = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    wrapped = lambda m: sorted(n for n, mod in m.named_modules() if hasattr(mod, "lora_A"))  # noqa: E731
    assert wrapped(ours) == wrapped(peft_own) and len(wrapped(ours)) == 2 * 7
    assert not any("lm_head" in n for n in wrapped(ours))
    # on Qwen2 all-linear is the default's seven projections, and the plan counts the same adapter
    assert plumbing.lora_targets("all-linear", base) == sorted(plumbing.LORA_TARGETS.split(","))
    n_adapter = sum(p.numel() for n, p in ours.named_parameters() if "lora_" in n)
    assert plumbing.adapter_parameters(base.config, lora_cfg(digit_model, lora_targets="all-linear")) == n_adapter


def make_adapter_checkpoint(base_dir, out, seed=1):
    """A --lora-rank checkpoint's files (adapter, tokenizer) on base_dir, with a random adapter (B != 0)."""
    base, tok = plumbing.load_model(base_dir)
    randomize_adapter(plumbing.add_adapter(lora_cfg(base_dir), base), seed).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def test_merge_writes_the_bases_own_dtype_unless_asked_for_fp32(digit_model, tmp_path):
    from safetensors.torch import load_file
    base, tok = plumbing.load_model(digit_model)
    bf16_base = tmp_path / "bf16_base"
    base.to(torch.bfloat16).save_pretrained(bf16_base)  # config.json's dtype: bfloat16, as Qwen's hub checkpoints
    tok.save_pretrained(bf16_base)
    checkpoint = make_adapter_checkpoint(str(bf16_base), tmp_path / "adapter")
    plumbing.main(["merge", checkpoint, str(tmp_path / "merged")])
    plumbing.main(["merge", checkpoint, str(tmp_path / "merged32"), "--fp32"])
    merged, merged32 = (load_file(tmp_path / d / "model.safetensors") for d in ("merged", "merged32"))
    assert {t.dtype for t in merged.values()} == {torch.bfloat16}
    assert {t.dtype for t in merged32.values()} == {torch.float32}
    # the bf16 merge is W + (alpha / r) B A rounded once to bf16: the fp32 merge rounded (W is bf16 in both)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(merged[name], merged32[name].to(torch.bfloat16))
    adapter = plumbing.load_model(checkpoint, dtype=torch.float32)[0]
    q = adapter.base_model.model.model.layers[0].self_attn.q_proj
    by_hand = q.base_layer.weight + 2.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(merged32[name], by_hand, rtol=1e-6, atol=1e-7)
    assert not torch.equal(merged32[name], q.base_layer.weight)  # the adapter added something


def test_a_checkpoint_whose_base_moved_loads_with_base(digit_model, const7_file, tmp_path, capsys):
    import shutil
    import eval as pacs_eval
    moved = tmp_path / "base_here_first"
    shutil.copytree(digit_model, moved)
    checkpoint = make_adapter_checkpoint(str(moved), tmp_path / "adapter")
    assert plumbing.adapter_base(checkpoint) == str(moved)  # the absolute path of the machine it was trained on
    shutil.rmtree(moved)  # another machine: the recorded base is not there
    evaluate = ["--model", checkpoint, "--datasets", const7_file, "--n", "1", "--k", "1", "--max-new-tokens", "4",
                "--device", "cpu", "--out", str(tmp_path / "eval")]
    for main, argv in ((pacs_eval.main, evaluate), (plumbing.main, ["merge", checkpoint, str(tmp_path / "m")])):
        with pytest.raises(SystemExit, match=r"adapter was trained on .*base_here_first, which is not here: pass the "
                                             r"base model with --base"):
            main(argv)
    pacs_eval.main(evaluate + ["--base", digit_model])
    plumbing.main(["merge", checkpoint, str(tmp_path / "m"), "--base", digit_model])
    assert os.path.isfile(tmp_path / "eval" / "metrics.json") and os.path.isfile(tmp_path / "m" / "model.safetensors")


def test_a_lora_run_at_the_default_lr_says_what_the_lab_found(digit_model, capsys):
    cfg = lora_cfg(digit_model)  # --lr left at full fine-tuning's default, the paper's 1e-6
    plumbing.setup_model(cfg, digit_model, torch.device("cpu"))
    note = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[lora]")]
    assert len(note) == 1 and note[0].startswith("[lora] --lr 1e-06 is full fine-tuning's default (the paper's); in "
                                                 "the first lab PACS's adapter learned best at lr ")
    plumbing.lora_lr_note(dataclasses.replace(cfg, lr=5e-6))  # an lr of one's own: nothing said
    plumbing.lora_lr_note(dataclasses.replace(cfg, lora_rank=0))  # full fine-tuning: nothing said
    assert capsys.readouterr().err == ""
    # the lrs it names are the lab's scan's choices (experiments/labs/lab/lora.json), and so the ratio
    with open(os.path.join(os.path.dirname(plumbing.__file__), "experiments", "labs", "lab", "lora.json")) as f:
        lab = json.load(f)
    found = {f"r{a['rank']}": a["lr"] for a in lab["arms"].values()}
    assert {k: float(plumbing.LORA_LR_SCAN[k]) for k in found} == found
    ratios = sorted(round(a["lr"] / lab["full_lr"]) for a in lab["arms"].values())
    assert plumbing.LORA_LR_SCAN["ratio"] == f"{ratios[0]} to {ratios[-1]} times" and lab["full_lr"] == 1e-4
