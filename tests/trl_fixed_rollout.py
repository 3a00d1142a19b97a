"""A fixed rollout (prompts, responses, 0/1 rewards) fed to both pacs.train_step and examples/trl_pacs.py's
PACSTrainer, so that their updates can be compared. Used by tests/test_trl_pacs.py, and run as a script under
`accelerate launch --num_processes 2` by its two-process test (rank 0 writes the recorded gradients)."""
import argparse
import os
import random
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))

import pacs  # noqa: E402
import plumbing
import conftest  # noqa: E402  (reward_stand_in: pacs.reward_fn's stand-in)

PROBLEMS = [{"id": f"p{i}", "problem": f"What is {a} + {b}?", "answer": str(a + b)}
            for i, (a, b) in enumerate([(1, 2), (7, 5), (13, 4), (20, 9)])]


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the flattened gradient at every step (what the update is made of)."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.grads = []

    def step(self, closure=None):
        self.grads.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).clone()
                                     for g in self.param_groups for p in g["params"]]))
        return super().step(closure)


def prompt_ids(tokenizer, problem):
    """The prompt tokens pacs.sample feeds generate (TRL's chat templating gives the same ones; checked)."""
    return tuple(tokenizer(plumbing.build_prompt(tokenizer, problem), add_special_tokens=False)["input_ids"])


def make_rollout(tokenizer, group_size, max_len, seed=0):
    """{prompt ids: [(response ids, reward)] * G}: random distinct responses of 1..max_len tokens, most ending
    in EOS (inside the mask), some truncated; rewards mixed in every group but one (all wrong: no gradient)."""
    rng = random.Random(seed)
    vocab = [i for i in range(len(tokenizer)) if i not in tokenizer.all_special_ids]
    eos = tokenizer.eos_token_id
    table = {}
    for n, p in enumerate(PROBLEMS):
        rows, seen = [], set()
        while len(rows) < group_size:
            length = rng.randint(1, max_len)
            ids = [rng.choice(vocab) for _ in range(length)]
            if length < max_len or rng.random() < 0.7:  # EOS closes it, within max_len
                ids = ids[:max_len - 1] + [eos]
            if tuple(ids) in seen:
                continue
            seen.add(tuple(ids))
            reward = 0.0 if n == 3 else float(rng.random() < 0.5)
            rows.append((ids, reward))
        if n != 3 and len({r for _, r in rows}) == 1:  # force a mixed group
            rows[0] = (rows[0][0], 1.0 - rows[0][1])
        if n == 0:  # one truncated response: max_len tokens, no EOS (all of it is in the mask)
            rows[1] = ([rng.choice(vocab) for _ in range(max_len)], rows[1][1])
        table[prompt_ids(tokenizer, p["problem"])] = rows
    return table


def patch_pacs(monkeypatch, tokenizer, table, group_size):
    """pacs.sample / pacs.reward_fn return the fixed rollout for whatever prompts train_step asks for."""
    pad = tokenizer.pad_token_id
    last_rewards = []

    def fake_sample(model, tok, prompts, group_size=1, max_new_tokens=1024, *a, **k):
        enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)  # left-padded
        ids = enc["input_ids"].repeat_interleave(group_size, 0)  # (n*G, Lp)
        attn = enc["attention_mask"].repeat_interleave(group_size, 0)
        responses, rewards = [], []
        for text in prompts:
            for resp, r in table[tuple(tok(text, add_special_tokens=False)["input_ids"])]:
                responses.append(resp)
                rewards.append(r)
        T = max(len(r) for r in responses)
        resp = torch.tensor([r + [pad] * (T - len(r)) for r in responses])  # (n*G, T)
        mask, truncated = pacs.first_eos_mask(resp, [tok.eos_token_id])
        last_rewards[:] = rewards
        return {"prompt_ids": ids, "prompt_mask": attn, "response_ids": resp, "response_mask": mask,
                "truncated": truncated}

    monkeypatch.setattr(pacs, "sample", fake_sample)
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(lambda texts, answers: torch.tensor(last_rewards)))


def run_pacs(model_dir, table, group_size, num_mini_batches, lr, monkeypatch):
    """One pacs.train_step on the fixed rollout: (gradient of each mini-batch, metrics)."""
    model, tokenizer = plumbing.load_model(model_dir, "cpu", torch.float32)
    patch_pacs(monkeypatch, tokenizer, table, group_size)
    cfg = pacs.Config(model=model_dir, dataset="synthetic", prompts_per_step=len(PROBLEMS), group_size=group_size,
                      num_mini_batches=num_mini_batches, micro_batch_size=group_size, max_new_tokens=64, lr=lr,
                      device="cpu", eval_every=0)
    plumbing.check_config(cfg)
    opt = RecordingSGD(model.parameters(), lr)
    metrics, _ = pacs.train_step(cfg, model, tokenizer, opt, PROBLEMS, 0, torch.device("cpu"))
    order = [PROBLEMS[i] for i in plumbing.batch_indices(0, len(PROBLEMS), len(PROBLEMS), cfg.seed)]
    return opt.grads, metrics, order


def run_trl(model_dir, table, problems, group_size, per_device, grad_accum, num_mini_batches, lr, out_dir,
            reward_override=None):
    """PACSTrainer on the fixed rollout, one rollout = one generation batch, `problems` in this order (no
    dataset or group shuffling): (gradient of each optimizer step, the trainer)."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl_pacs import PACSConfig, PACSTrainer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ds = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": p["problem"] + plumbing.PROMPT_SUFFIX}],
                                      "answer": p["answer"]} for p in problems])
    lookup = {(key, tuple(resp)): r for key, rows in table.items() for resp, r in rows}
    by_text = {tokenizer.decode(list(key)): key for key in table}

    def reward(prompts, completion_ids, **kwargs):  # the fixed label of each (prompt, response)
        keys = [prompt_ids(tokenizer, p[0]["content"][:-len(plumbing.PROMPT_SUFFIX)]) for p in prompts]
        rewards = [lookup[(k, tuple(c))] for k, c in zip(keys, completion_ids)]
        return rewards if reward_override is None else [reward_override] * len(rewards)

    config = PACSConfig(output_dir=out_dir, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                        disable_tqdm=True, logging_steps=1, seed=0, shuffle_dataset=False, shuffle_groups=False,
                        num_generations=group_size, per_device_train_batch_size=per_device,
                        gradient_accumulation_steps=grad_accum, num_mini_batches=num_mini_batches,
                        max_steps=num_mini_batches, max_completion_length=64, learning_rate=lr,
                        activation_checkpointing=False)
    opt = RecordingSGD(model.parameters(), lr)
    trainer = PACSTrainer(model=model, reward_funcs=reward, args=config, train_dataset=ds, processing_class=tokenizer,
                          optimizers=(opt, None))

    def fixed_generate(prompt_ids_list, images, multimodal_fields, num_generations, has_tool_images=False):
        seen = {}
        out = []
        for ids in prompt_ids_list:
            key = tuple(ids)
            if key not in table:
                raise KeyError(f"TRL's prompt tokens differ from pacs's: {tokenizer.decode(list(ids))!r} "
                               f"(known: {list(by_text)})")
            k = seen.get(key, 0)
            seen[key] = k + 1
            out.append(list(table[key][k % num_generations][0]))
        return out, None

    trainer._generate_single_turn = fixed_generate
    trainer.train()
    return opt.grads, trainer


def main():
    ap = argparse.ArgumentParser(description="two-process run: rank 0 saves the gradients of each optimizer step")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--per-device", type=int, default=4)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--num-mini-batches", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    table = make_rollout(tokenizer, args.group_size, 12)
    grads, trainer = run_trl(args.model_dir, table, PROBLEMS, args.group_size, args.per_device, args.grad_accum,
                             args.num_mini_batches, args.lr, os.path.dirname(args.out))
    if trainer.accelerator.is_main_process:
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        torch.save({"grads": grads, "num_processes": trainer.accelerator.num_processes, "backend": backend}, args.out)
    from trl_pacs import end_distributed
    # on every rank: a process group left to teardown can abort or hang the process
    assert end_distributed(trainer), "the DDP wrapper outlived training"


if __name__ == "__main__":
    main()
