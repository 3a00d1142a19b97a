"""What one decode step's attention and sampling cost at the default shape, in each form a faster decode could take.

The static cache's compiled decode step (--static-cache) spends most of its device time in two places (docs/gpu.md,
the H200's call 5): the attention over the whole cache, filled or not (12.6 of ~22 ms a step at 1,024 rows), and
sampling over the vocabulary in fp32 (~3 ms). This times one layer's attention for one query token and one step's
sampling, at the default run's shape (1,024 rows, Qwen2.5-0.5B's 2 K/V heads of 7 query heads each, 64 dims, a
cache of 512 + 1024 positions of which --filled are written; 151,936 tokens), in these forms:

    sdpa           levers.folded_gqa_attention's call as the run makes it: SDPA under a boolean mask over the whole
                   cache, math and cuDNN off (the memory-efficient kernel on CUDA)
    sdpa-cudnn     the same call with cuDNN's kernel allowed
    sdpa-filled    the same over the --filled positions only: what attending to the filled positions saves
    bmm            two batched matmuls and a masked softmax in fp32, eager
    bmm-compiled   the same under torch.compile
    flex           levers.flex_decode_attention (--static-cache flex) under torch.compile: flex_attention with a block
                   mask built from the boolean mask, blocks of 128 positions with no key to attend never read
    sample-hf      transformers' sampling: the logits to fp32, softmax, torch.multinomial
    sample-gumbel  --sampler gumbel's draw of the same distribution: the logits to fp32, levers.gumbel_noised
                   (logits / tau plus Gumbel noise, one compiled pass), argmax

Each attention form's largest difference from an fp32 reference over the filled positions is printed beside its
time (the same function, up to bf16 rounding). Times are medians over --iters calls (CUDA events on a GPU), ms per
call, and per decode step (x the model's 24 layers) for the attention.

    python benchmarks/decode_attention.py --json OUT.json                                   # on a GPU
    python benchmarks/decode_attention.py --device cpu --rows 8 --cache 384 --filled 200 --vocab 4096 --iters 3
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import levers  # noqa: E402
import plumbing  # noqa: E402


def decode_inputs(rows, kv_heads, groups, head_dim, cache, filled, dtype, device, seed=0):
    """query (B, Hkv, g, D) (one token's query heads folded under their K/V head), key and value (B, Hkv, S, D), and
    the boolean mask (B, 1, 1, S): each row's keys from its left padding (up to 1/8 of the prompt) to --filled."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g).to(device, dtype)  # noqa: E731
    query, key, value = make(rows, kv_heads, groups, head_dim), *(make(rows, kv_heads, cache, head_dim)
                                                                   for _ in range(2))
    pad = torch.randint(0, max(1, filled // 8), (rows,), generator=g)  # left padding of each row's prompt
    positions = torch.arange(cache)
    mask = (positions >= pad[:, None]) & (positions < filled)  # (B, S)
    return query, key, value, mask[:, None, None, :].to(device)


def sdpa(query, key, value, mask):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask)


def bmm(query, key, value, mask):  # (B, Hkv, g, D) x (B, Hkv, S, D) -> (B, Hkv, g, D)
    scores = (query @ key.transpose(-1, -2)).float() / math.sqrt(query.shape[-1])  # (B, Hkv, g, S)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (weights.to(value.dtype) @ value)


def reference(query, key, value, mask):
    return bmm(query.float(), key.float(), value.float(), mask)


def sample_hf(logits, temperature=1.0):  # (B, V) bf16 -> (B,): what transformers' _sample does with them
    scores = logits.to(dtype=torch.float32, copy=True) / temperature
    return torch.multinomial(F.softmax(scores, -1), 1).squeeze(1)


def sample_gumbel(logits, noise):  # --sampler gumbel in transformers' greedy step: the same distribution
    return noise(None, logits.to(dtype=torch.float32, copy=True)).argmax(-1)  # noise: a levers.GumbelNoise


def timed(fn, args, iters, device):
    """The median ms of `iters` calls after two untimed ones (the first compiles)."""
    for _ in range(2):
        fn(*args)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*args)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(*args)
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def sdpa_cudnn(*args):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        return sdpa(*args)


def attention_forms(device):
    """name -> the function of each attention form (None: not on this device), under the run's kernel settings."""
    return {"sdpa": sdpa, "sdpa-cudnn": sdpa_cudnn if device.type == "cuda" else None, "sdpa-filled": sdpa,
            "bmm": bmm, "bmm-compiled": torch.compile(bmm), "flex": torch.compile(levers.flex_decode_attention)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--groups", type=int, default=7, help="query heads per K/V head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cache", type=int, default=1536, help="the static cache's positions (prompt + response limits)")
    ap.add_argument("--filled", type=int, default=1024, help="positions written (a default step's mean: 512 + 512)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--forms", default="sdpa,sdpa-cudnn,sdpa-filled,bmm,bmm-compiled,flex,sample-hf,sample-gumbel")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        plumbing.set_cuda_kernels()  # the run's: TF32, math and cuDNN SDPA off
    scalar = device.type == "cpu" and levers.scalar_cpu_compile()  # no vector ISA: inductor's scalar code
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inputs = decode_inputs(args.rows, args.kv_heads, args.groups, args.head_dim, args.cache, args.filled, dtype,
                           device)
    query, key, value, mask = inputs
    filled = (query, key[:, :, :args.filled], value[:, :, :args.filled], mask[..., :args.filled])
    ref = reference(*filled)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result = {"device": name, "torch": torch.__version__, "shape": {k: getattr(args, k) for k in (
        "rows", "kv_heads", "groups", "head_dim", "cache", "filled", "layers", "vocab")}, "forms": {}}
    print(f"{name}: {args.rows} rows, {args.kv_heads} x {args.groups} heads of {args.head_dim}, {args.filled} of "
          f"{args.cache} positions filled; ms a call, and a decode step's attention over {args.layers} layers",
          flush=True)
    attention = attention_forms(device)
    logits = torch.randn(args.rows, args.vocab, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    for form in [f for f in args.forms.split(",") if f]:
        entry = {}
        try:
            if form.startswith("sample"):
                call = (logits,) if form == "sample-hf" else (logits, levers.GumbelNoise(1.0, device))
                entry["ms"] = timed(sample_hf if form == "sample-hf" else sample_gumbel, call, args.iters, device)
                print(f"{form:14s} {entry['ms']:8.3f} ms a step's sampling", flush=True)
            elif attention[form] is None:  # cuDNN's kernel off CUDA
                continue
            elif form == "flex" and scalar:  # inductor's CPU flex_attention needs a vector ISA
                entry["skipped"] = "no vector ISA on this CPU: inductor does not compile flex_attention"
                print(f"{form:14s} skipped: {entry['skipped']}", flush=True)
            else:
                fn, call_args = attention[form], filled if form == "sdpa-filled" else inputs
                entry["max_abs_diff"] = (fn(*call_args).float() - ref).abs().max().item()
                entry["ms"] = timed(fn, call_args, args.iters, device)
                entry["ms_a_step"] = entry["ms"] * args.layers
                print(f"{form:14s} {entry['ms']:8.3f} ms a call, {entry['ms_a_step']:7.2f} ms a step | max |diff| "
                      f"{entry['max_abs_diff']:.2e}", flush=True)
        except Exception as e:  # noqa: BLE001 (a form that fails is recorded; the others still run)
            entry["error"] = f"{type(e).__name__}: {e}"[:400]
            print(f"{form:14s} failed: {entry['error']}", flush=True)
        result["forms"][form] = entry
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
