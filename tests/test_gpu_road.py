"""The CUDA road, checked on the CPU where a check can bite: a NaN on rows of left padding is caught, the attention
kernels are pinned where log-probs are taken, the plan reads free memory, --device auto refuses a silent CPU
fallback at GPU scale, the entropy comes from the log-probs' own logits, the allocator gets expandable segments,
checkpoints come at a justified interval, a resume restores the batch sizes an out-of-memory retry halved (cfg
staying what was typed), and the prepared GPU check rehearses on the CPU."""
import contextlib
import json
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch

import pacs

import plumbing
import conftest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QWEN = os.path.join(ROOT, "..", "shared", "models", "qwen2.5-0.5b-instruct")
needs_qwen = pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN, "config.json")),
                                reason="needs ../shared/models/qwen2.5-0.5b-instruct (the project's shared folder)")
QWEN3 = os.path.join(ROOT, "..", "shared", "models", "qwen3")  # the check's `prepare` carries its tokenizer
needs_qwen3 = pytest.mark.skipif(not os.path.isfile(os.path.join(QWEN3, "tokenizer.json")),
                                 reason="needs ../shared/models/qwen3 (the project's shared folder)")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def nan_on_left_padding(model):
    """Plant the failure a kernel causes: NaN out of the embedding on every row's left padding (the positions before
    its first real token, read off the attention mask the decoder is called with), as a kernel that returns NaN on
    rows that attend to nothing would leave them. Calls whose mask also covers earlier tokens (the responses after
    a cached prompt, generate's decode steps) have no left padding of their own."""
    called = {}
    model.base_model.register_forward_pre_hook(
        lambda module, args, kwargs: called.update(mask=kwargs.get("attention_mask")), with_kwargs=True)

    def hook(module, inputs, output):
        mask = called.get("mask")
        if mask is None or mask.shape != inputs[0].shape:
            return output
        leading = mask.long().cumsum(1) == 0  # (b, L): before each row's first real token
        return output.masked_fill(leading.unsqueeze(-1), float("nan"))
    model.get_input_embeddings().register_forward_hook(hook)


def padded_prompts(tok):
    return [plumbing.build_prompt(tok, "1 + 6 ="), plumbing.build_prompt(tok, "12 + 3 =")]  # unequal: left padding


# ---- 4. a NaN on rows of left padding is caught --------------------------------------------------------------
def test_a_nan_from_left_padding_in_generates_prefill_is_one_line_error(digit_model):
    model, tok = plumbing.load_model(digit_model)
    nan_on_left_padding(model)
    with pytest.raises(plumbing.ConfigError, match=r"non-finite logits of generate's prefill: 1 of 2 rows, 1 of them "
                                               r"with a left-padded prompt"):
        pacs.sample(model, tok, padded_prompts(tok), group_size=2, max_new_tokens=3)


def test_a_nan_from_left_padding_in_the_trainers_forward_stops_the_step(digit_model):
    # the sampler is clean, the trained model's prompt forward gets NaN on its padding: the log-probs of the padded
    # prompt's rows must not reach psi, the loss and the update as NaN. A micro-batch of one group has no padding
    # (columns that are padding in every row are trimmed): two groups of unequal prompts share one here
    model, tok = plumbing.load_model(digit_model)
    rollout, _ = plumbing.load_model(digit_model)
    nan_on_left_padding(model)
    torch.manual_seed(0)
    cfg = pacs.Config(group_size=4, prompts_per_step=2, num_mini_batches=1, micro_batch_size=8, max_new_tokens=3)
    problems = [{"problem": "1 + 6 =", "answer": "7"}, {"problem": "12 + 3 =", "answer": "15"}]
    optimizer = pacs.make_optimizer(cfg, model)
    with pytest.raises(plumbing.ConfigError, match=r"non-finite log-probs of rows 0\.\.7: 4 of 8 rows, 4 of them "
                                                   r"with a left-padded prompt"):
        pacs.train_step(cfg, model, tok, optimizer, problems, 0, torch.device("cpu"), rollout)


def test_check_finite_passes_finite_values_and_names_the_rows_it_refuses():
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])
    plumbing.check_finite(torch.zeros(3, 4), "x", mask)
    values = torch.zeros(3, 4)
    values[0, 1], values[2, 3] = float("nan"), float("inf")
    with pytest.raises(plumbing.ConfigError, match=r"non-finite x: 2 of 3 rows, 1 of them with a left-padded prompt"):
        plumbing.check_finite(values, "x", mask)


# ---- 5. the attention kernels are pinned where log-probs are taken ---------------------------------------------
def test_the_pin_leaves_flash_and_memory_efficient_attention_on_cuda_and_nothing_else():
    flags = lambda: {name: getattr(torch.backends.cuda, f"{name}_sdp_enabled")() for name in
                     ("flash", "mem_efficient", "math", "cudnn")}
    before = flags()
    with plumbing.pin_attention("cuda"):
        assert flags() == {"flash": True, "mem_efficient": True, "math": False, "cudnn": False}
    assert flags() == before
    with plumbing.pin_attention("cpu"):  # the CPU road is untouched
        assert flags() == before


def test_every_attention_call_of_the_log_prob_forwards_runs_under_the_pin(digit_model, digit_rollout, monkeypatch):
    roll, rewards = digit_rollout
    model, _ = plumbing.load_model(digit_model)
    depth, calls = {"n": 0}, []

    @contextlib.contextmanager
    def recording_pin(device_type):
        depth["n"] += 1
        try:
            yield
        finally:
            depth["n"] -= 1

    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(depth["n"] > 0) or real(*a, **k))
    monkeypatch.setattr(plumbing, "pin_attention", recording_pin)
    cfg = pacs.Config(group_size=4, prompts_per_step=2, num_mini_batches=2, micro_batch_size=4, max_new_tokens=6,
                      lr=0.0)
    from critic_probe import rollout_updates  # experiments/: phases 3 and 4 of train_step on a given rollout
    rollout_updates(cfg, model, pacs.make_optimizer(cfg, model), roll, rewards, torch.device("cpu"))
    assert calls and all(calls), calls  # phase 3's no-grad forwards and phase 4's grad forwards alike


# ---- 6. the plan reads the memory this process can have ------------------------------------------------------
@pytest.mark.fakes_cuda
def test_the_plan_starts_from_free_memory_plus_what_this_process_holds(monkeypatch):
    GiB = plumbing.GiB
    # a "24 GB" card (22.5 GiB) with a display holding 1.5 GiB: our weights hold 2 GiB, the context 0.5, 18.5 free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(18.5 * GiB), int(22.5 * GiB)))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 2 * GiB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: pytest.fail("the card's total was read"))
    assert plumbing.device_memory("cuda") == 21 * GiB  # 22.5 less the display's 1.5: 18.5 + 2 + 0.5 of context
    assert plumbing.plan_budget("cuda", plumbing.device_memory("cuda")) == pytest.approx(0.9 * 20.5 * GiB)
    assert plumbing.device_memory("cuda", 22.5) == 22.5 * GiB  # --memory-gib still says what the card reports


@needs_qwen
@pytest.mark.fakes_cuda
def test_a_card_shared_with_a_display_gets_a_smaller_plan(monkeypatch):
    config = plumbing.load_model_config(QWEN)
    n = plumbing.count_parameters(config)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 4 * n)  # the loaded fp32 weights
    chosen = {}
    for display_gib in (0.0, 3.0):
        free = 22.5 * plumbing.GiB - plumbing.CUDA_CONTEXT - 4 * n - display_gib * plumbing.GiB
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (int(free), int(22.5 * plumbing.GiB)))
        sizes, _ = plumbing.plan_memory(pacs.Config(), config, n, "cuda")
        chosen[display_gib] = (sizes.micro_batch_size, sizes.gen_batch_prompts)
    assert chosen[0.0] == (2, 64)  # the whole card: docs/gpu.md's 24 GB row
    assert chosen[3.0] < chosen[0.0], chosen


# ---- 7. --device auto does not fall back to the CPU silently at GPU scale ---------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "pacs.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def test_device_auto_without_a_gpu_refuses_the_default_settings_in_one_line(tiny_model_dir):
    if torch.cuda.is_available():
        pytest.skip("a usable GPU is here")
    proc = cli("--model", tiny_model_dir, "--dataset", "synthetic", "--steps", "1")  # the defaults: GPU scale
    err = proc.stderr.strip()
    assert proc.returncode != 0 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("pacs.py: error: --device auto found no usable GPU ("), err
    assert "1,048,576 tokens per step" in err and "--device cpu" in err
    cfg = pacs.Config(device="cuda")
    with pytest.raises(plumbing.ConfigError, match="--device cuda, but CUDA is unusable here: "):
        plumbing.pick_device(cfg)
    small = pacs.Config(prompts_per_step=4, group_size=4, max_new_tokens=32)  # a CPU run's size: no refusal
    assert plumbing.pick_device(small).type == "cpu"
    assert plumbing.pick_device(pacs.Config(device="cpu")).type == "cpu"  # asked for: always
    assert plumbing.pick_device(pacs.Config(plan_only=True)).type == "cpu"  # the plan needs no device


@pytest.mark.fakes_cuda
def test_the_refusal_names_the_cause_torch_gives(monkeypatch):
    monkeypatch.setattr(plumbing, "visible_gpus", lambda: 0)
    monkeypatch.setattr(torch.version, "cuda", "13.0")  # a CUDA build, but the driver is older than it

    def old_driver():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 12020).\nPlease update it.")

    monkeypatch.setattr(torch.cuda, "init", old_driver)
    with pytest.raises(plumbing.ConfigError, match=r"no usable GPU \(The NVIDIA driver on your system is too old "
                                                   r"\(found version 12020\)\.\), and these settings generate "
                                                   r"1,048,576 tokens"):
        plumbing.pick_device(pacs.Config())


# ---- 8. one LM head pass gives the log-prob and the entropy ----------------------------------------------------
@pytest.mark.parametrize("grad", [False, True])
def test_the_entropy_comes_from_the_log_probs_logits_and_equals_the_two_pass_value(digit_model, digit_rollout, grad):
    roll, _ = digit_rollout
    model, _ = plumbing.load_model(digit_model)
    head, seen = model.get_output_embeddings(), []
    handle = head.register_forward_hook(lambda m, i, o: seen.append(o.shape[0]))
    args = (roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"], roll["response_mask"], 0.9)
    with torch.set_grad_enabled(grad):
        lp, entropy = pacs.response_logprobs(model, *args, with_entropy=True, group_size=4, chunk=5)
        lp_alone, none = pacs.response_logprobs(model, *args, group_size=4, chunk=5)
    n_tokens = int(roll["response_mask"].sum())
    assert none is None and sum(seen) == 2 * n_tokens  # each call: every real token through the head once
    assert torch.equal(lp, lp_alone)
    handle.remove()
    # the two-pass value: a second LM head pass per chunk, the entropy's formula on its own logits
    with torch.no_grad():
        hidden, keep = pacs.response_hidden(model, *args[:4], group_size=4)
        h = hidden[keep]
        two_pass = []
        for s in range(0, len(h), 5):
            logits = head(h[s:s + 5]).float() / 0.9
            two_pass.append(logits.logsumexp(-1) - (torch.softmax(logits, -1) * logits).sum(-1))
    expected = torch.zeros_like(entropy).masked_scatter(keep, torch.cat(two_pass))
    assert not entropy.requires_grad
    torch.testing.assert_close(entropy, expected, rtol=1e-6, atol=1e-6)
    assert (entropy[keep] > 0).all()


# ---- 3. expandable segments unless the user chose -----------------------------------------------------------
@pytest.mark.fakes_cuda
def test_cuda_gets_expandable_segments_unless_the_user_set_the_allocator(monkeypatch, capsys):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")  # unset, as pacs.py reads it; restored after the test
    applied = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", applied.append)
    monkeypatch.setattr(plumbing, "visible_gpus", lambda: 1)
    assert plumbing.pick_device(pacs.Config()).type == "cuda"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert applied == ["expandable_segments:True"]
    assert "[memory] PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set by pacs.py" in capsys.readouterr().err
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")  # the user's choice stands
    applied.clear()
    assert plumbing.use_expandable_segments() is False and applied == []
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert "as given: {'PYTORCH_CUDA_ALLOC_CONF': 'backend:cudaMallocAsync'}" in capsys.readouterr().err
    monkeypatch.setattr(plumbing, "visible_gpus", lambda: 0)  # the CPU road: nothing set
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    plumbing.pick_device(pacs.Config(device="cpu"))
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_setting_the_allocator_at_run_time_warns_of_nothing(monkeypatch, capsys):
    # torch.cuda.memory._set_allocator_settings warns that it is deprecated (2.11, 2.13): the call pacs.py makes does
    # not (tests/conftest.py turns a FutureWarning from our code into an error). On a CPU build it changes nothing.
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.setenv(name, "")
    assert plumbing.use_expandable_segments() is True


# ---- 9. the checkpoint clock -----------------------------------------------------------------------------------
@needs_qwen
def test_the_save_minutes_default_lies_in_youngs_interval_for_a_checkpoint_of_the_default_model():
    # A checkpoint of Qwen2.5-0.5B: fp32 weights and AdamW's two moments, 12 bytes per parameter (5.9 GB). Written
    # at 0.5 to 1 GB/s it costs C = 6 to 12 s; with a mean time between interruptions M of 6 h to a day, the interval
    # that loses the least time (Young: sqrt(2 C M)) is 8 to 24 minutes. 5 minutes wrote 6 GB every 5 minutes.
    n = plumbing.count_parameters(plumbing.load_model_config(QWEN))
    checkpoint = 12 * n
    assert 5.8e9 < checkpoint < 6.0e9
    young = lambda rate, hours: math.sqrt(2 * checkpoint / rate * hours * 3600) / 60  # minutes
    assert young(1e9, 6) <= pacs.Config().save_minutes <= young(0.5e9, 24)
    assert pacs.Config().save_minutes == 15


# ---- 10. a resume restores the sizes an out-of-memory retry halved ---------------------------------------------
def run(model, out_dir, *extra):
    argv = ["--model", model, "--dataset", "synthetic", "--out-dir", str(out_dir), "--group-size", "4",
            "--prompts-per-step", "4", "--num-mini-batches", "2", "--max-new-tokens", "3", "--lr", "1e-2",
            "--eval-every", "0", "--log-samples-every", "0", "--temperature", "1.5", "--micro-batch-size", "4",
            "--gen-batch-prompts", "4", "--save-every", "1", *extra]
    pacs.main(argv)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def small_memory(monkeypatch):
    """Out of memory on the first grad forward over more than 2 rows and on generate calls of more than 2 prompts:
    step 0 halves --micro-batch-size 4 -> 2 and --gen-batch-prompts 4 -> 2, for the rest of the run."""
    real_lp, real_gen, grad_calls = pacs.response_logprobs, pacs.generate_exactly, {"n": 0}

    def logprobs(model, prompt_ids, *a, **k):
        if torch.is_grad_enabled() and prompt_ids.shape[0] > 2:
            grad_calls["n"] += 1
            if grad_calls["n"] == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_lp(model, prompt_ids, *a, **k)

    def generate(model, generation_config, *levers, **inputs):
        if inputs["input_ids"].shape[0] > 2 * 4:  # more than 2 prompts of G = 4
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_gen(model, generation_config, *levers, **inputs)

    monkeypatch.setattr(pacs, "response_logprobs", logprobs)
    monkeypatch.setattr(pacs, "generate_exactly", generate)


def test_a_resume_continues_at_the_sizes_an_out_of_memory_retry_halved(digit_model, tmp_path, monkeypatch):
    mixed = conftest.reward_stand_in(lambda texts, answers: torch.arange(len(texts)) % 2.0)  # mixed groups
    monkeypatch.setattr(pacs, "reward_fn", mixed)
    with monkeypatch.context() as m:
        small_memory(m)
        full = run(digit_model, tmp_path / "full", "--steps", "3")
    with monkeypatch.context() as m:
        small_memory(m)
        run(digit_model, tmp_path / "part", "--steps", "2")  # killed after step 1's checkpoint
    assert [(r["micro_batch_size"], r["gen_batch_prompts"]) for r in full] == [(2, 2)] * 3
    state = torch.load(tmp_path / "part" / "checkpoint-000001" / "trainer_state.pt", weights_only=False)
    assert state["sizes"] == {"micro_batch_size": 2, "gen_batch_prompts": 2, "full_rows": False}  # the CPU: shared
    assert (state["config"]["micro_batch_size"], state["config"]["gen_batch_prompts"]) == (4, 4)  # cfg: as typed
    with open(tmp_path / "part" / "config.json") as f:
        assert json.load(f)["micro_batch_size"] == 4
    # the resumed process has the memory to try 4 again, but an uninterrupted run never would: it continues at 2
    calls = []
    real_gen = pacs.generate_exactly
    monkeypatch.setattr(pacs, "generate_exactly", lambda model, config, *speed, **inputs: calls.append(
        inputs["input_ids"].shape[0] // 4) or real_gen(model, config, *speed, **inputs))  # prompts per generate call
    resumed = run(digit_model, tmp_path / "part", "--steps", "3", "--resume")
    assert resumed[2]["micro_batch_size"] == 2 and calls == [2, 2]
    timing = ("time_generate", "time_verify", "time_old_logprobs", "time_update", "time_eval", "time_save",
              "step_time", "samples_per_s")
    strip = lambda r: {k: v for k, v in r.items() if k not in timing}
    assert strip(resumed[2]) == strip(full[2])  # the samples and the update of the uninterrupted run


def test_resumed_sizes_keep_the_checkpoints_unless_the_flag_changed(capsys):
    state = {"sizes": {"micro_batch_size": 2, "gen_batch_prompts": 16},
             "config": {"micro_batch_size": 0, "gen_batch_prompts": 0}}  # both typed 0 (auto) by the saving run
    planned = plumbing.Sizes(8, 64)
    assert plumbing.resumed_sizes(pacs.Config(), planned, state) == plumbing.Sizes(2, 16)  # the same command: restored
    assert "[resume] batch sizes as the checkpoint left them" in capsys.readouterr().err
    # --gen-batch-prompts typed differently now: that one is the user's (planned), the other restored
    resumed = plumbing.resumed_sizes(pacs.Config(gen_batch_prompts=32), plumbing.Sizes(8, 32), state)
    assert resumed == plumbing.Sizes(2, 32)
    assert plumbing.resumed_sizes(pacs.Config(), planned, {"config": {}}) == planned  # a checkpoint from before sizes


# ---- 1, 2. the check's own measurements: both peaks, a real allocator cap ----------------------------------------
@pytest.mark.fakes_cuda
def test_the_check_reads_generates_peak_and_resets_it_so_the_update_has_its_own(monkeypatch):
    import gpu_step
    allocator = {"now": 0, "peak": 0}

    def allocate(nbytes):
        allocator["now"] += nbytes
        allocator["peak"] = max(allocator["peak"], allocator["now"])
        allocator["now"] -= nbytes

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: allocator["peak"])
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda *a: allocator["peak"] + 1)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: allocator.update(peak=allocator["now"]))
    phase = {}
    sample = gpu_step.sample_full_length(lambda *a: allocate(10) or pacs.rollout_generation_config(5).min_new_tokens,
                                         torch.device("cuda"), 7, phase)
    assert sample("model") == 7  # every response forced to full length
    assert pacs.rollout_generation_config(5).min_new_tokens is None  # and only inside the call
    allocate(6)  # the update, after generate: its own peak
    assert phase == {"generate_peak_bytes": 10, "generate_reserved_bytes": 11}
    assert gpu_step.peak_bytes(torch.device("cuda")) == 6


@pytest.mark.fakes_cuda
def test_memory_gib_caps_the_allocator_at_what_that_card_leaves_it(monkeypatch):
    import gpu_step
    caps = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: types.SimpleNamespace(
        total_memory=80 * plumbing.GiB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, *a: caps.append(f))
    fraction, allowed = gpu_step.cap_allocator(22.5)
    assert caps == [fraction] and fraction == pytest.approx(22 / 80)  # 22.5 less the CUDA context outside it
    assert allowed == pytest.approx(22 * plumbing.GiB)


# ---- the prepared GPU check, rehearsed on the CPU at a tiny shape -------------------------------------------------
def rehearse_check(tmp_path, timeout, **env):
    """benchmarks/gpu_check.sh --device cpu on a fresh `prepare` (without the wheels), its exit status asserted 0:
    (the prepared folder, OUT, check.log, the script's stdout)."""
    gpu_dir, out = tmp_path / "gpu", tmp_path / "out"
    prep = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "prepare", "--dest",
                           str(gpu_dir)], capture_output=True, text=True, timeout=60)
    assert prep.returncode == 0, prep.stderr
    env = {**os.environ, "GPU_CHECK_DIR": str(gpu_dir), "PYTHON": sys.executable, **env}
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), str(out), "--device", "cpu"],
                          capture_output=True, text=True, timeout=timeout, env=env)
    log = (out / "check.log").read_text() if (out / "check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + log[-3000:]
    return gpu_dir, out, log, proc.stdout


@needs_qwen
@needs_qwen3
def test_the_gpu_check_runs_only_the_steps_asked_for(tmp_path):
    """GPU_CHECK_STEPS: a second call's share of the check (the stand-in is built whatever is asked), where a resume
    asked for without this call's e2e_train is skipped, and said (it would run from step 0 and exit 0)."""
    _, out, log, _ = rehearse_check(tmp_path, 600, GPU_CHECK_STEPS="probe e2e_resume")
    assert "== probe: exit 0" in log and "== build: exit 0" in log
    assert "== step_default: skipped, not in GPU_CHECK_STEPS" in log and "== e2e_eval: skipped, not in" in log
    assert "== e2e_resume: skipped, no checkpoint of e2e_train in this call" in log
    assert sorted(p.name for p in out.iterdir()) == ["check.log", "probe.json", "results.json", "summary.md"]


@needs_qwen
@needs_qwen3
def test_the_gpu_check_rehearses_on_the_cpu_with_its_own_folders(tmp_path):
    gpu_dir, out, log, stdout = rehearse_check(tmp_path, 1300, OMP_NUM_THREADS="1")
    assert sorted(os.listdir(gpu_dir / "model")) == ["config.json", "generation_config.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    files = sorted(os.listdir(out))
    assert files == ["attn.json", "check.log", "decode.json", "e2e_eval.json", "e2e_metrics.jsonl", "forms.json",
                     "probe.json", "profile.json", "psi_ckpt.json", "psi_levers.json", "psi_lora.json", "results.json",
                     "step_22g.json", "step_22g_ckpt.json", "step_default.json", "step_defer.json",
                     "step_dynamic.json", "step_flex.json",
                     "step_off.json", "step_opt.json", "step_profiled.json", "step_qwen3.json", "step_shared.json",
                     "summary.md"]  # a call brings back results.json
    for name in ("probe", "build", "step_default", "step_opt", "step_off", "step_dynamic", "step_flex", "decode",
                 "attn", "step_shared", "step_defer",
                 "psi_levers", "forms", "e2e_train", "e2e_resume", "e2e_eval", "profile", "psi_ckpt", "step_22g",
                 "step_22g_ckpt", "psi_lora", "step_qwen3"):
        assert f"== {name}: exit 0" in log, name
    ran = [name for name in re.findall(r"^== (\w+) \(timeout", log, re.M) if name != "build"]
    with open(os.path.join(ROOT, "docs", "gpu-check.md"), encoding="utf-8") as f:  # the step table, in order
        table = f.read().split("| step | what | pass |\n")[1].split("\n\n")[0]
    documented = re.findall(r"`(\w+)`", "".join(re.findall(r"^\|([^|]*)\|", table, re.M)[1:]))  # first cells
    assert ran == documented  # the order docs/gpu-check.md gives: what a call's budget cuts comes last
    summary = (out / "summary.md").read_text()  # the step's target read from this call's step_off
    assert re.search(r"target: the default step x2.5 faster than every lever off .*\| (met|short): step_default x",
                     summary), summary
    load = lambda name: json.loads((out / f"{name}.json").read_text())
    assert load("probe")["missing_apis"] == [] and load("probe")["sdpa"]["MATH"]["padding_rows_finite"]
    for name in ("psi_levers", "psi_ckpt"):
        r = load(name)
        assert r["psi_std_max"] == 0.0 and r["lr"] == 0.0 and r["varied_prompts"] == 60, name
        assert r["levers"] == {"verify_workers": 0, "pack_groups": "on", "full_rows": "on", "static_cache": "on",
                               "compile_head": True, "compile_layers": True, "sampler": "gumbel",
                               "defer_stop_check": True}, name
        assert r["verify_processes"] == min(len(os.sched_getaffinity(0)), 16), name  # the pool ran the verifier
    assert load("psi_ckpt")["gradient_checkpointing"] and not load("psi_levers")["gradient_checkpointing"]
    assert load("psi_ckpt")["ref_reset_every"] == 2 and load("psi_levers")["ref_reset_every"] == 1  # a frozen pi_ref
    for name in ("step_default", "step_opt", "step_off", "step_dynamic", "step_flex", "step_defer", "step_shared",
                 "step_22g", "step_22g_ckpt"):
        r = load(name)
        for key in ("generate_s", "old_logprobs_s", "update_s", "generated_tokens_per_s", "generate_peak_gib",
                    "update_peak_gib", "plan_generate_gib", "plan_update_gib", "decode_ms_per_token"):
            assert r[key] > 0, (name, key)
        assert r["steps"][0]["generate_peak_bytes"] > 0 and r["steps"][0]["update_peak_bytes"] > 0
    assert load("psi_levers")["compile_s"] > 0 and "compile_s" not in load("step_default")
    assert load("psi_levers")["compile_update_s"] > 0 and "compile_update_s" not in load("step_default")
    assert load("step_dynamic")["levers"]["static_cache"] == "off" and load("step_dynamic")["verify_processes"] == 1
    assert load("step_flex")["levers"]["static_cache"] == "flex"
    assert load("step_defer")["levers"] == {**load("step_default")["levers"], "defer_stop_check": True}
    levers = [v for k, v in re.findall(r"^\| (lever [^|]*?) +\| (.*) \|$", summary, re.M)]
    assert len(levers) == 5 and not any(v.startswith("not measured") for v in levers), levers  # every A/B ran
    assert load("step_off")["levers"] == {**load("step_default")["levers"], "pack_groups": "off", "full_rows": "off",
                                          "static_cache": "off", "verify_workers": 1}
    assert load("step_opt")["levers"] == {**load("step_default")["levers"], "static_cache": "flex",
                                          "compile_head": True, "compile_layers": True, "sampler": "gumbel",
                                          "defer_stop_check": True}
    attn = load("attn")["forms"]  # cuDNN's kernel is CUDA's only
    assert set(attn) == {"sdpa", "sdpa-filled", "bmm", "bmm-compiled", "flex", "sample-hf", "sample-gumbel"}, attn
    from torch._inductor import cpu_vec_isa
    if not cpu_vec_isa.pick_vec_isa():
        assert "vector ISA" in attn.pop("flex")["skipped"]  # inductor compiles flex on the CPU with one only
    assert all(v["ms"] > 0 for v in attn.values()) and all(v["max_abs_diff"] < 1e-4 for k, v in attn.items()
                                                            if not k.startswith("sample"))
    assert set(load("decode")["profiles"]) == {"decode_dynamic_4x4", "decode_static_4x4"}
    assert not load("decode")["forms"]  # --forms "": the decode profiles alone
    assert load("step_shared")["levers"]["pack_groups"] == "off"
    assert set(load("forms")["forms"]) == {"full-4", "layersc-4", "head-4", "headc-4"}
    assert all(v["fwd_bwd_s"] > 0 for v in load("forms")["forms"].values())
    assert load("step_22g")["memory_gib"] == 22.5 and load("step_22g")["allocator_cap_gib"] is None  # CPU: no cap
    assert load("step_22g_ckpt")["gradient_checkpointing"] and not load("step_22g")["gradient_checkpointing"]
    assert load("profile")["kernels"] and set(load("profile")["phases"]) == {"time_update", "time_old_logprobs",
                                                                            "time_verify"}
    rows = [json.loads(line) for line in (out / "e2e_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["time_save"] > 0 and "eval_acc" in rows[2]
    assert set(load("results")) >= {"status", "probe", "step_default", "step_shared", "psi_levers", "forms",
                                    "e2e_eval"}
    summary = (out / "summary.md").read_text()
    assert summary == stdout[stdout.index("| check"):]
    assert summary.count("| pass: psi_std 0.0") == 4 and summary.count("| pass: exit 0") == 3  # psi_lora, step_qwen3
    for row in (r"--compile-layers: speed-up on one mini-batch \(layersc-4 against full-4\) +\| forward \+ backward",
                r"--compile-head: speed-up on one mini-batch \(headc-4 against head-4\) +\| forward \+ backward",
                r"the opt-in levers together: speed-up over the defaults \(same card, same call\) +\| step x\d"):
        assert re.search(r"\| " + row, summary), row
    # but the LoRA step's peaks: at the tiny shape the CPU's process holds a few tens of MB beyond the plan's terms,
    # which a frozen base no longer covers with full fine-tuning's slack (AdamW's moments, the head's gradients)
    qwen3_peaks = re.compile(r"^\| Qwen3-4B stand-in, v2's prompt, LoRA rank 16: peaks +\| (within the plan|FAIL: "
                             r"over the plan): generate .*\n", re.M)
    assert len(qwen3_peaks.findall(summary)) == 1
    assert "FAIL" not in qwen3_peaks.sub("", summary) and "no result" not in summary


def test_rollout_kl_records_the_samplers_and_the_trainers_log_probs(tiny_model_dir):
    """benchmarks/rollout_kl.py swaps pacs.generate_exactly and pacs.token_logprobs for recorders of the logits: they
    take the run's calls as they are made (generate_groups passes the speed levers), and in fp32, with no autocast,
    the sampler's and the trainer's log-probs of the same tokens agree."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import rollout_kl
    model, tok = plumbing.load_model(tiny_model_dir)
    args = types.SimpleNamespace(group_size=2, max_new_tokens=4)
    prompts = [plumbing.build_prompt(tok, "1 + 6 ="), plumbing.build_prompt(tok, "12 + 3 =")]
    torch.manual_seed(0)
    roll, sampler = rollout_kl.sampler_logprobs(model, tok, prompts, args)  # (n, V)
    trainer = rollout_kl.trainer_logprobs(model, roll, args, autocast="off")  # (n, V)
    assert sampler.shape == trainer.shape and sampler.shape[0] == int(roll["response_mask"].sum())
    torch.testing.assert_close(trainer, sampler, rtol=1e-4, atol=1e-4)
