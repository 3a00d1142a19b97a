"""The prepared GPU check's LoRA and Qwen3-4B steps (docs/gpu-check.md), rehearsed on the CPU before any loan: psi_lora
(psi at --lr 0 with a rank-16 adapter whose B is drawn at random, so that psi = 0 can fail) and step_qwen3 (a Qwen3
built from models/qwen3-4b's config on the device, v2's prompt with the real Qwen3 tokenizer, LoRA, its step
extrapolated to 128 x 8 and 1,024 x 8 prompts of 1,024 + 8,192 tokens), with peft imported from the wheel the check
carries; and the extrapolation's arithmetic on its own."""
import gzip
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import pacs
import plumbing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED = os.path.join(ROOT, "..", "shared", "models")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import gpu_check  # noqa: E402
import gpu_step  # noqa: E402

needs_models = pytest.mark.skipif(
    not all(os.path.isfile(os.path.join(SHARED, d, "tokenizer.json")) for d in ("qwen2.5-0.5b-instruct", "qwen3")),
    reason="needs ../shared/models/qwen2.5-0.5b-instruct and qwen3 (the project's shared folder)")
PEFT_WHEEL = os.path.join(ROOT, ".gpu", "wheels", f"peft-{gpu_check.pinned('peft').split('==')[1]}-py3-none-any.whl")
needs_wheel = pytest.mark.skipif(not os.path.isfile(PEFT_WHEEL), reason=f"needs {os.path.relpath(PEFT_WHEEL, ROOT)} "
                                 "(python benchmarks/gpu_check.py prepare --wheels)")
QWEN3_TARGETS = [(128, 8, 1024, 8192), (1024, 8, 1024, 8192)]


def test_the_check_carries_peft_as_requirements_txt_pins_it():
    with open(os.path.join(ROOT, "requirements.txt")) as f:
        pin = next(line.split("#")[0].strip() for line in f if line.startswith("peft"))
    assert pin == "peft==0.21.2" and pin in gpu_check.WHEELS and "transformers==5.24.0" in gpu_check.WHEELS
    assert {"peft.get_peft_model", "peft.LoraConfig"} <= set(gpu_check.APIS)  # the probe names it where missing


@needs_models
@needs_wheel
def test_the_lora_and_qwen3_steps_rehearse_on_the_cpu_with_peft_from_the_carried_wheel(tmp_path):
    gpu_dir, out = tmp_path / "gpu", tmp_path / "out"
    prep = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_check.py"), "prepare", "--dest",
                           str(gpu_dir)], capture_output=True, text=True, timeout=60)
    assert prep.returncode == 0, prep.stderr
    assert sorted(os.listdir(gpu_dir / "qwen3-4b")) == ["config.json", "generation_config.json", "tokenizer.json.gz",
                                                       "tokenizer_config.json"]
    with gzip.open(gpu_dir / "qwen3-4b" / "tokenizer.json.gz", "rb") as f, \
            open(os.path.join(SHARED, "qwen3", "tokenizer.json"), "rb") as g:
        assert f.read() == g.read()  # byte for byte: 2 of 11 MB travel
    (gpu_dir / "wheels").mkdir()
    shutil.copy(PEFT_WHEEL, gpu_dir / "wheels")  # peft's alone: transformers stays the venv's
    env = {**os.environ, "GPU_CHECK_DIR": str(gpu_dir), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "GPU_CHECK_STEPS": "probe psi_lora step_qwen3"}
    proc = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_check.sh"), str(out), "--device", "cpu"],
                          capture_output=True, text=True, timeout=600, env=env)
    log = (out / "check.log").read_text() if (out / "check.log").exists() else ""
    assert proc.returncode == 0, proc.stdout[-3000:] + log[-3000:]
    for name in ("probe", "psi_lora", "step_qwen3"):
        assert f"== {name}: exit 0" in log, name
    assert re.findall(r"^== (\w+) \(timeout", log, re.M) == ["probe", "build", "psi_lora", "step_qwen3"]
    load = lambda name: json.loads((out / f"{name}.json").read_text())  # noqa: E731
    carried = re.compile(r"/gpu-check\.\w+/site/peft/__init__\.py$")  # the scratch folder the wheel went into
    for name in ("probe", "psi_lora", "step_qwen3"):
        assert carried.search(load(name)["peft_file"] or ""), (name, load(name)["peft_file"])
    lora = load("psi_lora")
    assert lora["psi_std_max"] == 0.0 and lora["lr"] == 0.0 and lora["lora_rank"] == 16
    assert lora["random_adapter_entries"] > 0 and lora["model_type"] == "qwen2" and lora["varied_prompts"] == 60
    assert lora["levers"]["static_cache"] == "on" and lora["levers"]["pack_groups"] == "on"  # CUDA's auto, by name
    q = load("step_qwen3")
    assert (q["model_type"], q["vocab"], q["prompt"], q["lora_rank"]) == ("qwen3", 151669, "v2", 16)
    assert q["first_prompt"].startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user")
    assert q["built_on"] == "cpu" and q["build_s"] > 0 and q["random_init"] and q["psi_std_max"] == 0.0
    for key in ("generate_s", "old_logprobs_s", "update_s", "decode_ms_per_token", "generate_peak_gib",
                "plan_generate_gib", "update_peak_gib", "plan_update_gib"):
        assert q[key] > 0, key
    assert [(e["prompts"], e["group_size"], e["prompt_tokens"], e["response_tokens"]) for e in q["extrapolated"]] == \
        QWEN3_TARGETS
    for e in q["extrapolated"]:
        assert e["step_s"] == pytest.approx(e["generate_s"] + e["verify_s"] + e["old_logprobs_s"] + e["update_s"])
        assert e["step_s"] > q["step_s"] and len(e["arithmetic"]) == 7 + e["gradient_checkpointing"]
        for line in e["arithmetic"]:
            assert line in log  # printed, the arithmetic shown
    summary = (out / "summary.md").read_text()
    rows = dict(re.findall(r"^\| (.*?) +\| (.*) \|$", summary, re.M))
    assert rows["psi_std at --lr 0, LoRA rank 16, its B drawn at random"].startswith("pass: psi_std 0.0")
    step = "Qwen3-4B stand-in, v2's prompt, LoRA rank 16"
    assert rows[f"{step}: time"].startswith("step ") and "decode" in rows[f"{step}: time"]
    assert re.match(r"(within the plan|FAIL: over the plan): generate [\d.]+ GiB \(plan ", rows[f"{step}: peaks"])
    assert rows[f"{step}: the build"].startswith("0.01B parameters (2 layers, vocab 151669) built on cpu in ")
    assert rows[f"{step}: psi_std at --lr 0"].startswith("pass")
    for P, G, Lp, T in QWEN3_TARGETS:
        assert re.match(r"\d+ s \([\d.]+ h\) = generate \d+ \+ verify", rows[f"{step}: a step at {P} prompts x {G}, "
                                                                              f"{Lp} + {T} tokens, extrapolated"])
    assert rows["target: psi exactly 0 at --lr 0 on every route"] == \
        "short: psi_levers FAIL, psi_ckpt FAIL, psi_lora pass"  # the two others were not asked for


@pytest.fixture(scope="module")
def qwen3_4b():
    config = plumbing.load_model_config(os.path.join(ROOT, "models", "qwen3-4b"))
    return config, plumbing.count_parameters(config)


def planned(config, n, **kw):
    cfg = pacs.Config(**{"device": "cuda", "memory_gib": 79.0, "lora_rank": 16, "prompt": "v2", "prompts_per_step": 16,
                         "max_prompt_tokens": 1024, "max_new_tokens": 512, **kw})
    sizes, _ = plumbing.plan_memory(cfg, config, n, "cuda", quiet=True)
    return cfg, sizes


MEASURED = {"generate_s": 20.0, "verify_s": 1.0, "old_logprobs_s": 3.0, "update_s": 9.0}


def test_the_extrapolation_gives_back_the_measured_step_at_its_own_shape(qwen3_4b):
    config, n = qwen3_4b
    cfg, sizes = planned(config, n)
    e = gpu_step.extrapolate(cfg, sizes, MEASURED, config, n, 2 * n, "cuda", (16, 8, 1024, 512))
    assert (e["gen_batch_prompts"], e["micro_batch_size"]) == (sizes.gen_batch_prompts, sizes.micro_batch_size)
    for key, value in MEASURED.items():
        assert e[key] == pytest.approx(value), key
    assert e["step_s"] == pytest.approx(33.0) and e["flops_ratio"] == pytest.approx(1.0)
    assert e["arithmetic"][-1] == "  step = 20.0 + 1.0 + 3.0 + 9.0 = 33.0 s (0.01 h)"


def test_the_extrapolation_reads_generate_as_memory_reads_and_the_updates_as_flops(qwen3_4b):
    """generate: each decode step reads the weights and every row's static cache (Lp + T positions), at the rate the
    measured step achieved; phase 3 and the updates: their seconds times the ratio of model FLOPs, on the route the
    plan takes there (on a 79 GiB card v2's tokens need --gradient-checkpointing: a forward more); the verifier:
    samples x tokens."""
    config, n = qwen3_4b
    cfg, sizes = planned(config, n)
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 2  # bf16 bytes a position
    weights = 2 * n
    measured_bytes = (16 // sizes.gen_batch_prompts) * 512 * (weights + sizes.gen_batch_prompts * 8 * 1536 * kv)

    def flops(c, s):
        rows = c.prompts_per_step * 8
        args = (config, n, c.max_prompt_tokens, c.max_new_tokens, rows,
                rows if s.full_rows or c.gradient_checkpointing else c.prompts_per_step)
        return sum(gpu_step.forward_flops(*args)), gpu_step.update_flops(*args, frozen=True,
                                                                         recompute=c.gradient_checkpointing)
    for target in QWEN3_TARGETS:
        e = gpu_step.extrapolate(cfg, sizes, MEASURED, config, n, weights, "cuda", target)
        P, G, Lp, T = target
        with pytest.raises(plumbing.ConfigError, match="the smallest change that fits: --gradient-checkpointing"):
            planned(config, n, prompts_per_step=P, max_new_tokens=T)
        t_cfg, t_sizes = planned(config, n, prompts_per_step=P, max_new_tokens=T, gradient_checkpointing=True)
        assert e["gradient_checkpointing"] and "with --gradient-checkpointing" in e["arithmetic"][1]
        assert (e["gen_batch_prompts"], e["micro_batch_size"]) == (t_sizes.gen_batch_prompts,
                                                                   t_sizes.micro_batch_size)
        reads = (P // e["gen_batch_prompts"]) * T * (weights + e["gen_batch_prompts"] * G * (Lp + T) * kv)
        assert e["generate_s"] == pytest.approx(MEASURED["generate_s"] * reads / measured_bytes)
        assert e["verify_s"] == pytest.approx(MEASURED["verify_s"] * P * T / (16 * 512))
        (f0, u0), (f1, u1) = flops(cfg, sizes), flops(t_cfg, t_sizes)
        assert e["old_logprobs_s"] == pytest.approx(MEASURED["old_logprobs_s"] * f1 / f0)
        assert e["update_s"] == pytest.approx(MEASURED["update_s"] * u1 / u0)
        assert e["step_s"] > 100 * 33.0  # 8,192 new tokens a row: hours, not the measured 33 s
    refused = gpu_step.extrapolate(cfg, sizes, MEASURED, config, n, weights, "cuda", (16, 8, 1024, 2_000_000))
    assert refused["error"].startswith("the plan on this card refuses it, with --gradient-checkpointing too: memory "
                                       "plan: ")


def test_a_frozen_base_takes_two_forwards_of_matmul_flops_not_three(qwen3_4b):
    """LoRA's backward through the frozen base computes the input's gradient alone: the weights' matmuls cost one
    forward less than full fine-tuning's (whose MFU the check reads), the attention the same."""
    config, n = qwen3_4b
    V, H, Lp, T, rows, groups = config.vocab_size, config.hidden_size, 1024, 512, 128, 16
    weights = 2 * (n - V * H) * (groups * Lp + rows * T) + 2 * V * H * rows * T  # one forward's matmuls
    full = gpu_step.update_flops(config, n, Lp, T, rows, groups)
    frozen = gpu_step.update_flops(config, n, Lp, T, rows, groups, frozen=True)
    assert full - frozen == pytest.approx(weights) and full - 3 * weights > 0  # the attention's share stays


def test_bad_extrapolation_targets_are_one_line_errors():
    for spec in ("128x8", "0x8@1024+8192", "128x8@1024+8192,", "axb@c+d"):
        with pytest.raises(SystemExit, match=r"^gpu_step.py: error: --extrapolate .*: expected PROMPTSxGROUP@"):
            gpu_step.parse_targets(spec)
    assert gpu_step.parse_targets(gpu_step.EXTRAPOLATE) == QWEN3_TARGETS


def test_the_summary_reads_the_qwen3_steps_peaks_psi_and_extrapolations(tmp_path):
    def write(name, obj):
        (tmp_path / f"{name}.json").write_text(json.dumps(obj))
    step = "Qwen3-4B stand-in, v2's prompt, LoRA rank 16"
    rows = dict(gpu_check.summary_rows(str(tmp_path)))
    assert rows[step].startswith("FAIL: no result: did not run") and f"{step}: the build" not in rows
    r = {"step_s": 60.0, "generate_s": 30.0, "verify_s": 1.0, "old_logprobs_s": 9.0, "update_s": 20.0,
         "generate_peak_gib": 40.0, "plan_generate_gib": 39.0, "generate_over_plan": 40 / 39, "update_peak_gib": 30.0,
         "plan_update_gib": 35.0, "update_over_plan": 30 / 35, "micro_batch_size": 8, "gen_batch_prompts": 16,
         "params": 4.06e9, "layers": 36, "vocab": 151669, "built_on": "cuda:0", "build_s": 6.5, "prompt": "v2",
         "peft": "0.21.2", "lr": 0.0, "psi_std_max": 1e-3,
         "extrapolated": [{"target": "128 prompts x 8, 1024 + 8192 tokens", "step_s": 7200.0, "generate_s": 6000.0,
                           "verify_s": 60.0, "old_logprobs_s": 240.0, "update_s": 900.0, "gen_batch_prompts": 4,
                           "micro_batch_size": 8},
                          {"target": "1024 prompts x 8, 1024 + 8192 tokens", "error": "the plan refuses it"}]}
    write("step_qwen3", r)
    rows = dict(gpu_check.summary_rows(str(tmp_path)))
    assert rows[f"{step}: peaks"].startswith("FAIL: over the plan: generate 40.00 GiB (plan 39.00, x1.026)")
    assert rows[f"{step}: the build"] == ("4.06B parameters (36 layers, vocab 151669) built on cuda:0 in 6.5 s; "
                                          "prompt v2, peft 0.21.2")
    assert rows[f"{step}: psi_std at --lr 0"].startswith("FAIL: psi_std 0.001")
    assert rows[f"{step}: a step at 128 prompts x 8, 1024 + 8192 tokens, extrapolated"] == (
        "7200 s (2.00 h) = generate 6000 + verify 60 + old log-probs 240 + updates 900; 4 prompts a generate call, "
        "micro-batch 8 rows (the arithmetic: check.log)")
    assert rows[f"{step}: a step at 1024 prompts x 8, 1024 + 8192 tokens, extrapolated"] == "the plan refuses it"
    write("step_qwen3", {**r, "generate_over_plan": 0.99, "psi_std_max": 0.0})
    rows = dict(gpu_check.summary_rows(str(tmp_path)))
    assert rows[f"{step}: peaks"].startswith("within the plan")
    assert rows[f"{step}: psi_std at --lr 0"].startswith("pass")
