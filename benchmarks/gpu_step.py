"""One PACS step of the default configuration on the Qwen2.5-0.5B stand-in: time split, throughput, memory.

The stand-in is Qwen2.5-0.5B-Instruct's exact architecture with random weights, its real tokenizer, chat
template and generation config (../shared/models/qwen2.5-0.5b-instruct: no weights needed). Prompts are
MATH problems from ../shared/data cut to exactly --max-prompt-tokens (--varied-prompts N: to lengths drawn from
N..--max-prompt-tokens, so that generate and the trainer meet left padding), and every response is forced to
--max-new-tokens (EOS banned before that), so the work is the default run's worst case. It runs pacs.py's
own code (pick_device, setup_model, train_step) and prints the step time split (generate / old log-probs /
update), generated tokens/s, the peak memory of generate and of the update (read and reset between them) against
pacs.py's memory plan (on CUDA the allocated peaks, beside the reserved peaks and the device's own count of memory
in use), the update's model-FLOPs utilisation and the projected wall time of the default 300-step run. On CUDA,
--memory-gib also caps PyTorch's allocator (cap_allocator), so that a large card meets a small one's limit.
--random-init DIR builds another architecture on the device from DIR's config alone (random weights, the build
timed), --random-adapter draws a LoRA adapter's B at random, and --extrapolate prints the time of a step at other
shapes from the measured one, its arithmetic line by line (extrapolate).

    python benchmarks/gpu_step.py                             # CUDA, all pacs.py defaults
    python benchmarks/gpu_step.py --memory-gib 22.5           # a 24 GB card: its plan, under its allocator limit
    python benchmarks/gpu_step.py --lr 0 --varied-prompts 128 --expect-psi-zero   # psi == 0 at pi_old, or exit 1
    python benchmarks/gpu_step.py --device cpu --tiny         # smoke test: 2 small layers, real vocab
    python benchmarks/gpu_step.py --lora-rank 16 --random-adapter --lr 0 --expect-psi-zero # an adapter that acts
    python benchmarks/gpu_step.py --random-init .gpu/qwen3-4b --prompt v2 --lora-rank 16 --max-prompt-tokens 1024 \\
        --extrapolate                      # Qwen3-4B built on the card; a step at 128 x 8 and 1,024 x 8, 1,024 + 8,192
    python benchmarks/gpu_step.py --device cpu --max-prompt-tokens 64 --max-new-tokens 64 \\
        --prompts-per-step 2 --num-mini-batches 2 --timed-steps 1   # real shape on a CPU: plan vs peak RSS

Any pacs.py flag passes through (--micro-batch-size, --gen-batch-prompts, --gradient-checkpointing, ...).
benchmarks/gpu_check.sh runs this several times as one prepared GPU check (docs/gpu-check.md).
"""
import argparse
import copy
import dataclasses
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import levers  # noqa: E402
import pacs  # noqa: E402
import plumbing  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared")
# dense bf16 peak (TFLOP/s) by device name, for model-FLOPs utilisation
PEAK_TFLOPS = {"H200": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0, "H100": 989.4, "A100": 312.0, "L40S": 362.0,
               "L4": 121.0, "A10G": 70.0, "A10": 125.0, "RTX 4090": 165.2, "RTX 3090": 71.0}


SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)  # --tiny: 2 small layers, the real 151,936 vocab


def standin_config(model_dir, tiny):
    """model_dir's config (--tiny: SMALL's 2 small layers, the rest as it is)."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(model_dir, **(SMALL if tiny else {}))
    if tiny and getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:config.num_hidden_layers]  # one attention type per layer
    if tiny and getattr(config, "max_window_layers", None):
        config.max_window_layers = config.num_hidden_layers
    return config


def build_standin(model_dir, out, tiny, seed=0):
    """save_pretrained dir: the model_dir architecture with random weights, its tokenizer and generation config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    config = standin_config(model_dir, tiny)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig.from_pretrained(model_dir)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


def weightless_standin(model_dir, out, tiny):
    """--random-init: out gets model_dir's config (--tiny: shrunk), generation config and tokenizer, no weights
    (tokenizer.json may travel gzipped, as tokenizer.json.gz): the model is built from them on the device."""
    import gzip
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        sys.exit(f"gpu_step.py: error: --random-init {model_dir}: no config.json there")
    standin_config(model_dir, tiny).save_pretrained(out)
    for name in ("generation_config.json", "tokenizer_config.json", "tokenizer.json"):
        source = os.path.join(model_dir, name)
        if os.path.isfile(source):
            shutil.copyfile(source, os.path.join(out, name))
        elif name == "tokenizer.json" and os.path.isfile(source + ".gz"):
            with gzip.open(source + ".gz", "rb") as f, open(os.path.join(out, name), "wb") as g:
                shutil.copyfileobj(f, g)
        elif name != "generation_config.json":
            sys.exit(f"gpu_step.py: error: --random-init {model_dir}: no {name} (or {name}.gz) there")


def random_init_loader(timing, seed=0):
    """plumbing.load_model for --random-init: the model of a weightless_standin directory built on the device itself
    with random weights (never on disk: Qwen3-4B's fp32 weights would be 16 GB to write and read), with its tokenizer
    and generation config as load_model gives them; the build's seconds and where it ran go into timing."""
    def load(name, device="cpu", dtype=torch.float32, base=""):
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        torch.manual_seed(seed)
        with device:  # the weights are drawn where they live
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name), dtype=dtype)
        timing["built_on"] = str(next(model.parameters()).device)
        model = model.to(device).eval()
        if os.path.isfile(os.path.join(name, "generation_config.json")):
            model.generation_config = GenerationConfig.from_pretrained(name)
        if device.type == "cuda":
            torch.cuda.synchronize()
        timing["build_s"] = time.time() - t0
        tokenizer = AutoTokenizer.from_pretrained(name)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model.name_or_path = os.path.abspath(name)
        print(f"--random-init: {model.config.model_type} of {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B "
              f"parameters built on {timing['built_on']} in {timing['build_s']:.1f} s", flush=True)
        return model, tokenizer
    return load


def randomize_adapter(model, seed=1):
    """--random-adapter: every LoRA B drawn at random (normal, the base's initializer_range as its std) instead of
    peft's zeros, so that the adapter adds something and a forward that skips it (or runs it otherwise in one phase)
    moves psi off 0 at --lr 0. Returns the number of B entries drawn."""
    std = getattr(model.config, "initializer_range", 0.02)
    gen = torch.Generator().manual_seed(seed)
    drawn = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
                drawn += p.numel()
    return drawn


def fixed_length_prompts(tokenizer, n, length, data_dir, prompt="official", thinking=True):
    """n chat-template prompts of exactly `length` tokens, made of MATH problems (synthetic ones offline)."""
    return prompts_of_lengths(tokenizer, [length] * n, data_dir, prompt, thinking)


def varied_length_prompts(tokenizer, n, shortest, longest, data_dir, seed=0, prompt="official", thinking=True):
    """n chat-template prompts of lengths drawn uniformly from shortest..longest tokens (seeded): batches of them are
    left-padded, as a real run's are."""
    rng = random.Random(seed)
    return prompts_of_lengths(tokenizer, [rng.randint(shortest, longest) for _ in range(n)], data_dir, prompt,
                              thinking)


def prompts_of_lengths(tokenizer, lengths, data_dir, prompt="official", thinking=True):
    """Chat-template prompts of exactly these token lengths, made of MATH problems (synthetic ones offline), each
    rendered as --prompt and --thinking render it (plumbing.build_prompt; kept as the problem's "prompt")."""
    path = os.path.join(data_dir, "math_train.jsonl")
    rows = plumbing.load_problems(path) if os.path.isfile(path) else plumbing.synthetic_problems(1000, 0)
    texts = [p["problem"] for p in rows]
    render = lambda text: plumbing.build_prompt(tokenizer, text, prompt, thinking)  # noqa: E731
    overhead = len(tokenizer(render(""), add_special_tokens=False)["input_ids"])
    if min(lengths) <= overhead:
        sys.exit(f"gpu_step.py: error: a prompt of {min(lengths)} tokens is not above the template's {overhead}")
    prompts, i = [], 0
    for length in lengths:
        ids = []
        while len(ids) < length - overhead:  # problems back to back until long enough, then cut
            ids += tokenizer(texts[i % len(texts)] + "\n", add_special_tokens=False)["input_ids"]
            i += 1
        k = length - overhead
        while True:  # decoding and re-encoding a cut can change the count by a token: cut until it fits
            text = render(tokenizer.decode(ids[:k]))
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= length:
                break
            k -= 1
        prompts.append({"id": str(len(prompts)), "problem": tokenizer.decode(ids[:k]), "answer": "0", "prompt": text})
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
    return (f"reserved {m['reserved_peak_bytes'] / plumbing.GiB:.2f} GiB (max_memory_reserved) | device in use "
            f"{m['device_used_bytes'] / plumbing.GiB:.2f} of {m['device_total_bytes'] / plumbing.GiB:.2f} GiB "
            "(mem_get_info)")


def forward_flops(config, n_params, prompt_tokens, response_tokens, rows, groups):
    """(the weights' matmuls, the attention's): model FLOPs of one forward over a step's rows, each prompt once per
    group (groups = rows: every row whole)."""
    H, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    qd = config.num_attention_heads * plumbing.head_dim(config)
    matmul_params = n_params - V * H  # the embedding lookup is free; the (tied) LM head is counted below
    tokens = groups * prompt_tokens + rows * response_tokens  # each prompt once per group (shared KV cache)
    S = prompt_tokens + response_tokens
    attention = rows * 2 * 2 * L * qd * (S * S - prompt_tokens * prompt_tokens) / 2  # causal QK^T and AV
    return 2 * matmul_params * tokens + 2 * V * H * rows * response_tokens, attention


def update_flops(config, n_params, prompt_tokens, response_tokens, rows, groups, frozen=False, recompute=False):
    """Model FLOPs of the update phase (forward + backward = 3x forward; recompute: --gradient-checkpointing's one
    forward more, else not counted). frozen (LoRA): the base's matmuls and the head take no weight gradient, so
    their backward is one forward (the input's gradient), the attention's still two (the adapter's own FLOPs,
    rank x (in + out) a token, left out)."""
    weights, attention = forward_flops(config, n_params, prompt_tokens, response_tokens, rows, groups)
    return (2 if frozen else 3) * weights + 3 * attention + (weights + attention if recompute else 0)


def sample_full_length(sample, device, min_new_tokens, phase, on_return=None):
    """pacs.sample with every response forced to min_new_tokens (EOS banned before: the default run's worst case; its
    rollout_generation_config, which keeps samples from pi, is wrapped for the call), which records generate's peak
    into phase (and on CUDA its reserved peak) and then resets the peak, so that the peak read after train_step is the
    update's alone: old log-probs and updates, each phase against its own plan."""
    def forced_length_config(*a, make_config=pacs.rollout_generation_config, **k):
        config = make_config(*a, **k)
        config.min_new_tokens = min_new_tokens
        return config

    def wrapped(*a, **k):
        make_config, pacs.rollout_generation_config = pacs.rollout_generation_config, forced_length_config
        try:
            out = sample(*a, **k)
        finally:
            pacs.rollout_generation_config = make_config
        phase["generate_peak_bytes"] = peak_bytes(device)
        if device.type == "cuda":
            phase["generate_reserved_bytes"] = torch.cuda.max_memory_reserved()
        reset_peak(device)
        if on_return is not None:
            on_return()
        return out
    return wrapped


def start_profiler(device):
    """A torch.profiler recording CPU ops and, on CUDA, kernels; started at once."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.__enter__()
    return prof


def top_kernels(prof, cuda, top=25):
    """(the `top` kernels (CUDA) or ops (CPU) by self time: name, calls, ms, share of all; the total ms) of a stopped
    torch.profiler."""
    rows = [(e.key, e.count, (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e3)
            for e in prof.key_averages()]
    total = sum(ms for _, _, ms in rows) or 1.0
    return [{"name": name[:160], "calls": calls, "ms": ms, "share": ms / total}
            for name, calls, ms in sorted(rows, key=lambda r: -r[2])[:top]], total


def print_kernels(kernels, lines=10):
    for k in kernels[:lines]:
        print(f"  {100 * k['share']:5.1f}%  {k['ms']:9.1f} ms  {k['calls']:7d}x  {k['name'][:90]}", flush=True)


def profile_table(prof, metrics, device, top=25):
    """{kernels: the `top` kernels (CUDA) or ops (CPU) by self time: name, calls, ms, share of all; phases: each
    profiled phase's wall seconds and the seconds the device ran kernels in it (a low share: launch- or host-bound)},
    from a profiler stopped after the step. The phases' windows follow train_step's own timings, counted back from
    the profiled window's end (with verifier processes, the step's wait for their verdicts comes after phase 3 but
    is counted in time_verify: phase 3's window then starts that much early)."""
    cuda = device.type == "cuda"
    kernels, total = top_kernels(prof, cuda, top)
    events = [e for e in prof.events() if (e.device_type.name == "CUDA") == cuda and e.time_range.elapsed_us() > 0]
    if not events:
        return {"kernels": kernels, "phases": {}}
    end = max(e.time_range.end for e in events)  # us: the window ends with the step's last kernel
    phases, stop = {}, end
    for name in ("time_update", "time_old_logprobs", "time_verify"):  # backwards from the end of the step
        start = stop - metrics[name] * 1e6
        busy = sum(min(e.time_range.end, stop) - max(e.time_range.start, start) for e in events
                   if e.time_range.end > start and e.time_range.start < stop) / 1e6 if cuda else None
        phases[name] = {"wall_s": metrics[name], "device_busy_s": busy,
                        "busy_share": busy / metrics[name] if busy is not None and metrics[name] else None}
        stop = start
    return {"kernels": kernels, "kernel_ms_total": total, "phases": phases}


def cap_allocator(memory_gib):
    """Cap PyTorch's CUDA allocator at what a card that reports memory_gib GiB leaves it, less the CUDA context (which
    lives outside the allocator), with torch.cuda.set_per_process_memory_fraction: --memory-gib alone changes the
    plan, not the allocator, so an 80 GB card would never meet a 24 GB card's fragmentation, out-of-memory errors
    and pacs.py's retries. Returns (the fraction of the device, the bytes it allows)."""
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, (memory_gib * plumbing.GiB - plumbing.CUDA_CONTEXT) / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return fraction, fraction * total


def allocator_state():
    """The CUDA allocator's own counts: its retries after a failed cudaMalloc (flushing its cache, a sign of
    fragmentation), the out-of-memory errors it raised, and whether its segments are expandable."""
    stats = torch.cuda.memory_stats()
    try:
        expandable = any(seg.get("is_expandable", False) for seg in torch.cuda.memory_snapshot())
    except Exception:  # noqa: BLE001 (an older snapshot format: unknown)
        expandable = None
    return {"alloc_retries": stats.get("num_alloc_retries", 0), "ooms": stats.get("num_ooms", 0),
            "expandable_segments": expandable}


def time_generate(args, cfg, sample, rollout_model, tokenizer, problems, sizes, device, result, n_steps):
    """--generate-only: each step's prompts through pacs.sample alone, every response forced to full length; prints
    and writes (--json) the seconds and ms per decoded token of each call."""
    calls = []
    for step in range(n_steps):
        batch = plumbing.prompts_of(tokenizer, problems[step * cfg.prompts_per_step:(step + 1) * cfg.prompts_per_step])
        forced = sample_full_length(sample, device, cfg.max_new_tokens, {})
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.time()
        forced(rollout_model, tokenizer, batch, cfg.group_size, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
               batch_prompts=sizes.gen_batch_prompts, speed=levers.on_device(cfg, device.type))
        seconds = time.time() - t0
        calls.append({"seconds": seconds, "ms_per_token": 1e3 * seconds / cfg.max_new_tokens,
                      "rows": cfg.prompts_per_step * cfg.group_size})
        print(f"generate {step}: {seconds:.2f} s, {calls[-1]['ms_per_token']:.2f} ms per token at "
              f"{calls[-1]['rows']} rows (static cache: {levers.on_device(cfg, device.type).cache_tokens > 0})",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "generate_calls": calls}, f, indent=2)


def compile_log_prob_forwards(cfg, sample, model, rollout_model, tokenizer, problems, sizes, device):
    """--compile-layers' and --compile-head's graphs compiled before the timed steps: phase 3 (eval, no grad) and phase
    4 (train, forward and backward) on one micro-batch of 4-token responses to the run's prompts, on the run's route.
    Their graphs are dynamic, so the steps' shapes reuse them; the weights and the random state are left as they
    were. The responses come from the dynamic KV cache: another batch shape would compile the static cache's decode
    step again."""
    groups = max(1, sizes.micro_batch_size // cfg.group_size)
    prompts = plumbing.prompts_of(tokenizer, problems[:groups])
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if device.type == "cuda" else []):  # as if
        roll = sample(rollout_model, tokenizer, prompts, cfg.group_size, 4)  # never called: the steps' samples
    roll = {k: v.to(device) for k, v in roll.items()}
    rows = slice(0, min(sizes.micro_batch_size, roll["response_ids"].shape[0]))
    with plumbing.autocast_context(cfg, device):
        with torch.no_grad():
            pacs.step_logprobs(cfg, model, roll, rows, sizes, with_entropy=True)
        model.train()
        pacs.step_logprobs(cfg, model, roll, rows, sizes)[0].sum().backward()
    model.eval()
    model.zero_grad(set_to_none=True)


# --extrapolate's default: pacs.py's 128 prompts x 8 and paper v2's 1,024 x 8, both at v2's 1,024 + 8,192 tokens
EXTRAPOLATE = "128x8@1024+8192,1024x8@1024+8192"


def parse_targets(spec):
    """--extrapolate 'PxG@LP+T,...' -> [(prompts, group size, prompt tokens, new tokens)]; a one-line error else."""
    targets = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)@(\d+)\+(\d+)\s*", item)
        if not m or min(int(g) for g in m.groups()) < 1:
            sys.exit(f"gpu_step.py: error: --extrapolate {spec!r}: expected PROMPTSxGROUP@PROMPT_TOKENS+NEW_TOKENS, "
                     f"comma-separated, each at least 1 (e.g. {EXTRAPOLATE})")
        targets.append(tuple(int(g) for g in m.groups()))
    return targets


def read_positions(cfg, speed):
    """Key positions a decode step's attention reads per row, on average over a response: --static-cache's whole
    fixed-size cache (its SDPA reads every position, the empty ones masked), else the filled part (flex: its filled
    blocks), Lp + T / 2."""
    if speed.cache_tokens and not speed.flex:
        return cfg.max_prompt_tokens + cfg.max_new_tokens
    return cfg.max_prompt_tokens + cfg.max_new_tokens / 2


def extrapolate(cfg, sizes, measured, config, n_params, weight_bytes, device_type, target):
    """One step at target (prompts, group size, prompt tokens, new tokens) from the measured step alone, on the same
    card and levers: {its phases' seconds, the plan's sizes there, the arithmetic line by line}, or {error} where the
    plan refuses it. generate as memory reads: each decode step reads the rollout weights once and each row's KV
    cache (read_positions), at the rate the measured generate achieved (its bytes over its seconds, prefill and
    sampling included), in as many calls as the plan's prompts per generate call at the target make; old log-probs
    and updates: the measured seconds times the ratio of a forward's and of the updates' model FLOPs (forward_flops,
    update_flops, on the route each plan takes: the prompt shared per group or full rows); the verifier: its seconds
    times the ratio of samples x new tokens. A target the plan refuses as measured is planned, and priced, with
    --gradient-checkpointing (pacs.py's own smallest change for the update), as a user would run it."""
    P, G, Lp, T = target
    t_cfg = dataclasses.replace(cfg, prompts_per_step=P, group_size=G, max_prompt_tokens=Lp, max_new_tokens=T,
                                micro_batch_size=0, gen_batch_prompts=0)
    name, note = f"{P} prompts x {G}, {Lp} + {T} tokens", []
    try:
        plumbing.check_config(t_cfg)
    except plumbing.ConfigError as e:
        return {"target": name, "error": str(e)}
    try:
        t_sizes, _ = plumbing.plan_memory(t_cfg, config, n_params, device_type, quiet=True, hint=False)
    except plumbing.ConfigError as e:  # as a user would run it: with --gradient-checkpointing where that fits
        ckpt_cfg = dataclasses.replace(t_cfg, gradient_checkpointing=True)
        try:
            t_sizes, _ = plumbing.plan_memory(ckpt_cfg, config, n_params, device_type, quiet=True, hint=False)
        except plumbing.ConfigError:
            return {"target": name, "error": f"the plan on this card refuses it, with --gradient-checkpointing too: "
                                             f"{e}"}
        t_cfg = ckpt_cfg
        note = [f"  (as measured the plan refuses it: {e}; so with --gradient-checkpointing, its recompute priced as "
                "one more forward of the updates)"]
    speed, t_speed = levers.on_device(cfg, device_type), levers.on_device(t_cfg, device_type)
    a_roll = 2 if speed.rollout_dtype == torch.bfloat16 else 4
    kv = config.num_hidden_layers * 2 * config.num_key_value_heads * plumbing.head_dim(config) * a_roll  # a token
    GB, KB = 1e9, 1e3

    def reads(c, s, spd):  # (calls, decode steps a call, rows a call, positions a row, bytes a decode step)
        rows, positions = s.gen_batch_prompts * c.group_size, read_positions(c, spd)
        return (c.prompts_per_step // s.gen_batch_prompts, c.max_new_tokens, rows, positions,
                weight_bytes + rows * positions * kv)
    m_calls, m_steps, m_rows, m_pos, m_bytes = reads(cfg, sizes, speed)
    rate = m_calls * m_steps * m_bytes / measured["generate_s"]  # bytes a second
    calls, steps, rows, pos, step_bytes = reads(t_cfg, t_sizes, t_speed)
    generate = calls * steps * step_bytes / rate
    frozen = bool(cfg.lora_rank)

    def flops(c, s):  # (a forward of phase 3, the updates): every row whole where the route runs it so
        rows = c.prompts_per_step * c.group_size
        groups = rows if s.full_rows or c.gradient_checkpointing else c.prompts_per_step
        args = (config, n_params, c.max_prompt_tokens, c.max_new_tokens, rows, groups)
        return sum(forward_flops(*args)), update_flops(*args, frozen=frozen, recompute=c.gradient_checkpointing)
    (f0, u0), (f1, u1) = flops(cfg, sizes), flops(t_cfg, t_sizes)
    old, update = measured["old_logprobs_s"] * f1 / f0, measured["update_s"] * u1 / u0
    samples = lambda c: c.prompts_per_step * c.group_size * c.max_new_tokens  # noqa: E731
    verify = measured["verify_s"] * samples(t_cfg) / samples(cfg)
    step = generate + verify + old + update
    route = lambda c, s: ("every row whole, --gradient-checkpointing" if c.gradient_checkpointing  # noqa: E731
                          else "full rows" if s.full_rows else "the prompt shared per group")
    calls_text = lambda n: f"{n} generate call{'' if n == 1 else 's'}"  # noqa: E731
    lines = [
        f"extrapolated step at {name} (the plan on this card there: {t_sizes.gen_batch_prompts} prompts a generate "
        f"call, micro-batch {t_sizes.micro_batch_size} rows, {route(t_cfg, t_sizes)}):",
        f"  generate's read rate, measured = {calls_text(m_calls)} x {m_steps} decode steps x "
        f"({weight_bytes / GB:.3f} GB of weights + {m_rows} rows x {m_pos:.0f} positions x {kv / KB:.3f} KB of KV) / "
        f"{measured['generate_s']:.3g} s = {rate / GB:.1f} GB/s",
        f"  generate = {calls_text(calls)} x {steps} decode steps x ({weight_bytes / GB:.3f} GB + {rows} rows x "
        f"{pos:.0f} positions x {kv / KB:.3f} KB) / {rate / GB:.1f} GB/s = {generate:.1f} s",
        f"  old log-probs = {measured['old_logprobs_s']:.3g} s x {f1 / f0:.4g} (a forward's model FLOPs {f1:.3g} / "
        f"{f0:.3g}; measured on {route(cfg, sizes)}) = {old:.1f} s",
        f"  updates = {measured['update_s']:.3g} s x {u1 / u0:.4g} (the updates' model FLOPs {u1:.3g} / {u0:.3g}) "
        f"= {update:.1f} s",
        f"  verify = {measured['verify_s']:.3g} s x {samples(t_cfg) / samples(cfg):.4g} (samples x new tokens: "
        f"{samples(t_cfg)} / {samples(cfg)}) = {verify:.1f} s",
        f"  step = {generate:.1f} + {verify:.1f} + {old:.1f} + {update:.1f} = {step:.1f} s ({step / 3600:.2f} h)"]
    lines[1:1] = note
    return {"target": name, "prompts": P, "group_size": G, "prompt_tokens": Lp, "response_tokens": T,
            "gen_batch_prompts": t_sizes.gen_batch_prompts, "micro_batch_size": t_sizes.micro_batch_size,
            "full_rows": bool(t_sizes.full_rows), "gradient_checkpointing": t_cfg.gradient_checkpointing,
            "generate_calls": calls, "read_bytes_per_s": rate,
            "generate_s": generate, "verify_s": verify, "old_logprobs_s": old, "update_s": update, "step_s": step,
            "flops_ratio": f1 / f0, "update_flops_ratio": u1 / u0, "arithmetic": lines}


def fail(message, path, result):
    """One line on stderr and exit 1; the results so far (with the error) still go to --json."""
    if path:
        with open(path, "w") as f:
            json.dump({**result, "error": message}, f, indent=2)
    sys.exit(f"gpu_step.py: error: {message}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Other arguments are pacs.py flags (python pacs.py --help).")
    ap.add_argument("--model-dir", default=os.path.join(SHARED, "models", "qwen2.5-0.5b-instruct"),
                    help="config.json + tokenizer + generation_config of the model to stand in for")
    ap.add_argument("--standin", default="", help="a stand-in already built (gpu_check.py build): skips building one")
    ap.add_argument("--data-dir", default=os.path.join(SHARED, "data"), help="where math_train.jsonl is")
    ap.add_argument("--tiny", action="store_true", help="2 small layers (real vocab): a smoke test")
    ap.add_argument("--varied-prompts", type=int, default=0, metavar="N",
                    help="prompt lengths drawn from N..--max-prompt-tokens (0: all exactly --max-prompt-tokens)")
    ap.add_argument("--warmup-steps", type=int, default=1, help="untimed steps first")
    ap.add_argument("--timed-steps", type=int, default=2, help="steps timed after the warm-up")
    ap.add_argument("--total-steps", type=int, default=300, help="steps of the run to project the wall time of")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="device bf16 peak for MFU (0 = by device name)")
    ap.add_argument("--no-cap", action="store_true", help="with --memory-gib on CUDA: plan only, no allocator cap")
    ap.add_argument("--expect-psi-zero", action="store_true",
                    help="exit 1 unless every step's psi_std is exactly 0 (--lr 0: pi_theta == pi_old throughout)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("--generate-only", action="store_true",
                    help="time generate alone (each response forced to --max-new-tokens): decode ms per token")
    ap.add_argument("--profile", default="", metavar="JSON",
                    help="torch.profiler over the last timed step from the end of generate (verify, old log-probs, "
                         "updates): the top kernels by CUDA time and each phase's GPU-busy share, into this JSON")
    ap.add_argument("--random-init", default="", metavar="DIR",
                    help="build the model on the device from DIR's config.json with random weights (timed; nothing "
                         "written to disk), with DIR's tokenizer (tokenizer.json or tokenizer.json.gz)")
    ap.add_argument("--random-adapter", action="store_true",
                    help="with --lora-rank: the adapter's B drawn at random, not peft's zeros (psi = 0 at --lr 0 can "
                         "then fail)")
    ap.add_argument("--extrapolate", nargs="?", const=EXTRAPOLATE, default="", metavar="PxG@LP+T,...",
                    help="from the measured step, the time of a step at these shapes, its arithmetic printed "
                         f"(no value: {EXTRAPOLATE})")
    ap.add_argument("--_build", default="", help=argparse.SUPPRESS)
    args, rest = ap.parse_known_args()
    if args._build:  # child process: build the stand-in (its memory never counts in the parent's peak)
        return build_standin(args.model_dir, args._build, args.tiny)
    if args.random_init and args.standin:
        sys.exit("gpu_step.py: error: --random-init builds its own model: pass it or --standin, not both")
    if args.random_init and not os.path.isfile(os.path.join(args.random_init, "config.json")):
        sys.exit(f"gpu_step.py: error: --random-init {args.random_init}: no config.json there")
    if not args.standin and not args.random_init and not os.path.isfile(os.path.join(args.model_dir, "config.json")):
        sys.exit(f"gpu_step.py: error: no config.json in {args.model_dir} (see ../shared/models/README.md)")
    targets = parse_targets(args.extrapolate) if args.extrapolate else []
    cfg = pacs.parse_args(["--eval-every", "0", "--save-every", "0", "--save-minutes", "0", *rest])
    if args.random_adapter and not cfg.lora_rank:
        sys.exit("gpu_step.py: error: --random-adapter draws a LoRA adapter's B: add --lora-rank")
    try:
        plumbing.check_config(cfg)
        device = plumbing.pick_device(cfg)  # as pacs.py picks it: refusals, the allocator's expandable segments
    except plumbing.ConfigError as e:
        sys.exit(f"gpu_step.py: error: {e}")
    if device.type == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        # On the CPU the peak is read from the resident set size. glibc keeps freed blocks below its (dynamic,
        # up to 32 MB) mmap threshold in the heap, so the RSS would count allocator fragmentation that CUDA's
        # max_memory_allocated never sees. Restart with every block over 64 KiB mapped and unmapped on its own.
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"})
    verifier = levers.VerifierPool(levers.on_device(cfg, device.type).verify_workers)  # forked before the model
    workers = verifier.workers  # loads, as pacs.train does
    cap = None
    if device.type == "cuda" and cfg.memory_gib > 0 and not args.no_cap:
        cap = cap_allocator(cfg.memory_gib)
    torch.manual_seed(cfg.seed)
    built, load_model = {}, plumbing.load_model
    with tempfile.TemporaryDirectory() as tmp:
        if args.random_init:  # the config and tokenizer only: setup_model's load builds the model on the device
            weightless_standin(args.random_init, tmp, args.tiny)
            plumbing.load_model = random_init_loader(built, cfg.seed)
        elif not args.standin:
            subprocess.run([sys.executable, __file__, "--_build", tmp, "--model-dir", args.model_dir,
                            *(["--tiny"] if args.tiny else [])], check=True)
        try:
            model, rollout_model, tokenizer, sizes = plumbing.setup_model(cfg, args.standin or tmp, device)
        except plumbing.ConfigError as e:
            sys.exit(f"gpu_step.py: error: {e}")
        finally:
            plumbing.load_model = load_model
    if args.random_adapter:
        built["random_adapter_entries"] = randomize_adapter(model, cfg.seed + 1)
    planned = dataclasses.asdict(sizes)
    n_params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)  # the base (an adapter: plan)
    # safetensors maps the weights lazily: read every page first, so that they are resident (and counted once)
    # before the CPU's baseline is taken (below)
    with torch.no_grad():
        sum(float(p.sum()) for p in model.parameters())
    copy_bytes = 0 if rollout_model is model else sum(p.nbytes for p in rollout_model.parameters())  # the plan's too
    plan = plumbing.memory_plan(cfg, model.config, n_params, device.type, sizes.micro_batch_size,
                                sizes.gen_batch_prompts, sizes.full_rows)
    n_steps = args.warmup_steps + args.timed_steps
    if args.varied_prompts:
        problems = varied_length_prompts(tokenizer, cfg.prompts_per_step * n_steps, args.varied_prompts,
                                         cfg.max_prompt_tokens, args.data_dir, cfg.seed, cfg.prompt, cfg.thinking)
    else:
        problems = fixed_length_prompts(tokenizer, cfg.prompts_per_step * n_steps, cfg.max_prompt_tokens,
                                        args.data_dir, cfg.prompt, cfg.thinking)
    optimizer = pacs.make_optimizer(cfg, model)
    ref_model = copy.deepcopy(model).eval() if cfg.ref_reset_every != 1 else None  # as pacs.train: a frozen pi_ref
    sample, phase, profiler = pacs.sample, {}, {}

    def profile_last_step():  # from the end of the last step's generate call to the end of its update
        if args.profile and len(rows) == n_steps - 1 and "prof" not in profiler:
            profiler["prof"] = start_profiler(device)
    pacs.sample = sample_full_length(sample, device, cfg.max_new_tokens, phase, profile_last_step)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "params": n_params, "prompts": cfg.prompts_per_step, "group_size": cfg.group_size,
              "prompt_tokens": cfg.max_prompt_tokens, "varied_prompts": args.varied_prompts or None,
              "response_tokens": cfg.max_new_tokens, "num_mini_batches": cfg.num_mini_batches, "lr": cfg.lr,
              "gradient_checkpointing": cfg.gradient_checkpointing, "memory_gib": cfg.memory_gib or None,
              "allocator_cap_fraction": cap[0] if cap else None,
              "allocator_cap_gib": cap[1] / plumbing.GiB if cap else None, "planned_sizes": planned,
              "levers": {k: getattr(cfg, k) for k in ("verify_workers", "pack_groups", "full_rows", "static_cache",
                                                      "compile_head", "compile_layers", "sampler",
                                                      "defer_stop_check")},
              "ref_reset_every": cfg.ref_reset_every,
              "verify_processes": workers,
              "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "model_type": model.config.model_type, "layers": model.config.num_hidden_layers,
              "vocab": len(tokenizer), "prompt": cfg.prompt, "thinking": cfg.thinking,
              "first_prompt": problems[0]["prompt"][:200], "lora_rank": cfg.lora_rank,
              "trained_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "random_init": args.random_init or None, **built}
    if cfg.lora_rank:  # which peft ran: the check carries its wheel
        import peft
        result.update(peft=peft.__version__, peft_file=peft.__file__)
    if levers.on_device(cfg, device.type).cache_tokens:  # compile the decode step first, at the run's shapes
        t0 = time.time()
        batch = plumbing.prompts_of(tokenizer, problems[:sizes.gen_batch_prompts or None])
        sample(rollout_model, tokenizer, batch, cfg.group_size, 4, batch_prompts=sizes.gen_batch_prompts,
               speed=levers.on_device(cfg, device.type))
        result["compile_s"] = time.time() - t0
        print(f"static cache: the decode step compiled (a 4-token generate call) in {result['compile_s']:.1f} s")
    if cfg.compile_layers or cfg.compile_head:  # their graphs too, first and apart (they are dynamic in the shape)
        t0 = time.time()
        compile_log_prob_forwards(cfg, sample, model, rollout_model, tokenizer, problems, sizes, device)
        result["compile_update_s"] = time.time() - t0
        print(f"--compile-layers/--compile-head: phases 3 and 4 compiled (one micro-batch, 4 tokens) in "
              f"{result['compile_update_s']:.1f} s")
    if args.generate_only:
        return time_generate(args, cfg, sample, rollout_model, tokenizer, problems, sizes, device, result, n_steps)
    # CPU: what the process holds besides the weights before its first step (interpreter, torch, transformers, the
    # tokenizer and the prompts, what the warm-up calls above left in the heap); the plan predicts the tensors on top
    held = sum(p.nbytes for p in model.parameters()) + copy_bytes + (  # the plan's weights, copies, adapter
        sum(p.nbytes for p in ref_model.parameters()) if ref_model is not None else 0)
    rss_base = rss_bytes() - held if device.type == "cpu" else 0
    rows = []
    for step in range(n_steps):
        reset_peak(device)
        try:
            metrics, _ = pacs.train_step(cfg, model, tokenizer, optimizer, problems, step, device, rollout_model,
                                         ref_model=ref_model, sizes=sizes, verifier_pool=verifier)
        except plumbing.ConfigError as e:  # a non-finite log-prob, or out of memory at the smallest sizes
            fail(f"step {step}: {e}", args.json, {**result, "steps": rows})
        if "prof" in profiler:
            if device.type == "cuda":
                torch.cuda.synchronize()
            profiler["prof"].__exit__(None, None, None)
            profiler["table"] = profile_table(profiler.pop("prof"), metrics, device)
        if rollout_model is not model:
            plumbing.copy_weights(rollout_model, model)
        metrics["update_peak_bytes"] = peak_bytes(device)  # old log-probs and the updates, since generate's reset
        metrics.update(phase)
        metrics["peak_bytes"] = max(metrics["generate_peak_bytes"], metrics["update_peak_bytes"])
        if device.type == "cuda":
            metrics["update_reserved_bytes"] = torch.cuda.max_memory_reserved()
            metrics.update(cuda_memory())
            metrics.update(allocator_state())
        rows.append(metrics)
        cuda = f" | {cuda_memory_text(metrics)}" if device.type == "cuda" else ""
        warmup = " (warm-up)" if step < args.warmup_steps else ""
        print(f"step {step}{warmup}: {metrics['step_time']:.1f} s | generate "
              f"{metrics['time_generate']:.1f} | old log-probs {metrics['time_old_logprobs']:.1f} | update "
              f"{metrics['time_update']:.1f} | response len {metrics['response_len']:.0f} | peaks: generate "
              f"{metrics['generate_peak_bytes'] / plumbing.GiB:.2f}, update "
              f"{metrics['update_peak_bytes'] / plumbing.GiB:.2f} GiB | psi_std {metrics['psi_std']}{cuda}",
              flush=True)
    pacs.sample = sample
    timed = rows[args.warmup_steps:] or rows
    mean = lambda k: sum(r[k] for r in timed) / len(timed)
    B, T = cfg.prompts_per_step * cfg.group_size, cfg.max_new_tokens
    peak_tflops = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in name), 0.0)
    flops = update_flops(model.config, n_params, cfg.max_prompt_tokens, T, B, cfg.prompts_per_step,
                         frozen=bool(cfg.lora_rank))
    gib = lambda b: b / plumbing.GiB
    measured = {ph: max(r[f"{ph}_peak_bytes"] for r in rows) for ph in ("generate", "update")}
    predicted = {ph: plan[f"peak: {ph}"] + rss_base for ph in ("generate", "update")}  # CPU: RSS holds the libraries
    psi = [r["psi_std"] for r in rows if r["psi_std"] is not None]
    result.update({
        "micro_batch_size": sizes.micro_batch_size, "gen_batch_prompts": sizes.gen_batch_prompts,
        "step_s": mean("step_time"), "generate_s": mean("time_generate"), "verify_s": mean("time_verify"),
        "old_logprobs_s": mean("time_old_logprobs"), "update_s": mean("time_update"),
        "generated_tokens_per_s": B * T / mean("time_generate"),
        "decode_ms_per_token": 1e3 * mean("time_generate") / T,  # a step of B rows, prefill included
        "generate_peak_gib": gib(measured["generate"]), "update_peak_gib": gib(measured["update"]),
        "plan_generate_gib": gib(predicted["generate"]), "plan_update_gib": gib(predicted["update"]),
        "generate_over_plan": measured["generate"] / predicted["generate"],
        "update_over_plan": measured["update"] / predicted["update"],
        "peak_gib": gib(max(measured.values())), "plan_gib": gib(plan["peak"] + rss_base),
        "peak_over_plan": max(measured.values()) / (plan["peak"] + rss_base),
        "rss_base_gib": gib(rss_base) if device.type == "cpu" else None,
        "psi_std_max": max(psi) if psi else None, "psi_mean_abs_max": max(
            (abs(r["psi_mean"]) for r in rows if r["psi_mean"] is not None), default=None),
        **({k: max(r[k] for r in rows) for k in ("generate_reserved_bytes", "update_reserved_bytes",
                                                 "reserved_peak_bytes", "device_used_bytes", "device_total_bytes",
                                                 "alloc_retries", "ooms")} if device.type == "cuda" else {}),
        "expandable_segments": rows[-1].get("expandable_segments"),
        "update_tflops": flops / mean("time_update") / 1e12,
        "update_mfu": flops / mean("time_update") / (peak_tflops * 1e12) if peak_tflops else None,
        "projected_run_h": mean("step_time") * args.total_steps / 3600,
    })
    mfu = f"{100 * result['update_mfu']:.1f}% of {peak_tflops:.0f}" if result["update_mfu"] else "n/a (no peak known)"
    print(f"\n{name}: {cfg.prompts_per_step} prompts x {cfg.group_size} = {B} samples of {cfg.max_prompt_tokens} "
          f"+ {T} tokens, {cfg.num_mini_batches} mini-batches, micro-batch {sizes.micro_batch_size} rows, "
          f"generate {sizes.gen_batch_prompts} prompts per call (planned: {planned})")
    print(f"step {result['step_s']:.1f} s = generate {result['generate_s']:.1f} + verify {result['verify_s']:.1f} + "
          f"old log-probs {result['old_logprobs_s']:.1f} + update {result['update_s']:.1f}")
    print(f"generated tokens/s {result['generated_tokens_per_s']:.0f} | update {result['update_tflops']:.1f} "
          f"TFLOP/s, MFU {mfu}")
    what = "max_memory_allocated" if device.type == "cuda" else "peak RSS"
    libs = f" (incl. {gib(rss_base):.2f} of libraries)" if device.type == "cpu" else ""
    for ph in ("generate", "update"):
        print(f"peak memory, {ph}: {result[f'{ph}_peak_gib']:.2f} GiB ({what}) vs plan {result[f'plan_{ph}_gib']:.2f} "
              f"GiB{libs}: measured / plan = {result[f'{ph}_over_plan']:.3f}")
    print(f"peak memory {result['peak_gib']:.2f} GiB vs plan {result['plan_gib']:.2f} GiB: measured / plan = "
          f"{result['peak_over_plan']:.3f}")
    if device.type == "cuda":  # reserved far above allocated: fragmentation (the README's GPU checklist)
        budget = plumbing.plan_budget("cuda", plumbing.device_memory("cuda", cfg.memory_gib))
        print(f"{cuda_memory_text(result)}; the plan's budget {budget / plumbing.GiB:.2f} GiB; allocator retries "
              f"{result['alloc_retries']}, OOMs {result['ooms']}, expandable segments {result['expandable_segments']}"
              + (f"; allocator capped at {result['allocator_cap_gib']:.2f} GiB" if cap else ""))
    print(f"psi_std: {psi} (max {result['psi_std_max']})")
    print(f"projected {args.total_steps} steps: {result['projected_run_h']:.1f} h (no in-loop eval, no checkpoints)")
    if targets:  # from this step alone: the rollout's bytes, the plan at each target on this card
        weight_bytes = sum(p.nbytes for p in rollout_model.parameters())
        result["extrapolated"] = [extrapolate(cfg, sizes, result, model.config, n_params, weight_bytes, device.type,
                                              t) for t in targets]
        for e in result["extrapolated"]:
            print("\n".join(e.get("arithmetic", [f"extrapolated step at {e['target']}: {e.get('error')}"])))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "steps": rows}, f, indent=2)
    if args.profile and "table" in profiler:
        table = profiler["table"]
        with open(args.profile, "w") as f:
            json.dump({"device": name, "settings": {k: result[k] for k in ("prompts", "group_size", "prompt_tokens",
                                                                          "response_tokens", "micro_batch_size")},
                       **table}, f, indent=2)
        print(f"profile ({args.profile}): " + " | ".join(
            f"{k[5:]} {v['wall_s']:.2f} s, device busy {100 * v['busy_share']:.0f}%" if v["busy_share"] is not None
            else f"{k[5:]} {v['wall_s']:.2f} s" for k, v in table["phases"].items()))
        print_kernels(table["kernels"])
    if args.expect_psi_zero and any(v != 0 for v in psi):
        fail(f"psi_std {max(psi)} != 0 at --lr {cfg.lr}: the training forward and the old log-probs disagree", "",
             result)


if __name__ == "__main__":
    main()
