"""One PACS step of the default configuration on the Qwen2.5-0.5B stand-in: time split, throughput, memory.

The stand-in is Qwen2.5-0.5B-Instruct's exact architecture with random weights, its real tokenizer, chat
template and generation config (../shared/models/qwen2.5-0.5b-instruct: no weights needed). Prompts are
MATH problems from ../shared/data cut to exactly --max-prompt-tokens, and every response is forced to
--max-new-tokens (EOS banned before that), so the work is the default run's worst case. It runs pacs.py's
own code (setup_model, train_step) and prints the step time split (generate / old log-probs / update),
generated tokens/s, peak memory against pacs.py's memory plan (on CUDA the allocated peak, beside the reserved
peak and the device's own count of memory in use), the update's model-FLOPs utilisation and the projected wall
time of the default 300-step run.

    python benchmarks/gpu_step.py                             # CUDA, all pacs.py defaults
    python benchmarks/gpu_step.py --memory-gib 24             # what a 24 GB card gets (plan picks sizes)
    python benchmarks/gpu_step.py --device cpu --tiny         # smoke test: 2 small layers, real vocab
    python benchmarks/gpu_step.py --device cpu --max-prompt-tokens 64 --max-new-tokens 64 \\
        --prompts-per-step 2 --num-mini-batches 2 --timed-steps 1   # real shape on a CPU: plan vs peak RSS

Any pacs.py flag passes through (--micro-batch-size, --gen-batch-prompts, --gradient-checkpointing, ...).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import pacs  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared")
# dense bf16 peak (TFLOP/s) by device name, for model-FLOPs utilisation
PEAK_TFLOPS = {"H200": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.0,
               "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.2, "RTX 3090": 71.0}


def build_standin(model_dir, out, tiny, seed=0):
    """save_pretrained dir: the model_dir architecture with random weights, its tokenizer and generation config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    small = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16)  # --tiny: 2 small layers, the real 151,936 vocab
    config = AutoConfig.from_pretrained(model_dir, **(small if tiny else {}))
    if tiny:
        config.layer_types = config.layer_types[:config.num_hidden_layers]  # one attention type per layer
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


def fixed_length_prompts(tokenizer, n, length, data_dir):
    """n chat-template prompts of exactly `length` tokens, made of MATH problems (synthetic ones offline)."""
    path = os.path.join(data_dir, "math_train.jsonl")
    rows = pacs.load_problems(path) if os.path.isfile(path) else pacs.synthetic_problems(1000, 0)
    texts = [p["problem"] for p in rows]
    overhead = len(tokenizer(pacs.build_prompt(tokenizer, ""), add_special_tokens=False)["input_ids"])
    if length <= overhead:
        sys.exit(f"gpu_step.py: error: --max-prompt-tokens {length} is not above the template's {overhead} tokens")
    prompts, i = [], 0
    for _ in range(n):
        ids = []
        while len(ids) < length - overhead:  # problems back to back until long enough, then cut
            ids += tokenizer(texts[i % len(texts)] + "\n", add_special_tokens=False)["input_ids"]
            i += 1
        k = length - overhead
        while True:  # decoding and re-encoding a cut can change the count by a token: cut until it fits
            prompt = pacs.build_prompt(tokenizer, tokenizer.decode(ids[:k]))
            if len(tokenizer(prompt, add_special_tokens=False)["input_ids"]) <= length:
                break
            k -= 1
        prompts.append({"id": str(len(prompts)), "problem": tokenizer.decode(ids[:k]), "answer": "0"})
    return prompts


def rss_bytes(field="VmRSS"):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM)


def peak_bytes(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()
    return rss_bytes("VmHWM")


def cuda_memory():
    """What the card holds beyond the tensors: the caching allocator's reserved peak (tensors plus the free blocks
    it keeps: fragmentation, the usual cause of an OOM on a card the tensors fit), and the device's own count of
    memory in use (mem_get_info: reserved memory, the CUDA context, other processes) out of its total."""
    free, total = torch.cuda.mem_get_info()
    return {"reserved_peak_bytes": torch.cuda.max_memory_reserved(), "device_used_bytes": total - free,
            "device_total_bytes": total}


def cuda_memory_text(m):
    """The numbers of cuda_memory (bytes), printed beside max_memory_allocated."""
    return (f"reserved {m['reserved_peak_bytes'] / pacs.GiB:.2f} GiB (max_memory_reserved) | device in use "
            f"{m['device_used_bytes'] / pacs.GiB:.2f} of {m['device_total_bytes'] / pacs.GiB:.2f} GiB (mem_get_info)")


def update_flops(config, n_params, prompt_tokens, response_tokens, rows, groups):
    """Model FLOPs of the update phase (forward + backward = 3x forward; recomputation not counted)."""
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    qd = config.num_attention_heads * pacs.head_dim(config)
    matmul_params = n_params - V * H  # the embedding lookup is free; the (tied) LM head is counted below
    tokens = groups * prompt_tokens + rows * response_tokens  # each prompt once per group (shared KV cache)
    S = prompt_tokens + response_tokens
    attention = rows * 2 * 2 * L * qd * (S * S - prompt_tokens * prompt_tokens) / 2  # causal QK^T and AV
    forward = 2 * matmul_params * tokens + 2 * V * H * rows * response_tokens + attention
    return 3 * forward


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Other arguments are pacs.py flags (python pacs.py --help).")
    ap.add_argument("--model-dir", default=os.path.join(SHARED, "models", "qwen2.5-0.5b-instruct"),
                    help="config.json + tokenizer + generation_config of the model to stand in for")
    ap.add_argument("--data-dir", default=os.path.join(SHARED, "data"), help="where math_train.jsonl is")
    ap.add_argument("--tiny", action="store_true", help="2 small layers (real vocab): a smoke test")
    ap.add_argument("--timed-steps", type=int, default=2, help="steps timed after one warm-up step")
    ap.add_argument("--total-steps", type=int, default=300, help="steps of the run to project the wall time of")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="device bf16 peak for MFU (0 = by device name)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--_build", default="", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args._build:  # child process: build the stand-in (its memory never counts in the parent's peak)
        return build_standin(args.model_dir, args._build, args.tiny)
    if not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        sys.exit(f"gpu_step.py: error: no config.json in {args.model_dir} (see ../shared/models/README.md)")
    cfg = pacs.parse_args(["--eval-every", "0", "--save-every", "0", "--save-minutes", "0", *rest])
    try:
        pacs.check_config(cfg)
    except pacs.ConfigError as e:
        sys.exit(f"gpu_step.py: error: {e}")
    device = pacs.resolve_device(cfg.device)
    if device.type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # On the CPU the peak is read from the resident set size. glibc keeps freed blocks below its (dynamic,
        # up to 32 MB) mmap threshold in the heap, so the RSS would count allocator fragmentation that CUDA's
        # max_memory_allocated never sees. Restart with every block over 64 KiB mapped and unmapped on its own.
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"})
    torch.manual_seed(cfg.seed)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, __file__, "--_build", tmp, "--model-dir", args.model_dir,
                        *(["--tiny"] if args.tiny else [])], check=True)
        try:
            model, rollout_model, tokenizer = pacs.setup_model(cfg, tmp, device)
        except pacs.ConfigError as e:
            sys.exit(f"gpu_step.py: error: {e}")
    n_params = sum(p.numel() for p in model.parameters())
    # CPU: what the process holds besides the weights once loaded (interpreter, torch, transformers, the
    # tokenizer); the plan predicts the tensors on top of it. safetensors maps the weights lazily: read every
    # page first, so that they are resident (and counted once) before the baseline is taken
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())
    copy_bytes = 0 if rollout_model is model else sum(p.nbytes for p in rollout_model.parameters())  # the plan's too
    rss_base = rss_bytes() - 4 * n_params - copy_bytes
    plan = pacs.memory_plan(cfg, model.config, n_params, device.type, cfg.micro_batch_size, cfg.gen_batch_prompts)
    problems = fixed_length_prompts(tokenizer, cfg.prompts_per_step * (1 + args.timed_steps), cfg.max_prompt_tokens,
                                    args.data_dir)
    optimizer = pacs.make_optimizer(cfg, model)
    sample = pacs.sample  # force every response to full length: the default run's worst case
    pacs.sample = lambda *a, **k: sample(*a, **k, min_new_tokens=cfg.max_new_tokens)
    rows = []
    for step in range(1 + args.timed_steps):
        reset_peak(device)
        metrics, _ = pacs.train_step(cfg, model, tokenizer, optimizer, problems, step, device, rollout_model)
        if rollout_model is not model:
            pacs.copy_weights(rollout_model, model)
        metrics["peak_bytes"] = peak_bytes(device)
        if device.type == "cuda":
            metrics.update(cuda_memory())
        rows.append(metrics)
        cuda = f" | {cuda_memory_text(metrics)}" if device.type == "cuda" else ""
        print(f"step {step}{' (warm-up)' if step == 0 else ''}: {metrics['step_time']:.1f} s | generate "
              f"{metrics['time_generate']:.1f} | old log-probs {metrics['time_old_logprobs']:.1f} | update "
              f"{metrics['time_update']:.1f} | response len {metrics['response_len']:.0f} | peak "
              f"{metrics['peak_bytes'] / pacs.GiB:.2f} GiB{cuda}", flush=True)
    pacs.sample = sample
    timed = rows[1:] or rows
    mean = lambda k: sum(r[k] for r in timed) / len(timed)
    B, T = cfg.prompts_per_step * cfg.group_size, cfg.max_new_tokens
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    peak_tflops = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    flops = update_flops(model.config, n_params, cfg.max_prompt_tokens, T, B, cfg.prompts_per_step)
    measured = max(r["peak_bytes"] for r in rows)
    predicted = plan["peak"] + (rss_base if device.type == "cpu" else 0)  # CPU: RSS also holds the libraries
    result = {
        "device": name, "params": n_params, "prompts": cfg.prompts_per_step, "group_size": cfg.group_size,
        "prompt_tokens": cfg.max_prompt_tokens, "response_tokens": T, "micro_batch_size": cfg.micro_batch_size,
        "gen_batch_prompts": cfg.gen_batch_prompts, "num_mini_batches": cfg.num_mini_batches,
        "step_s": mean("step_time"), "generate_s": mean("time_generate"), "verify_s": mean("time_verify"),
        "old_logprobs_s": mean("time_old_logprobs"), "update_s": mean("time_update"),
        "generated_tokens_per_s": B * T / mean("time_generate"),
        "peak_gib": measured / pacs.GiB, "plan_gib": predicted / pacs.GiB, "peak_over_plan": measured / predicted,
        "rss_base_gib": rss_base / pacs.GiB if device.type == "cpu" else None,
        **({k: max(r[k] for r in rows) for k in ("reserved_peak_bytes", "device_used_bytes", "device_total_bytes")}
           if device.type == "cuda" else {}),
        "update_tflops": flops / mean("time_update") / 1e12,
        "update_mfu": flops / mean("time_update") / (peak_tflops * 1e12) if peak_tflops else None,
        "projected_run_h": mean("step_time") * args.total_steps / 3600,
    }
    mfu = f"{100 * result['update_mfu']:.1f}% of {peak_tflops:.0f}" if result["update_mfu"] else "n/a (no peak known)"
    print(f"\n{name}: {cfg.prompts_per_step} prompts x {cfg.group_size} = {B} samples of {cfg.max_prompt_tokens} + {T} "
          f"tokens, {cfg.num_mini_batches} mini-batches, micro-batch {cfg.micro_batch_size} rows, "
          f"generate {cfg.gen_batch_prompts} prompts per call")
    print(f"step {result['step_s']:.1f} s = generate {result['generate_s']:.1f} + verify {result['verify_s']:.1f} + "
          f"old log-probs {result['old_logprobs_s']:.1f} + update {result['update_s']:.1f}")
    print(f"generated tokens/s {result['generated_tokens_per_s']:.0f} | update {result['update_tflops']:.1f} "
          f"TFLOP/s, MFU {mfu}")
    print(f"peak memory {result['peak_gib']:.2f} GiB ({'max_memory_allocated' if device.type == 'cuda' else 'peak RSS'})"
          f" vs plan {result['plan_gib']:.2f} GiB"
          f"{f' (incl. {rss_base / pacs.GiB:.2f} of libraries)' if device.type == 'cpu' else ''}: "
          f"measured / plan = {result['peak_over_plan']:.3f}")
    if device.type == "cuda":  # reserved far above allocated: fragmentation (the README's GPU checklist)
        budget = pacs.plan_budget("cuda", pacs.device_memory("cuda", cfg.memory_gib))
        print(f"{cuda_memory_text(result)}; the plan's budget {budget / pacs.GiB:.2f} GiB")
    print(f"projected {args.total_steps} steps: {result['projected_run_h']:.1f} h (no in-loop eval, no checkpoints)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "steps": rows}, f, indent=2)


if __name__ == "__main__":
    main()
