"""The memory plan's update terms against torch's own count: one micro-batch at the Qwen2.5-0.5B shape, on the CPU.

Two forward/backward passes under bf16 autocast (the CUDA road's rounding), on random weights of the exact
architecture (../shared/models/qwen2.5-0.5b-instruct: config.json only):
  actor   pacs.response_logprobs over one group of --rows responses sharing a prompt (the training forward)
  critic  PPO's value model, AutoModelForTokenClassification(num_labels=1): pacs.response_values on the same rows,
          the same route (the group's prompt run once)
For each: the tensors autograd saves for backward, counted with torch.autograd.graph.saved_tensors_hooks
(activations; the 4-D attention masks SDPA keeps per layer; autocast's bf16 weight copies), the KV cache the
actor's forward holds, and the peak resident set of the forward and of the backward above the weights and
their gradients (allocated first, as in any micro-batch after the first), each beside plumbing.memory_plan's terms.

    python benchmarks/plan_terms.py                                   # 512 + 1024 tokens, 2 rows
    python benchmarks/plan_terms.py --max-prompt-tokens 64 --max-new-tokens 512 --rows 4
    python benchmarks/plan_terms.py --models critic                   # PPO's value model only
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import pacs  # noqa: E402
import plumbing  # noqa: E402
from gpu_step import reset_peak, rss_bytes  # noqa: E402

GiB = plumbing.GiB


def saved_tensors(model):
    """A saved_tensors_hooks context and the dict it fills: storage -> tensor, the weights themselves left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in weights:
            saved.setdefault(t.untyped_storage().data_ptr(), t)
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), saved


def split(saved, model):
    """Bytes of (activations, attention masks, bf16 weight copies) among the saved tensors."""
    shapes = {tuple(p.shape) for p in model.parameters()}
    shapes |= {s[::-1] for s in shapes}  # a cast weight saved as its transpose (k_proj's (H, kv) where kv != H)
    casts = masks = other = 0
    for t in saved.values():
        n = t.untyped_storage().nbytes()
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes:
            casts += n
        elif t.dim() == 4 and t.shape[1] == 1 and t.dtype == torch.bfloat16:  # (rows, 1, q, kv); cos/sin are fp32
            masks += n
        else:
            other += n
    return other, masks, casts


def measure(model, forward):
    """(saved tensors split, forward peak, backward peak): peaks in bytes over the weights and their gradients."""
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    hooks, saved = saved_tensors(model)
    base = rss_bytes()
    reset_peak(torch.device("cpu"))
    with hooks, torch.autocast("cpu", dtype=torch.bfloat16):
        out = forward()
    fwd = rss_bytes("VmHWM") - base
    parts = split(saved, model)
    saved.clear()
    reset_peak(torch.device("cpu"))
    out.float().pow(2).sum().backward()
    bwd = rss_bytes("VmHWM") - base
    return parts, fwd, bwd


def measure_actor(config, plan, prompt, prompt_mask, response, response_mask):
    from transformers import AutoModelForCausalLM
    actor = AutoModelForCausalLM.from_config(config, dtype=torch.float32).train()
    decoder, cache = actor.get_decoder(), {}
    real = decoder.forward

    def keep_cache(*a, **k):  # the KV cache of the shared prompt, as the responses' forward leaves it
        out = real(*a, **k)
        cache["bytes"] = sum(t.nbytes for layer in out.cache.layers for t in (layer.keys, layer.values))
        cache["dtype"] = "/".join(str(t.dtype).replace("torch.", "") for t in (out.cache.layers[0].keys,
                                                                                out.cache.layers[0].values))
        return out

    decoder.forward = keep_cache
    b, T = response.shape
    (act, masks, casts), fwd, bwd = measure(actor, lambda: pacs.response_logprobs(
        actor, prompt, prompt_mask, response, response_mask, group_size=b)[0])
    held = plan["activations of a micro-batch"] + plan["attention masks (SDPA)"] + plan["bf16 weight casts"]
    return [("activations", act, plan["activations of a micro-batch"]),
            ("attention masks (SDPA)", masks, plan["attention masks (SDPA)"]),
            ("bf16 weight copies", casts, plan["bf16 weight casts"]),
            (f"prompt KV cache (keys/values {cache['dtype']})", cache["bytes"],
             plan["KV cache of the shared prompt"]),
            ("forward peak", fwd, held + plan["end of the forward"]),
            ("backward peak", bwd, held + plan["logits chunk"])]


def measure_critic(model_dir, plan, prompt, prompt_mask, response, response_mask):
    from transformers import AutoConfig, AutoModelForTokenClassification
    config = AutoConfig.from_pretrained(model_dir, num_labels=1)
    critic = AutoModelForTokenClassification.from_config(config, dtype=torch.float32).train()
    b = response.shape[0]
    (act, masks, casts), fwd, bwd = measure(critic, lambda: pacs.response_values(
        critic, prompt, prompt_mask, response, response_mask, group_size=b))
    held = plan["critic activations"] + plan["critic bf16 casts"]
    return [("critic activations and masks", act + masks, plan["critic activations"]),
            ("critic bf16 weight copies", casts, plan["critic bf16 casts"]),
            ("critic forward peak", fwd, held + plan["KV cache of the shared prompt"]),
            ("critic backward peak", bwd, held + plan["critic embedding gradient"])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=os.path.join(ROOT, "..", "shared", "models", "qwen2.5-0.5b-instruct"))
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2, help="responses to one prompt: a micro-batch of one group")
    ap.add_argument("--models", nargs="+", choices=["actor", "critic"], default=["actor", "critic"],
                    help="which forward/backward to measure")
    args = ap.parse_args()
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # freed tensors leave the RSS (see gpu_step.py)
        os.execve(sys.executable, [sys.executable, *sys.argv],
                  {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"})
    from transformers import AutoConfig
    Lp, T, b = args.max_prompt_tokens, args.max_new_tokens, args.rows
    config = AutoConfig.from_pretrained(args.model_dir)
    cfg = pacs.Config(algo="ppo", autocast="bf16", group_size=b, max_prompt_tokens=Lp, max_new_tokens=T)
    n = plumbing.count_parameters(config)
    plan = plumbing.memory_plan(cfg, config, n, "cpu", b, 1)
    torch.manual_seed(0)
    prompt = torch.randint(0, config.vocab_size, (1, Lp)).repeat(b, 1)  # (b, Lp): one prompt
    response = torch.randint(0, config.vocab_size, (b, T))  # (b, T)
    prompt_mask, response_mask = torch.ones_like(prompt), torch.ones_like(response)
    response_mask[0, T - T // 8:] = 0  # one response ends early (EOS, then padding): the masks are materialised
    print(f"Qwen2.5-0.5B shape, random weights, bf16 autocast on the CPU: one group of {b} rows, prompt {Lp} + "
          f"response {T} tokens (GiB; peaks over the weights and their gradients)")
    rows = measure_actor(config, plan, prompt, prompt_mask, response, response_mask) if "actor" in args.models else []
    if "critic" in args.models:
        rows += measure_critic(args.model_dir, plan, prompt, prompt_mask, response, response_mask)
    print(f"{'':34s} {'measured':>9s} {'plan':>9s} {'measured / plan':>16s}")
    for name, measured, planned in rows:
        print(f"{name:34s} {measured / GiB:9.3f} {planned / GiB:9.3f} {measured / planned:16.3f}")


if __name__ == "__main__":
    main()
