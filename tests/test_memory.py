"""The memory-bounded update (groups split across micro-batches, the LM head in chunks), out-of-memory
retries, the bf16 rollout copy, time-based checkpoints, the memory plan and the GPU benchmark's smoke mode."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import levers
import pacs

import plumbing
import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = os.path.join(ROOT, "..", "shared", "models", "qwen2.5-0.5b-instruct")
needs_qwen = pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN, "config.json")),
                                reason="needs ../shared/models/qwen2.5-0.5b-instruct (the project's shared folder)")


def grads_of_one_mini_batch(model_dir, roll, rewards, algo, micro_batch_size, first):
    """(.grad of every parameter, loss, psi) after accumulate_mini_batch on the whole rollout (one mini-batch)."""
    model, _ = plumbing.load_model(model_dir)
    model.train()
    cfg = pacs.Config(group_size=4, prompts_per_step=2, num_mini_batches=1, micro_batch_size=micro_batch_size,
                      algo=algo, temperature=0.9)
    mask = roll["response_mask"].float()
    old = torch.zeros_like(mask)
    if not first:  # a pi_old that differs from the current weights: psi != 0
        with torch.no_grad():
            old = pacs.response_logprobs(model, roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"],
                                         roll["response_mask"], 0.9)[0]
        old = old + 0.05 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    loss, psi, _ = pacs.accumulate_mini_batch(cfg, model, roll, old, mask, rewards, slice(0, 8), first,
                                              torch.device("cpu"))
    return [p.grad.clone() for p in model.parameters()], loss, psi, old


@pytest.mark.parametrize("algo", ["pacs", "grpo", "reinforce"])
@pytest.mark.parametrize("first", [True, False])
def test_a_group_split_across_micro_batches_gives_the_whole_group_gradient(digit_model, digit_rollout, algo, first):
    roll, rewards = digit_rollout
    whole = grads_of_one_mini_batch(digit_model, roll, rewards, algo, 8, first)
    for mb in (2, 1):  # G=4 split in 2 and in 4 micro-batches: dL/dlogprobs first, then rows
        split = grads_of_one_mini_batch(digit_model, roll, rewards, algo, mb, first)
        assert split[1].item() == pytest.approx(whole[1].item(), rel=1e-5, abs=1e-7)
        for g_whole, g_split in zip(whole[0], split[0]):
            torch.testing.assert_close(g_split, g_whole, rtol=1e-4, atol=1e-6)
    if algo == "pacs" and first:  # on-policy: psi is exactly 0 in the split route too, not just close
        assert torch.equal(split[2], torch.zeros(8))
        assert torch.count_nonzero(whole[0][0]) > 0  # mixed groups: a real gradient was compared
    if algo == "pacs" and not first:
        assert split[2].abs().max() > 1e-3  # the critic was on: psi != 0


@pytest.mark.parametrize("algo", ["grpo", "reinforce"])
def test_token_mean_baselines_do_not_depend_on_the_micro_batch_size(digit_model, digit_rollout, algo):
    # whole groups per micro-batch (4 rows) vs the whole mini-batch at once (8 rows): token-mean over the
    # mini-batch either way, so the ragged lengths of the two groups must not reweight them
    roll, rewards = digit_rollout
    one = grads_of_one_mini_batch(digit_model, roll, rewards, algo, 8, False)
    two = grads_of_one_mini_batch(digit_model, roll, rewards, algo, 4, False)
    for a, b in zip(one[0], two[0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_lm_head_never_sees_more_than_a_chunk_of_tokens(digit_model, digit_rollout):
    roll, _ = digit_rollout
    model, _ = plumbing.load_model(digit_model)
    seen = []
    model.get_output_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(o.shape)))
    lp, _ = pacs.response_logprobs(model, roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"],
                                   roll["response_mask"], 0.9, group_size=4, chunk=5)
    lp.sum().backward()  # backward recomputes the chunks: still at most 5 tokens each
    n_tokens = int(roll["response_mask"].sum())
    assert seen and all(len(s) == 2 and s[0] <= 5 for s in seen), seen
    assert sum(s[0] for s in seen) == 2 * n_tokens  # forward + recompute, padding never through the head


def run(model, out_dir, *extra):
    argv = ["--model", model, "--dataset", "synthetic", "--out-dir", str(out_dir), "--group-size", "4",
            "--prompts-per-step", "4", "--num-mini-batches", "2", "--max-new-tokens", "3", "--lr", "1e-2",
            "--eval-every", "0", "--log-samples-every", "0", "--temperature", "1.5", *extra]
    pacs.main(argv)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_out_of_memory_in_the_update_halves_the_micro_batch_and_loses_no_step(digit_model, tmp_path, monkeypatch,
                                                                               capsys):
    real, grad_calls = pacs.response_logprobs, {"n": 0}

    def small_memory(model, prompt_ids, *a, **k):  # 4 rows with grad fit once: the second such forward fails,
        if torch.is_grad_enabled() and prompt_ids.shape[0] > 2:  # after the first has run backward
            grad_calls["n"] += 1
            if grad_calls["n"] > 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, prompt_ids, *a, **k)

    mixed = conftest.reward_stand_in(lambda texts, answers: torch.arange(len(texts)) % 2.0)  # mixed groups
    monkeypatch.setattr(pacs, "reward_fn", mixed)
    reference = run(digit_model, tmp_path / "ref", "--steps", "2", "--micro-batch-size", "2")
    monkeypatch.setattr(pacs, "response_logprobs", small_memory)
    rows = run(digit_model, tmp_path / "oom", "--steps", "2", "--micro-batch-size", "4")
    assert "mini-batch 0: --micro-batch-size 4 -> 2" in capsys.readouterr().out
    assert [r["micro_batch_size"] for r in rows] == [2, 2] and [r["step"] for r in rows] == [0, 1]
    for r, ref in zip(rows, reference):  # the retried step is the step a 2-row run computes, from clean gradients
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-5) and r["reward"] == ref["reward"]
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_a_try_swallows_out_of_memory_alone_from_clean_gradients_and_keeps_none_of_its_tensors():
    import weakref
    cfg = pacs.Config(group_size=4, prompts_per_step=4, num_mini_batches=1, micro_batch_size=4)
    sizes, layer, tries, held = plumbing.Sizes.typed(cfg), torch.nn.Linear(3, 1), [], []
    layer.weight.grad = torch.ones_like(layer.weight)  # a stale gradient: cleared before the first try

    def step(rows):  # a forward and backward that runs out of memory above one row
        assert all(ref() is None for ref in held), "a failed try's tensors outlive it"
        tries.append((rows, layer.weight.grad))
        big = torch.ones(1000)  # a tensor of the try: once it fails, only its traceback's frames would hold it
        held.append(weakref.ref(big))
        layer(torch.ones(1, 3)).sum().backward()
        if rows > 1:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)\nmore lines")
    for attempt in plumbing.shrinking(cfg, sizes, "test", layer):
        with attempt:
            step(sizes.micro_batch_size)
    assert tries == [(4, None), (2, None), (1, None)]  # halved each time, each from clean gradients
    with pytest.raises(plumbing.ConfigError, match=r"out of memory in test with --micro-batch-size 1: .*\(CUDA out "
                                                   r"of memory \(simulated\)\)$"):
        for attempt in plumbing.shrinking(cfg, sizes, "test"):
            with attempt:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    with pytest.raises(ValueError, match="not a memory error"):  # any other error goes through, at once
        for attempt in plumbing.shrinking(cfg, plumbing.Sizes.typed(cfg), "test"):
            with attempt:
                raise ValueError("not a memory error")


def generate_fitting(monkeypatch, most):
    """pacs.generate_groups raises a simulated CUDA OOM on more than `most` prompts: the list of call sizes."""
    real, calls = pacs.generate_groups, []

    def small_memory(model, tokenizer, prompts, *a):
        calls.append(len(prompts))
        if len(prompts) > most:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, tokenizer, prompts, *a)

    monkeypatch.setattr(pacs, "generate_groups", small_memory)
    return calls


def test_out_of_memory_in_generate_halves_the_batch_and_keeps_every_prompt(digit_model, monkeypatch, capsys):
    model, tok = plumbing.load_model(digit_model)
    calls = generate_fitting(monkeypatch, 1)
    prompts = [plumbing.build_prompt(tok, f"{i} + 1 =") for i in range(5)]
    roll = pacs.sample(model, tok, prompts, group_size=2, max_new_tokens=3, batch_prompts=4)
    assert roll["response_ids"].shape[0] == 10 and calls == [4, 2, 1, 1, 1, 1, 1]
    assert "out of memory in generate" in capsys.readouterr().out


def test_a_halved_generate_batch_carries_to_the_following_steps_logged_once(digit_model, tmp_path, monkeypatch,
                                                                             capsys):
    """An OOM in generate late in a step would recur every step if the smaller batch lasted one call: the size
    it fell to is kept (the run's Sizes.gen_batch_prompts, also the in-loop eval's), so later steps never try the
    larger one."""
    calls = generate_fitting(monkeypatch, 2)
    rows = run(digit_model, tmp_path, "--steps", "3", "--gen-batch-prompts", "4")
    assert calls == [4, 2, 2] + [2, 2] * 2  # step 0 fails once at 4 prompts; steps 1 and 2 start at 2
    out = capsys.readouterr().out
    assert out.count("[memory] out of memory in generate: 2 prompts per generate call from now on") == 1
    assert len(rows) == 3


def test_bf16_rollout_copy_follows_the_trained_weights(digit_model, tmp_path, monkeypatch):
    used = []
    real = pacs.sample
    monkeypatch.setattr(pacs, "sample", lambda model, *a, **k: used.append(model.dtype) or real(model, *a, **k))
    captured = {}
    real_copy = plumbing.copy_weights
    monkeypatch.setattr(plumbing, "copy_weights",
                        lambda dst, src: (real_copy(dst, src), captured.update(dst=dst, src=src)))
    run(digit_model, tmp_path, "--steps", "2", "--rollout-dtype", "bf16")
    assert used == [torch.bfloat16, torch.bfloat16]  # rollouts come from the bf16 copy
    for d, s in zip(captured["dst"].parameters(), captured["src"].parameters()):
        assert d.dtype == torch.bfloat16 and s.dtype == torch.float32  # fp32 master weights train
        assert torch.equal(d, s.to(torch.bfloat16))  # refreshed after the last step


def test_checkpoints_are_also_written_by_the_clock(digit_model, tmp_path, monkeypatch):
    saved = []
    real = plumbing.save_checkpoint
    monkeypatch.setattr(plumbing, "save_checkpoint",
                        lambda cfg, m, t, o, step, *a: saved.append(step) or real(cfg, m, t, o, step, *a))
    run(digit_model, tmp_path / "clock", "--steps", "3", "--save-every", "0", "--save-minutes", "1e-9")
    assert saved == [0, 1, 2]
    saved.clear()
    run(digit_model, tmp_path / "end", "--steps", "3", "--save-every", "0", "--save-minutes", "0")
    assert saved == [2]  # the end of the run only


def test_micro_batch_sizes_the_schedule_allows():
    cfg = pacs.Config(group_size=8, prompts_per_step=8, num_mini_batches=2)  # mini-batch: 4 groups, 32 rows
    assert plumbing.valid_micro_batch_sizes(cfg) == [1, 2, 4, 8, 16, 32]
    for bad in (3, 24, 64):
        with pytest.raises(plumbing.ConfigError, match=f"--micro-batch-size {bad} must divide"):
            plumbing.check_config(pacs.Config(group_size=8, prompts_per_step=8, num_mini_batches=2,
                                              micro_batch_size=bad))


@needs_qwen
def test_the_plan_fits_the_default_run_on_a_24_gb_card_and_picks_more_on_bigger_ones():
    config = plumbing.load_model_config(QWEN)
    n = plumbing.count_parameters(config)
    assert 490e6 < n < 500e6  # Qwen2.5-0.5B: ~494M parameters with tied embeddings
    chosen = {}
    for gib in (22.5, 80):  # what a "24 GB" card (A10G, L4) reports, and an 80 GB one
        cfg = pacs.Config(memory_gib=gib)  # the defaults: 128 x 8, M=4, 512 + 1024 tokens
        sizes, parts = plumbing.plan_memory(cfg, config, n, "cuda")
        assert parts["peak"] <= 0.9 * (gib - 0.5) * plumbing.GiB  # 0.5 GiB of CUDA context, then 10% headroom
        chosen[gib] = (sizes.micro_batch_size, sizes.gen_batch_prompts)
        assert (cfg.micro_batch_size, cfg.gen_batch_prompts) == (0, 0)  # cfg stays what was typed
    # an 80 GB card packs 2 groups of full rows a micro-batch (--pack-groups, --full-rows: auto, on with CUDA)
    assert chosen[22.5] == (2, 64) and chosen[80] == (16, 128)
    # the fp32 training state alone: 16 bytes per parameter
    assert parts["weights (fp32)"] + parts["AdamW moments (fp32)"] + parts["gradients (fp32)"] == 16 * n


def test_the_budget_leaves_the_cuda_context_out():
    assert plumbing.plan_budget("cuda", 22.5 * plumbing.GiB) == pytest.approx(0.9 * 22 * plumbing.GiB)
    assert plumbing.plan_budget("cpu", 22.5 * plumbing.GiB) == pytest.approx(0.9 * 22.5 * plumbing.GiB)


def test_the_plan_counts_the_attention_masks_sdpa_saves(digit_model, digit_rollout):
    # torch's own saved tensors under bf16 autocast: SDPA keeps a bf16 (rows, 1, queries, keys) copy of the mask
    # per layer, O(T^2); the plan's term must cover it (it is exact up to the last response token, which
    # predicts nothing)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import plan_terms  # the benchmark's count of saved tensors, at the tiny model's size
    roll, _ = digit_rollout
    model, _ = plumbing.load_model(digit_model)
    model.train()
    hooks, saved = plan_terms.saved_tensors(model)
    b, T = roll["response_ids"].shape
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        pacs.response_logprobs(model, *plumbing.rollout_rows(roll, slice(0, b)), 0.9, group_size=4)
    _, masks, _ = plan_terms.split(saved, model)  # bf16 (rows, 1, q, kv) tensors; RoPE's cos/sin are fp32
    cfg = pacs.Config(autocast="bf16", group_size=4, max_prompt_tokens=roll["prompt_ids"].shape[1],
                      max_new_tokens=T)
    planned = plumbing.memory_plan(cfg, model.config, 1, "cpu", b, 1)["attention masks (SDPA)"]
    assert 0 < masks <= planned <= 1.5 * masks, (masks, planned)


@pytest.mark.parametrize("autocast", ["bf16", "off"])
def test_the_plan_counts_the_trainers_kv_cache_as_the_installed_release_allocates_it(digit_model, digit_rollout,
                                                                                      autocast):
    # the shared prompt's cache, grown over the responses as in response_logprobs: under bf16 autocast RoPE's fp32
    # cos/sin make the keys fp32, and releases differ on the values (5.24 keeps them bf16, earlier ones fp32), so
    # the plan measures the dtypes (kv_cache_itemsizes) and is checked here against what this release allocates
    roll, _ = digit_rollout
    model, _ = plumbing.load_model(digit_model)
    decoder, G = model.get_decoder(), 4
    b, T = roll["response_ids"].shape
    Lp = roll["prompt_ids"].shape[1]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bf16"):
        cache = decoder(input_ids=roll["prompt_ids"][::G], use_cache=True).cache
        cache.batch_repeat_interleave(G)
        decoder(input_ids=roll["response_ids"][:, :T - 1], cache=cache, use_cache=True)
    held = sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    assert cache.layers[0].keys.dtype == torch.float32  # fp32 keys in both modes
    dtype = levers.on_device(pacs.Config(autocast=autocast), "cpu").autocast
    assert plumbing.kv_cache_itemsizes(type(model.config), dtype) == (
        cache.layers[0].keys.element_size(), cache.layers[0].values.element_size())
    cfg = pacs.Config(autocast=autocast, group_size=G, max_prompt_tokens=Lp, max_new_tokens=T)
    planned = plumbing.memory_plan(cfg, model.config, 1, "cpu", b, 1)["KV cache of the shared prompt"]
    assert held <= planned <= held * (Lp + T) / (Lp + T - 1), (held, planned)  # the last token is never cached


@needs_qwen
@pytest.mark.parametrize("flag, value, needle", [("micro_batch_size", 8, "--micro-batch-size"),
                                                  ("gen_batch_prompts", 128, "--gen-batch-prompts")])
def test_settings_that_do_not_fit_are_refused_naming_the_flag(flag, value, needle):
    config = plumbing.load_model_config(QWEN)
    cfg = pacs.Config(memory_gib=24, **{flag: value})
    with pytest.raises(plumbing.ConfigError, match=needle):
        plumbing.plan_memory(cfg, config, plumbing.count_parameters(config), "cuda")


@needs_qwen
def test_a_card_too_small_for_the_weights_alone_is_refused_naming_what_helps():
    config = plumbing.load_model_config(QWEN)
    n = plumbing.count_parameters(config)
    with pytest.raises(plumbing.ConfigError, match=r"weights and AdamW states alone need 12\.0 GiB.*: use "
                                                   r"--rollout-dtype fp32 .*, an --algo without a value model .*, "
                                                   r"or a larger card"):
        plumbing.plan_memory(pacs.Config(memory_gib=12, algo="ppo"), config, n, "cuda")
    with pytest.raises(plumbing.ConfigError, match="the update needs"):  # without the critic the state fits
        plumbing.plan_memory(pacs.Config(memory_gib=12), config, n, "cuda")


@needs_qwen
def test_plan_only_prints_the_plan_without_weights(capsys):
    pacs.main(["--model", QWEN, "--plan-only", "--device", "cuda", "--memory-gib", "24"])
    err = capsys.readouterr().err
    assert "[memory] plan on cuda with 24.0 GiB" in err and "peak" in err
    with pytest.raises(SystemExit, match="lower --micro-batch-size"):
        pacs.main(["--model", QWEN, "--plan-only", "--device", "cuda", "--memory-gib", "8", "--micro-batch-size", "8"])


@needs_qwen
def test_ppo_counts_the_value_model_and_names_the_flag_that_makes_it_fit(capsys):
    from transformers import AutoModelForTokenClassification
    config = plumbing.load_model_config(QWEN)
    n = plumbing.count_parameters(config)
    critic_config = copy.deepcopy(config)
    critic_config.num_labels = 1  # from_pretrained(path, num_labels=1), as PPO loads its value model
    with torch.device("meta"):  # the decoder and a score Linear(H, 1), no LM head
        critic = AutoModelForTokenClassification.from_config(critic_config)
    assert plumbing.critic_parameters(config, n) == sum(p.numel() for p in critic.parameters())
    nc = plumbing.critic_parameters(config, n)
    for mb, ckpt in ((1, False), (8, False), (8, True)):  # the critic runs the actor's route without its LM head
        pacs_plan = plumbing.memory_plan(pacs.Config(gradient_checkpointing=ckpt), config, n, "cuda", mb, 32)
        ppo_cfg = pacs.Config(algo="ppo", gradient_checkpointing=ckpt)
        ppo_plan = plumbing.memory_plan(ppo_cfg, config, n, "cuda", mb, 32)
        assert ppo_plan["peak: generate"] == pacs_plan["peak: generate"] + 12 * nc  # weights, AdamW: held throughout
        held = ppo_plan["weights (fp32)"] + ppo_plan["AdamW moments (fp32)"] + ppo_plan["rollout copy"] + 12 * nc
        actor = pacs_plan["peak: update"] - held + 12 * nc
        critic = (sum(ppo_plan[k] for k in ("critic gradients (fp32)", "critic bf16 casts", "critic activations"))
                  + max(ppo_plan["KV cache of the shared prompt"], ppo_plan["critic embedding gradient"]))
        assert (ppo_plan["critic activations"]
                == ppo_plan["activations of a micro-batch"] + ppo_plan["attention masks (SDPA)"])
        assert actor > critic
        assert ppo_plan["peak: update"] == held + max(actor, critic)  # the critic's update follows the actor's
    # the default PPO run on a "24 GB" card: even one row per micro-batch is over, and the refusal says what fits
    argv = ["--model", QWEN, "--algo", "ppo", "--plan-only", "--device", "cuda", "--memory-gib", "22.5"]
    with pytest.raises(SystemExit, match=r"the smallest change that fits: --gradient-checkpointing "
                                         r"\(planned .*, 4 rows "):
        pacs.main(argv)
    assert "critic    weights 1.84 | AdamW 3.68 held" in capsys.readouterr().err
    cfg = pacs.parse_args(argv + ["--gradient-checkpointing"])
    sizes, _ = plumbing.plan_memory(cfg, config, n, "cuda")  # fits, at the size the refusal named
    assert sizes.micro_batch_size == 4


@needs_qwen
def test_gpu_benchmark_smoke_mode_runs_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_step.py"), "--device", "cpu",
                           "--tiny", "--prompts-per-step", "1", "--group-size", "2", "--num-mini-batches", "1",
                           "--max-prompt-tokens", "48", "--max-new-tokens", "4", "--timed-steps", "1",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["response_tokens"] == 4 and all(r["response_len"] == 4 for r in result["steps"])  # forced
    for key in ("generate_s", "old_logprobs_s", "update_s", "generated_tokens_per_s", "peak_gib", "plan_gib",
                "projected_run_h"):
        assert result[key] > 0, key
    assert "measured / plan" in proc.stdout and "projected 300 steps" in proc.stdout


@pytest.mark.fakes_cuda
def test_gpu_benchmark_reports_reserved_memory_and_the_devices_count(monkeypatch):
    # fragmentation shows in the allocator's reserved peak and the device's own count, not in the allocated peak
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import gpu_step
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (2 * plumbing.GiB, 22.5 * plumbing.GiB))
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda: 19.25 * plumbing.GiB)
    m = gpu_step.cuda_memory()
    assert m == {"reserved_peak_bytes": 19.25 * plumbing.GiB, "device_used_bytes": 20.5 * plumbing.GiB,
                 "device_total_bytes": 22.5 * plumbing.GiB}
    assert gpu_step.cuda_memory_text(m) == ("reserved 19.25 GiB (max_memory_reserved) | device in use 20.50 of "
                                            "22.50 GiB (mem_get_info)")


def test_a_mini_batch_holds_no_gradient_of_the_one_before(digit_model, tmp_path, monkeypatch):
    # zero_grad(set_to_none=True) frees the gradients only if nothing else refers to them: a list kept for the
    # grad norm once held a whole extra copy (1.8 GiB at 0.5B) through every later mini-batch
    import gc
    import weakref
    real, previous, alive = pacs.accumulate_mini_batch, [], []

    def check_then_accumulate(cfg, model, *a, **k):
        gc.collect()
        alive.append(sum(ref() is not None for ref in previous))
        out = real(cfg, model, *a, **k)
        previous[:] = [weakref.ref(p.grad) for p in model.parameters() if p.grad is not None]
        return out

    monkeypatch.setattr(pacs, "accumulate_mini_batch", check_then_accumulate)
    run(digit_model, tmp_path, "--steps", "2", "--micro-batch-size", "4")
    assert len(alive) == 4 and alive == [0, 0, 0, 0]


@needs_qwen
@pytest.mark.parametrize("device_type, rollout_dtype, copy", [("cuda", "auto", True), ("cpu", "auto", False),
                                                               ("cpu", "bf16", True), ("cuda", "fp32", False)])
def test_the_plan_counts_a_rollout_copy_exactly_when_setup_model_makes_one(device_type, rollout_dtype, copy):
    config = plumbing.load_model_config(QWEN)
    n = plumbing.count_parameters(config)
    cfg = pacs.Config(rollout_dtype=rollout_dtype)
    parts = plumbing.memory_plan(cfg, config, n, device_type, 8, 1)
    assert parts["rollout copy"] == (2 * n if copy else 0)
    # setup_model copies exactly when the rollout dtype is not fp32
    assert (levers.on_device(cfg, device_type).rollout_dtype != torch.float32) == copy


def test_the_rollout_copy_is_what_from_pretrained_in_bf16_loads(digit_model):
    # casting parameters only: the RoPE frequencies (inv_freq) stay fp32, as in eval.py's bf16 model, instead of
    # being rounded to bf16 by model.to(bf16)
    from transformers import AutoModelForCausalLM
    model, _ = plumbing.load_model(digit_model)
    copy = plumbing.rollout_copy(model, torch.bfloat16)
    loaded = AutoModelForCausalLM.from_pretrained(digit_model, dtype=torch.bfloat16)
    buffers = dict(loaded.named_buffers())
    assert any(name.endswith("inv_freq") for name in buffers)
    for name, b in copy.named_buffers():
        assert b.dtype == buffers[name].dtype == torch.float32 and torch.equal(b, buffers[name]), name
    params = dict(loaded.named_parameters())
    for name, p in copy.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, params[name]), name
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the trained model is untouched
