"""Where the update's and the decode step's time goes on one card: one mini-batch of the default shape timed in
several forms, and a profile of each.

The update (phase 4) and the old log-probs (phase 3) run pacs.step_logprobs on a mini-batch of the default shape
(32 rows: 4 prompts x 8, 512 + 1024 tokens, every response token real) of the Qwen2.5-0.5B stand-in, forward and
backward (phase 4) or forward under no_grad (phase 3), in bf16 autocast as pacs.py runs them, in these forms:

    shared-8      today: one group per micro-batch, its prompt run once and its KV cache repeated for the responses
    shared-32     four groups per micro-batch (--pack-groups)
    full-8        each row run whole, no shared prompt, no mask where no row is left-padded (--full-rows)
    body-8        the decoder stack alone (shared-8 without the LM head and log-softmax)
    head-8        the LM head and fp32 log-softmax alone, on 8 x 1024 hidden states
    headc-8       the same with pacs.token_logprobs under torch.compile (fewer passes over the vocabulary?)
    layersc-32    full-32 with the decoder's layers under torch.compile (--compile-layers; its compile time apart)

Each form: one untimed call, then --repeats timed calls; ms per mini-batch and TFLOP/s by gpu_step.update_flops.
Then torch.profiler over one shared-8 mini-batch (grad and no-grad), and over --decode-tokens decode steps of
pacs.sample at each of --decode-rows: the top kernels by device time and the share of the wall time the device was busy
(low: the host, launches and Python, is the bottleneck). Everything goes to --json.

    python benchmarks/update_forms.py --standin DIR --data-dir .gpu/data --json OUT.json     # on a GPU
    python benchmarks/update_forms.py --device cpu --tiny --rows 4 --group-size 2 \\
        --max-prompt-tokens 64 --max-new-tokens 16 --decode-rows 4 --decode-tokens 4              # smoke test
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import torch  # noqa: E402

import gpu_step  # noqa: E402
import levers  # noqa: E402
import pacs  # noqa: E402
import plumbing  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def fake_rollout(tokenizer, rows, group_size, prompt_tokens, response_tokens, data_dir, device, seed=0):
    """A rollout of `rows` rows: rows / G prompts of exactly prompt_tokens tokens, each repeated G times, and random
    response tokens, every one real."""
    prompts = gpu_step.fixed_length_prompts(tokenizer, rows // group_size, prompt_tokens, data_dir)
    ids = [tokenizer(plumbing.build_prompt(tokenizer, p["problem"]), add_special_tokens=False)["input_ids"]
           for p in prompts]
    width = max(map(len, ids))
    prompt_ids = torch.full((len(ids), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):  # left padding, as generate() pads
        prompt_ids[i, width - len(row):], prompt_mask[i, width - len(row):] = torch.tensor(row), 1
    g = torch.Generator().manual_seed(seed)
    response_ids = torch.randint(1000, 100000, (rows, response_tokens), generator=g)
    roll = {"prompt_ids": prompt_ids.repeat_interleave(group_size, 0),
            "prompt_mask": prompt_mask.repeat_interleave(group_size, 0),
            "response_ids": response_ids, "response_mask": torch.ones_like(response_ids)}
    return {k: v.to(device) for k, v in roll.items()}


def run_form(cfg, model, roll, micro, grad, part, device):
    """One mini-batch (all of roll's rows) in micro-batches of `micro` rows: the log-probs' sum backpropagated
    (grad) or a no-grad forward. part: 'all' (pacs.step_logprobs), 'body' (the decoder only), 'head' (the LM
    head and log-softmax only, pacs.head_logprobs on random hidden states) or 'headc' (the same, --compile-head's
    route)."""
    autocast = plumbing.autocast_context(cfg, device)
    rows = roll["response_ids"].shape[0]
    for sl in plumbing.micro_slices(slice(0, rows), micro):
        with torch.set_grad_enabled(grad), autocast, plumbing.pin_attention(device.type):
            if part == "all":
                out = pacs.step_logprobs(cfg, model, roll, sl)[0].sum()
            elif part == "body":
                batch = plumbing.rollout_rows(roll, sl)
                out = pacs.response_hidden(model, *batch, group_size=min(cfg.group_size, micro),
                                           shared_prompt=not cfg.gradient_checkpointing)[0].float().sum()
            else:
                n = (sl.stop - sl.start) * roll["response_ids"].shape[1]
                hidden = torch.randn(n, model.config.hidden_size, device=device, requires_grad=grad)
                targets = roll["response_ids"][sl].flatten()
                head = levers.compiled_head(pacs.token_logprobs, device.type) if part == "headc" else None
                out = pacs.head_logprobs(model.get_output_embeddings(), hidden, targets, 1.0, compiled=head)[0].sum()
        if grad:
            out.backward()
    if grad:
        model.zero_grad(set_to_none=True)
    sync(device)


def time_form(cfg, model, roll, micro, grad, part, device, repeats):
    """(seconds of the first call, mean seconds of the next `repeats`)."""
    t0 = time.time()
    run_form(cfg, model, roll, micro, grad, part, device)
    first = time.time() - t0
    t0 = time.time()
    for _ in range(repeats):
        run_form(cfg, model, roll, micro, grad, part, device)
    return first, (time.time() - t0) / repeats


def profiled(fn, device, top):
    """fn() under torch.profiler: {wall_s, device_busy_s, busy_share, kernels: the top kernels by self device time}
    (on the CPU: by self CPU time, no busy share)."""
    cuda = device.type == "cuda"
    sync(device)
    prof = gpu_step.start_profiler(device)
    t0 = time.time()
    fn()
    sync(device)
    wall = time.time() - t0
    prof.__exit__(None, None, None)
    kernels, total = gpu_step.top_kernels(prof, cuda, top)
    busy = None
    if cuda:  # the union of the kernels' intervals
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0)
        busy, end = 0, None
        for a, b in spans:
            if end is None or a > end:
                busy, end = busy + (b - a), b
            elif b > end:
                busy, end = busy + (b - end), b
        busy /= 1e6
    return {"wall_s": wall, "device_busy_s": busy, "busy_share": busy / wall if busy else None,
            "kernel_ms_total": total, "kernels": kernels}


def print_profile(name, p, lines=12):
    share = f", device busy {100 * p['busy_share']:.0f}%" if p["busy_share"] else ""
    print(f"profile {name}: {p['wall_s']:.3f} s{share}", flush=True)
    gpu_step.print_kernels(p["kernels"], lines)


def profile_update(cfg, model, roll, device, top, result):
    """torch.profiler over one shared-8 mini-batch, forward and backward (phase 4) and no-grad (phase 3)."""
    for grad in (True, False):
        key = "update_shared-8" if grad else "old_logprobs_shared-8"
        result["profiles"][key] = profiled(lambda: run_form(cfg, model, roll, 8, grad, "all", device), device, top)
        print_profile(key, result["profiles"][key])


def profile_decode(args, cfg, rollout_model, tokenizer, device, rows, static, result):
    """--decode-tokens decode steps of pacs.sample at each of --decode-rows (every response forced to full length), a
    call untimed first (with the static cache: its compilation), then one timed and one under torch.profiler. The
    static cache is sized as the default run's (prompt + response limits), whatever --decode-tokens."""
    prompts = gpu_step.fixed_length_prompts(tokenizer, rows // args.group_size, args.max_prompt_tokens,
                                            args.data_dir)
    texts = [plumbing.build_prompt(tokenizer, p["problem"]) for p in prompts]
    forced = gpu_step.sample_full_length(pacs.sample, device, args.decode_tokens, {})
    cache = args.max_prompt_tokens + args.max_new_tokens if static else 0
    call = lambda: forced(rollout_model, tokenizer, texts, args.group_size, args.decode_tokens,  # noqa: E731
                          batch_prompts=len(texts), speed=levers.Levers(cache_tokens=cache))
    key = f"decode_{'static' if static else 'dynamic'}_{rows}x{args.decode_tokens}"
    t0 = time.time()
    call()
    first = time.time() - t0
    sync(device)
    t0 = time.time()
    call()
    sync(device)
    seconds = time.time() - t0
    result["profiles"][key] = {"first_call_s": first, "call_s": seconds,
                               "ms_per_token": 1e3 * seconds / args.decode_tokens,
                               "profiled": profiled(call, device, args.top)}
    print(f"{key}: {1e3 * seconds / args.decode_tokens:.2f} ms a token at {rows} rows (prefill "
          f"included; first call {first:.1f} s)", flush=True)
    print_profile(key, result["profiles"][key]["profiled"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--standin", default="", help="a stand-in already built (gpu_check.py build)")
    ap.add_argument("--model-dir", default=gpu_step.SHARED + "/models/qwen2.5-0.5b-instruct")
    ap.add_argument("--data-dir", default=gpu_step.SHARED + "/data")
    ap.add_argument("--tiny", action="store_true", help="2 small layers (real vocab): a smoke test")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=32, help="rows of the mini-batch")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--forms", default="shared-8,shared-32,full-8,full-32,body-8,head-8,layersc-32",
                    help="comma-separated: {shared,full,body,head,headc,layersc}-ROWS; none: the decode profiles "
                    "alone")
    ap.add_argument("--decode-rows", default="1024,128", help="comma-separated row counts of the decode profiles")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-static", type=int, default=1, help="also profile decode with the static cache (1)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = pacs.parse_args(["--device", args.device, "--group-size", str(args.group_size),
                           "--max-prompt-tokens", str(args.max_prompt_tokens),
                           "--max-new-tokens", str(args.max_new_tokens), "--eval-every", "0"])
    with tempfile.TemporaryDirectory() as tmp:
        if not args.standin:
            subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_step.py"), "--_build", tmp,
                            "--model-dir", args.model_dir, *(["--tiny"] if args.tiny else [])], check=True)
        model, rollout_model, tokenizer, _ = plumbing.setup_model(cfg, args.standin or tmp, device)
    n_params = sum(p.numel() for p in model.parameters())
    roll = fake_rollout(tokenizer, args.rows, args.group_size, args.max_prompt_tokens, args.max_new_tokens,
                        args.data_dir, device)
    flops = gpu_step.update_flops(model.config, n_params, args.max_prompt_tokens, args.max_new_tokens, args.rows,
                                  args.rows // args.group_size)  # forward + backward
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "transformers": __import__("transformers").__version__,
              "rows": args.rows, "group_size": args.group_size, "prompt_tokens": args.max_prompt_tokens,
              "response_tokens": args.max_new_tokens, "update_flops": flops, "forms": {}, "profiles": {}}
    print(f"{name}: a mini-batch of {args.rows} rows, {args.max_prompt_tokens} + {args.max_new_tokens} tokens; "
          f"{flops / 1e12:.1f} TFLOP forward + backward", flush=True)
    model.train()
    forms = [f for f in args.forms.split(",") if f]  # --forms "": the decode profiles alone
    save = lambda: args.json and json.dump(result, open(args.json, "w"), indent=2)  # noqa: E731 (after each part)
    for form in [f for f in forms if not f.startswith("layersc")] + ["profiles"] * bool(forms) + ["decode"] + \
            [f for f in forms if f.startswith("layersc")]:  # the compiled layers last: from there on they stay so
        if form == "profiles":
            profile_update(cfg, model, roll, device, args.top, result)
            save()
            continue
        if form == "decode":
            for rows in map(int, args.decode_rows.split(",")):
                for static in (False, True)[:(1 + args.decode_static) * (args.decode_tokens > 0)]:
                    profile_decode(args, cfg, rollout_model, tokenizer, device, rows, static, result)
                    save()
            continue
        kind, micro = form.rsplit("-", 1)
        micro = int(micro)
        part = {"body": "body", "head": "head", "headc": "headc"}.get(kind, "all")
        route = pacs.Config(**{**vars(cfg), "full_rows": "on" if kind in ("full", "layersc") else "off"})
        entry = {}
        try:
            if kind == "layersc" and not getattr(model.base_model, "compiled_layers", False):
                levers.compile_layers(model, device)  # as --compile-layers: compiled on the first call, in its time
            for grad in (True, False):
                first, seconds = time_form(route, model, roll, micro, grad, part, device, args.repeats)
                key = "fwd_bwd" if grad else "fwd"
                entry[key + "_s"], entry[key + "_first_s"] = seconds, first
                entry[key + "_tflops"] = (flops if grad else flops / 3) / seconds / 1e12 if part == "all" else None
            rate = f" | {entry['fwd_bwd_tflops']:.0f} / {entry['fwd_tflops']:.0f} TFLOP/s" if part == "all" else ""
            print(f"{form:18s} forward+backward {1e3 * entry['fwd_bwd_s']:8.1f} ms (first "
                  f"{entry['fwd_bwd_first_s']:.1f} s) | forward {1e3 * entry['fwd_s']:8.1f} ms{rate}", flush=True)
        except Exception as e:  # noqa: BLE001 (a form that fails is recorded; the others still run)
            entry["error"] = f"{type(e).__name__}: {e}"[:400]
            print(f"{form:18s} failed: {entry['error']}", flush=True)
        finally:
            model.zero_grad(set_to_none=True)
        result["forms"][form] = entry
        save()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
