"""Which of the paper's models fits which card: docs/gpu.md's fit tables, from the memory plan alone (no weights).

For each model config in models/ (published config.json files; models/README.md names their sources), full
fine-tuning and --lora-rank 16, on cards planned at 22.5, 39.5 and 79 GiB (--memory-gib, as docs/gpu.md's plan for
the default command), at paper v1's lengths (512 prompt + 4,096 response tokens, the official scripts') and v2's
(1,024 + 8,192), with pacs.py's other defaults (128 prompts x 8, M = 4, bf16 on CUDA): the rows per micro-batch the
plan picks, without --gradient-checkpointing if it fits so, else with it ("ckpt"), else "no". A cell that fits is a
plan, not a run. tests/test_models.py regenerates the tables and holds docs/gpu.md to them.

    python benchmarks/fit_table.py            # print the tables
    python benchmarks/fit_table.py --write    # and write them into docs/gpu.md between its fit-table markers
"""
import argparse
import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pacs  # noqa: E402
import plumbing  # noqa: E402

MODELS = ("qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen2.5-3b-instruct", "qwen2.5-7b-instruct", "qwen3-4b",
          "qwen3-8b")
CARDS = ((24, 22.5), (40, 39.5), (80, 79.0))  # (the card's GB, --memory-gib the plan is made for)
LENGTHS = (("v1", 512, 4096), ("v2", 1024, 8192))  # (paper version, prompt tokens, response tokens)
LORA_RANK = 16
BEGIN, END = "<!-- fit table: python benchmarks/fit_table.py --write -->", "<!-- end of the fit table -->"


def cell(cfg, config, n_params):
    """The plan's rows per micro-batch for cfg on CUDA: '8', '2 ckpt' (fits with --gradient-checkpointing only),
    or 'no'."""
    for ckpt in (False, True):
        try:
            sizes, _ = plumbing.plan_memory(dataclasses.replace(cfg, gradient_checkpointing=ckpt), config, n_params,
                                            "cuda", quiet=True, hint=False)
        except plumbing.ConfigError:
            continue
        return f"{sizes.micro_batch_size}{' ckpt' if ckpt else ''}"
    return "no"


def fit_tables(models_dir=os.path.join(ROOT, "models")):
    """The two markdown tables (v1's and v2's lengths), rows: each model, full and LoRA; columns: the cards."""
    out = []
    for version, prompt, response in LENGTHS:
        out.append(f"| {version}: {prompt:,} + {response:,} tokens | "
                   + " | ".join(f"{gb} GB" for gb, _ in CARDS) + " |")
        out.append("|---" * (1 + len(CARDS)) + "|")
        for name in MODELS:
            config = plumbing.load_model_config(os.path.join(models_dir, name))
            n_params = plumbing.count_parameters(config)
            for rank in (0, LORA_RANK):
                cells = [cell(pacs.Config(model=name, memory_gib=gib, max_prompt_tokens=prompt,
                                          max_new_tokens=response, lora_rank=rank), config, n_params)
                         for _, gib in CARDS]
                label = f"{name}{f', LoRA {rank}' if rank else ''} ({n_params / 1e9:.1f}B)"
                out.append(f"| {label} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def write(path, tables):
    """Replace what docs/gpu.md holds between BEGIN and END with the tables."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start] + "\n" + tables + "\n" + text[stop:])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--write", action="store_true", help="write the tables into docs/gpu.md")
    tables = fit_tables()
    print(tables)
    if ap.parse_args().write:
        write(os.path.join(ROOT, "docs", "gpu.md"), tables)


if __name__ == "__main__":
    main()
