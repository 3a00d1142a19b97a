"""The lab: a testbed small enough for the trend sweep to have power on a CPU, built offline from nothing.

A synthetic verifiable task (a two-digit number, then two additions or subtractions of 1..9, a worked solution,
a boxed answer), a tokenizer of 24 tokens with a chat template, and a Qwen2ForCausalLM (2 layers, hidden 128)
trained by supervised fine-tuning on the worked solutions and stopped where it is partly right, so that RL has
both signal and headroom. pacs.py trains it and eval.py scores it unchanged (experiments/labs/lab/README.md):

    python experiments/lab.py --out experiments/out_lab/lab --seed 0
    python pacs.py --model experiments/out_lab/lab/model --dataset experiments/out_lab/lab/train.jsonl \
        --prompts-per-step 32 --num-mini-batches 4 --max-new-tokens 32 --micro-batch-size 64 --lr 3e-5 \
        --eval-every 0 --steps 150
    python eval.py --model experiments/out_lab/lab/model --datasets experiments/out_lab/lab/test.jsonl --n 64 \
        --temperature 1.0 --top-p 1.0 --max-new-tokens 32 --batch-size 1024 --out runs/lab_base

The countdown lab (experiments/labs/countdown/base; several right answers per problem, chain rows mixed into SFT
so that the chain test split is a second domain, experiments/labs/countdown/README.md):

    python experiments/lab.py --task countdown --out experiments/out_lab/countdown --seed 0 --max-new-tokens 40

Writes into --out (which must not exist): sft.jsonl (the worked solutions SFT trains on), train.jsonl (the
prompts RL trains on), val.jsonl (the learning-rate scan's), test.jsonl (the final pass@k's), each a JSONL of
{id, problem, answer, solution, source}, no problem in two files; model/ (save_pretrained: config, weights,
tokenizer); sft_log.jsonl (the loss and the validation pass@1 at each check); eval_base/ (eval.py's files for
the base model on the test split); lab.json (the build's settings, the stop, the time and the base pass@k).

The stopping rule reads the validation split only: every --check-every SFT steps, pass@1 at T = 1.0 on
--check-problems validation problems x --check-n samples; SFT stops at the first check at or above --target and
keeps the weights of that check or of the one before, whichever is closer to --target.
The test split chooses nothing; its pass@1, pass@8 and pass@64 are the last line printed.
"""
import argparse
import hashlib
import itertools
import json
import os
import platform
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import eval as pacs_eval  # noqa: E402  (pass@k from n samples, resumable: the base model's eval)
import pacs  # noqa: E402  (build_prompt, sample, reward_fn: the prompts, rollouts and rewards of training)
import plumbing  # noqa: E402
import verify  # noqa: E402  (a chain row's verdict where the countdown task scores rows itself)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import countdown  # noqa: E402  (the countdown task's checker: countdown.check, countdown.canonical)

SOURCE = "lab-chain"
WHAT_IS = "What is"  # the problem's opening, one token
BOX = "\\boxed{"  # the answer's opening, one token
SPECIALS = ["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>"]
CHARS = "0123456789+-=? }\n"  # every other character of a problem or a solution: one token each
CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPLITS = ("test", "val", "train", "sft")  # filled in this order from one stream of distinct problems
TASKS = ("chain", "countdown")
COUNTDOWN_SOURCE = "lab-countdown"
MAKE, FROM = "Make", "from"  # a countdown problem's words, one token each: Make 24 from 2 3 8?
COUNTDOWN_CHARS = "*/()"  # the countdown task's characters beyond CHARS
COUNTDOWN_MAX_TARGET = 99
# the countdown task's splits, in this order: its own (test, val, train: RL's; sft: SFT's, with the chain rows) and
# the chain task's test split, the out-of-domain score
COUNTDOWN_SPLITS = ("test", "val", "train", "sft", "chain_test")
# The reference lab: the base model every committed lab result trained from (model/, lab.json, sft_log.jsonl); its
# splits are not committed but regenerated from the seed (ensure_splits), checked against lab.json's hash.
SHIPPED = os.path.join(ROOT, "experiments", "labs", "lab", "base")


def shipped_bases(tag_dir):
    """A lab's shipped bases, experiments/labs/<tag>/base first, then experiments/labs/<tag>/bases/seed<N> in seed
    order: the same recipe (lab.py with the first base's settings) at other seeds, each a model, lab.json and
    sft_log.jsonl as the first."""
    more = os.path.join(tag_dir, "bases")
    seeds = sorted((int(d[4:]) for d in os.listdir(more) if d.startswith("seed") and d[4:].isdigit()
                    and os.path.isfile(os.path.join(more, d, "lab.json"))) if os.path.isdir(more) else [])
    return [os.path.join(tag_dir, "base")] + [os.path.join(more, f"seed{s}") for s in seeds]


def results_root(lab_dir):
    """Where a lab's result files live: experiments/labs/<tag>/results/ for a lab's first base
    (experiments/labs/<tag>/base), <lab_dir>/results/ for any other (experiments/labs/<tag>/bases/seed<N>, or a lab
    built elsewhere)."""
    lab_dir = os.path.abspath(lab_dir)
    if os.path.basename(lab_dir) == "base":
        return os.path.join(os.path.dirname(lab_dir), "results")
    return os.path.join(lab_dir, "results")


def run_tag(lab_dir):
    """The name of a lab's run dirs, experiments/out_<tag>/: <tag> for experiments/labs/<tag>/base, <tag>-seed<N> for
    experiments/labs/<tag>/bases/seed<N> (two labs' seed<N> bases apart), the directory's name for a lab built
    elsewhere."""
    lab_dir = os.path.abspath(lab_dir)
    parent = os.path.dirname(lab_dir)
    if os.path.basename(lab_dir) == "base":
        return os.path.basename(parent)
    if os.path.basename(parent) == "bases":
        return f"{os.path.basename(os.path.dirname(parent))}-{os.path.basename(lab_dir)}"
    return os.path.basename(lab_dir)


class LabError(Exception):
    """A user-facing problem with the flags or the --out dir: printed as one line."""


# =====================================================================================================
# The task: chains of two-digit + and -, each step a skill every problem shares
# =====================================================================================================
def make_problem(rng, n_ops=2, max_operand=9):
    """{problem, answer, solution}: a two-digit number, then n_ops additions and subtractions of numbers in
    [1, max_operand], the running total kept >= 0. The solution writes one equation per operation, a line each,
    each starting from the previous total; the last one's result is boxed:
        What is 63+8-5?  ->  63+8=71\\n71-5=\\boxed{66}
    The skills every problem shares: adding and subtracting a small number, with a carry or a borrow or not."""
    total = rng.randint(10, 99)
    expr, steps = str(total), []
    for _ in range(n_ops):
        b = rng.randint(1, max_operand)
        sub = rng.random() < 0.5 and b <= total
        new = total - b if sub else total + b
        op = "-" if sub else "+"
        expr += f"{op}{b}"
        steps.append(f"{total}{op}{b}={BOX}{new}}}" if len(steps) == n_ops - 1 else f"{total}{op}{b}={new}")
        total = new
    return {"problem": f"{WHAT_IS} {expr}?", "answer": str(total), "solution": "\n".join(steps)}


def parse_ops(text):
    """'2' -> (2, 2), '2-4' -> (2, 4): the number of operations of a split's problems, drawn uniformly in the range."""
    try:
        lo, _, hi = text.partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise LabError(f"operations {text!r}: expected N or A-B, e.g. 2 or 2-4") from None
    if not 1 <= lo <= hi:
        raise LabError(f"operations {text!r}: expected 1 <= A <= B")
    return lo, hi


def make_splits(seed, sizes, max_operand=9, ops="2", sft_ops=""):
    """{split: rows} for the splits in SPLITS with sizes[split] rows each, from one seeded stream of problems,
    each distinct problem kept once: no problem is in two splits. Rows: {id, problem, answer, solution, source}.
    ops: the operations per problem of the RL splits (test, val, train), sft_ops those of SFT's (default: ops);
    a range draws each problem's count from the stream (a fixed count draws nothing: the first lab's stream)."""
    rng = random.Random(seed)
    seen, out = set(), {}
    for split in SPLITS:
        lo, hi = parse_ops(sft_ops or ops) if split == "sft" else parse_ops(ops)
        rows, tries = [], 0
        while len(rows) < sizes[split]:
            tries += 1
            if tries > 20 * sizes[split] + 1000:
                raise LabError(f"cannot draw {sizes[split]} distinct {split} problems (only {len(rows)} new ones)")
            p = make_problem(rng, lo if lo == hi else rng.randint(lo, hi), max_operand=max_operand)
            if p["problem"] in seen:
                continue
            seen.add(p["problem"])
            rows.append({"id": f"{split}-{len(rows)}", **p, "source": SOURCE})
        out[split] = rows
    return out


# =====================================================================================================
# The countdown task (--task countdown): a target and three numbers, each used once; several right answers
# =====================================================================================================
def countdown_solutions(numbers):
    """{target: {canonical form: [solutions]}}: every worked solution of three numbers, two of them combined, then
    the result with the third, each step's result a positive integer (a division exact), the target at most
    COUNTDOWN_MAX_TARGET. A solution is one equation a line, then the whole expression boxed:
        Make 24 from 2 5 8?  ->  5-2=3\\n3*8=24\\n\\boxed{(5-2)*8}"""
    out = {}
    for i, j in itertools.permutations(range(3), 2):
        a, b, c = numbers[i], numbers[j], numbers[3 - i - j]
        for op1, op2 in itertools.product("+-*/", repeat=2):
            x = countdown.value((op1, a, b))
            if x is None or x.denominator != 1 or x < 1:
                continue
            first = f"{a}{op1}{b}={x}\n"
            for tree, line, boxed in (((op2, (op1, a, b), c), f"{x}{op2}{c}", f"({a}{op1}{b}){op2}{c}"),
                                      ((op2, c, (op1, a, b)), f"{c}{op2}{x}", f"{c}{op2}({a}{op1}{b})")):
                y = countdown.value(tree)
                if y is not None and y.denominator == 1 and 1 <= y <= COUNTDOWN_MAX_TARGET:
                    forms = out.setdefault(int(y), {}).setdefault(countdown.canonical(tree), [])
                    text = f"{first}{line}={y}\n{BOX}{boxed}}}"
                    if text not in forms:
                        forms.append(text)
    return out


def countdown_problems(max_number):
    """Every countdown problem of three numbers in 2..max_number (a multiset, written in increasing order): one per
    reachable target, [(numbers, target, {canonical form: [solutions]})] in a fixed order."""
    return [(list(ns), t, forms) for ns in itertools.combinations_with_replacement(range(2, max_number + 1), 3)
            for t, forms in sorted(countdown_solutions(list(ns)).items())]


def countdown_row(split, i, numbers, target, solution):
    return {"id": f"{split}-{i}", "problem": f"{MAKE} {target} {FROM} {' '.join(map(str, numbers))}?",
            "answer": countdown.answer_field(numbers, target), "solution": solution, "source": COUNTDOWN_SOURCE}


def make_countdown_splits(seed, sizes, max_number=12, min_forms=3):
    """{split: rows} for COUNTDOWN_SPLITS. test, val and train: distinct problems with at least min_forms canonical
    right answers, drawn without replacement; sft: sizes["sft"] countdown rows over every other problem (a problem
    again and again, each row a right answer drawn at random: a canonical form, then one of its solutions), mixed
    with sizes["chain_sft"] chain rows; chain_test: sizes["chain_test"] chain problems. The chain rows are
    make_splits' stream at the same seed (its test split, then its SFT rows): no chain test problem in SFT."""
    rng = random.Random(seed)
    problems = countdown_problems(max_number)
    rng.shuffle(problems)
    rich = [p for p in problems if len(p[2]) >= min_forms]
    n_rl = sizes["test"] + sizes["val"] + sizes["train"]
    if n_rl > len(rich):
        raise LabError(f"--test/val/train-problems ask for {n_rl} countdown problems; numbers 2..{max_number} give "
                       f"{len(rich)} with at least {min_forms} right answers")
    out, start = {}, 0
    for split in ("test", "val", "train"):
        out[split] = [countdown_row(split, i, ns, t, rng.choice(forms[rng.choice(sorted(forms))]))
                      for i, (ns, t, forms) in enumerate(rich[start:start + sizes[split]])]
        start += sizes[split]
    taken = {(tuple(ns), t) for ns, t, _ in rich[:n_rl]}
    pool = [p for p in problems if (tuple(p[0]), p[1]) not in taken]
    sft = []
    for i in range(sizes["sft"]):
        ns, t, forms = pool[i % len(pool)]
        sft.append(countdown_row("sft", i, ns, t, rng.choice(forms[rng.choice(sorted(forms))])))
    chain = make_splits(seed, {"test": sizes["chain_test"], "val": 0, "train": 0, "sft": sizes["chain_sft"]})
    sft += [{**r, "id": f"chain-{r['id']}"} for r in chain["sft"]]
    rng.shuffle(sft)
    out["sft"] = sft
    out["chain_test"] = [{**r, "id": f"chain-{r['id']}"} for r in chain["test"]]
    return out


def countdown_forms(rows):
    """{canonical right answers: problems} over countdown rows: how many distinct right answers each has."""
    counts = {}
    for r in rows:
        numbers, target = countdown.parse_answer(r["answer"])
        n = len(countdown_solutions(numbers).get(target, {}))
        counts[n] = counts.get(n, 0) + 1
    return dict(sorted(counts.items()))


def splits_for(settings):
    """The splits a lab.json's settings name, regenerated: the chain task's (make_splits) or the countdown task's
    (make_countdown_splits); a setting a lab.json predates takes its default."""
    if settings.get("task", "chain") == "countdown":
        sizes = {s: settings[f"{s}_problems"] for s in ("test", "val", "train", "sft", "chain_test", "chain_sft")}
        return make_countdown_splits(settings["seed"], sizes, settings["max_number"], settings["min_forms"])
    return make_splits(settings["seed"], {s: settings[f"{s}_problems"] for s in SPLITS}, settings["max_operand"],
                       settings.get("ops", "2"), settings.get("sft_ops", ""))


def splits_sha(splits):
    """sha256 of the splits' JSONL lines in SPLITS order: Python's random is the same on every machine, so a seed
    regenerates the same splits anywhere, and this hash says so."""
    h = hashlib.sha256()
    for split in (s for s in SPLITS + COUNTDOWN_SPLITS[len(SPLITS):] if s in splits):  # the chain task's: SPLITS
        for r in splits[split]:
            h.update((json.dumps(r) + "\n").encode())
    return h.hexdigest()


def write_splits(out, splits):
    for split, rows in splits.items():
        with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


def ensure_splits(lab_dir):
    """Write the lab's split files into lab_dir if any is missing (the shipped lab commits none), regenerated from
    lab.json's settings (splits_for) and checked against its splits_sha256 (a lab.json without one: nothing to
    check against, nothing written)."""
    with open(os.path.join(lab_dir, "lab.json")) as f:
        info = json.load(f)
    names = COUNTDOWN_SPLITS if info.get("settings", {}).get("task", "chain") == "countdown" else SPLITS
    if all(os.path.isfile(os.path.join(lab_dir, f"{s}.jsonl")) for s in names) or "splits_sha256" not in info:
        return
    cfg = info["settings"]
    splits = splits_for(cfg)
    got = splits_sha(splits)
    if got != info["splits_sha256"]:
        raise LabError(f"the splits regenerated from seed {cfg['seed']} do not match {lab_dir}/lab.json's "
                       f"splits_sha256 ({got[:12]} against {info['splits_sha256'][:12]})")
    write_splits(lab_dir, splits)


def machine():
    """What ran it: a result depends on the torch build and the CPU's kernels (the same seed gives other weights
    on another CPU)."""
    cpu = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return {"torch": torch.__version__, "cpu": cpu, "threads": torch.get_num_threads(),
            "python": platform.python_version()}


# =====================================================================================================
# The tokenizer: one token per character, and one each for the problem's opening, the prompt's instruction
# and \boxed{; a chat template, so plumbing.build_prompt formats the lab's prompts as it does Qwen's
# =====================================================================================================
def byte_level_chars():
    """GPT-2's byte -> printable character map that byte-level BPE uses: {byte: char}."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def make_tokenizer(task="chain"):
    """A byte-level BPE without merges over CHARS (byte-level, as transformers reloads a Qwen2 model's
    tokenizer), the words WHAT_IS, plumbing.PROMPT_SUFFIX and BOX as added tokens, and the chat template. The
    countdown task's adds COUNTDOWN_CHARS after CHARS, and the words MAKE and FROM."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    byte_char = byte_level_chars()
    chars = CHARS + (COUNTDOWN_CHARS if task == "countdown" else "")
    vocab = {tok: i for i, tok in enumerate(SPECIALS + [byte_char[ord(c)] for c in chars])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=SPECIALS[0], eos_token=SPECIALS[1],
                                   additional_special_tokens=SPECIALS[2:])
    words = (WHAT_IS, plumbing.PROMPT_SUFFIX, BOX) + ((MAKE, FROM) if task == "countdown" else ())
    fast.add_tokens([AddedToken(w, normalized=False) for w in words])
    fast.chat_template = CHAT_TEMPLATE
    return fast


# =====================================================================================================
# The model and its supervised fine-tuning
# =====================================================================================================
def make_model(tokenizer, hidden, layers, heads, seed, intermediate=0):
    """A randomly initialised Qwen2ForCausalLM over the lab's tokenizer (tied embeddings, seeded; MLP width
    intermediate, 0: 2 x hidden), eager attention for SFT. The saved config does not pin it: pacs.py and eval.py
    reload the model with transformers' default (SDPA), which a lab step measured the same as eager within noise."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                         max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, attn_implementation="eager")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def encode_sft(tokenizer, rows):
    """(ids (N, L), labels (N, L), attention (N, L)): the chat prompt then the solution and EOS, right-padded;
    labels are the ids on the solution and its EOS and -100 on the prompt and padding (the loss reads only
    what the model writes)."""
    seqs, starts = [], []
    for r in rows:
        prompt = tokenizer(plumbing.build_prompt(tokenizer, r["problem"]), add_special_tokens=False)["input_ids"]
        answer = tokenizer(r["solution"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        starts.append(len(prompt))
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), tokenizer.pad_token_id, dtype=torch.long)  # (N, L)
    labels = torch.full((len(seqs), L), -100, dtype=torch.long)  # (N, L)
    attention = torch.zeros((len(seqs), L), dtype=torch.long)  # (N, L)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, start:len(s)] = ids[i, start:len(s)]
        attention[i, :len(s)] = 1
    return ids, labels, attention


def score(texts, answers):
    """R in {0, 1} (N,) of mixed rows: countdown.check on a countdown row, verify.verify on any other (chain) row:
    how pacs.py and eval.py score them with --reward experiments/countdown.py:check."""
    verdicts = [countdown.check(t, a) for t, a in zip(texts, answers)]
    return torch.tensor([float(verify.verify(t, a) if v is None else v) for v, t, a in zip(verdicts, texts, answers)])


def sample_pass1(model, tokenizer, problems, n, max_new_tokens, seed, task="chain"):
    """Mean reward of n samples per problem at T = 1.0 (pass@1 estimated from n samples), seeded; the chain task's
    rewards by pacs.reward_fn, the countdown task's by score."""
    prompts = [plumbing.build_prompt(tokenizer, p["problem"]) for p in problems]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        roll = pacs.sample(model, tokenizer, prompts, n, max_new_tokens, temperature=1.0, batch_prompts=0)
    texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)
    answers = [p["answer"] for p in problems for _ in range(n)]
    if task == "countdown":
        return score(texts, answers).mean().item()
    return pacs.reward_fn(texts, answers).mean().item()


def sample_passk(model, tokenizer, problems, n, max_new_tokens, seed, path, batch_prompts=16):
    """The countdown lab's base eval, scored by score: n samples per problem at T = 1.0, top-p 1, in batches of
    batch_prompts problems, each batch seeded; writes {id, answer, responses, correct, forms} per problem to path
    (forms: the distinct canonical forms among its right countdown answers) and returns {k: pass@k} for k = 1..n."""
    counts = []
    with open(path, "w") as f, torch.random.fork_rng(devices=[]):
        for b in range(0, len(problems), batch_prompts):
            batch = problems[b:b + batch_prompts]
            torch.manual_seed(seed + b)
            prompts = [plumbing.build_prompt(tokenizer, p["problem"]) for p in batch]
            roll = pacs.sample(model, tokenizer, prompts, n, max_new_tokens, temperature=1.0, batch_prompts=0)
            texts = tokenizer.batch_decode(roll["response_ids"], skip_special_tokens=True)
            right = score(texts, [p["answer"] for p in batch for _ in range(n)]).tolist()
            for i, p in enumerate(batch):
                mine, ok = texts[i * n:(i + 1) * n], [bool(x) for x in right[i * n:(i + 1) * n]]
                forms = {countdown.canonical(verify.extract_answer(t, strict=True)) for t, y in zip(mine, ok)
                         if y and countdown.parse_answer(p["answer"])}
                counts.append(sum(ok))
                f.write(json.dumps({"id": p["id"], "answer": p["answer"], "responses": mine, "correct": ok,
                                    "forms": len(forms)}) + "\n")
    return {str(k): sum(pacs_eval.pass_at_k(n, c, k) for c in counts) / len(counts) for k in range(1, n + 1)}


def sft(model, tokenizer, rows, val, args, log):
    """AdamW on the solutions' next-token loss, batches drawn by a seeded generator. Every args.check_every steps
    the validation pass@1 (sample_pass1) is measured; SFT ends at the first check at or above args.target, and
    the weights kept are those of that check or of the one before, whichever is closer to args.target (SFT's
    pass@1 climbs steeply here: from 0.19 to 0.46 in 50 steps, seed 0). Returns (the kept check's step, its
    validation pass@1)."""
    ids, labels, attention = encode_sft(tokenizer, rows)  # (N, L) each
    opt = torch.optim.AdamW(model.parameters(), lr=args.sft_lr, weight_decay=0.0, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(args.seed)
    check_rows = val[:args.check_problems]
    kept, t0 = (0, 0.0, None), time.time()  # (step, validation pass@1, weights) of the last check
    for step in range(1, args.max_sft_steps + 1):
        # lr: linear warm-up over the first 100 steps, then constant
        for g in opt.param_groups:
            g["lr"] = args.sft_lr * min(1.0, step / 100)
        idx = torch.randint(0, len(ids), (args.sft_batch,), generator=gen)  # (b,)
        width = int(attention[idx].sum(1).max())  # trim the batch to its longest row
        model.train()
        loss = model(input_ids=ids[idx, :width], attention_mask=attention[idx, :width],
                     labels=labels[idx, :width]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % args.check_every == 0 or step == args.max_sft_steps:
            model.eval()
            val_pass1 = sample_pass1(model, tokenizer, check_rows, args.check_n, args.max_new_tokens, args.seed + step,
                                     getattr(args, "task", "chain"))
            row = {"step": step, "loss": loss.item(), "val_pass1": val_pass1, "time": time.time() - t0}
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"[sft] step {step:5d} | loss {row['loss']:.4f} | val pass@1 {val_pass1:.3f} | "
                  f"{row['time']:.0f}s", file=sys.stderr, flush=True)
            if val_pass1 >= args.target:
                if kept[2] is not None and abs(kept[1] - args.target) < abs(val_pass1 - args.target):
                    model.load_state_dict(kept[2])
                    print(f"[sft] kept step {kept[0]} (val pass@1 {kept[1]:.3f}, closer to {args.target})",
                          file=sys.stderr)
                    return kept[0], kept[1]
                return step, val_pass1
            kept = (step, val_pass1, {k: v.clone() for k, v in model.state_dict().items()})
    return step, kept[1]


def weights_sha(model):
    """sha256 of the model's weights (names and bytes): a sweep records which lab its runs trained."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# =====================================================================================================
# Main
# =====================================================================================================
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="the lab's directory (must not exist)")
    p.add_argument("--seed", type=int, default=0, help="seeds the problems, the initial weights and SFT's batches")
    p.add_argument("--sft-problems", type=int, default=20000, help="worked solutions SFT trains on")
    p.add_argument("--train-problems", type=int, default=6000, help="RL's prompts (150 steps x 32 = 4800 per run)")
    p.add_argument("--val-problems", type=int, default=200, help="the learning-rate scan's and the stop's")
    p.add_argument("--test-problems", type=int, default=200, help="the final pass@k's")
    p.add_argument("--max-operand", type=int, default=9, help="the added and subtracted numbers: 1..this")
    p.add_argument("--ops", default="2", help="operations per problem of the RL splits (test, val, train): N or a "
                   "range A-B drawn uniformly")
    p.add_argument("--sft-ops", default="", help="operations per SFT solution, N or A-B (default: --ops); fewer "
                   "than --ops gives the RL splits longer chains than SFT saw")
    p.add_argument("--task", choices=TASKS, default="chain", help="chain: the first lab's arithmetic; countdown: a "
                   "target from three numbers, several right answers, SFT mixed with chain rows")
    p.add_argument("--max-number", type=int, default=25, help="countdown: the numbers are 2..this (25: 6,947 "
                   "problems with --min-forms 3 right answers, enough for the default splits)")
    p.add_argument("--min-forms", type=int, default=3, help="countdown: the canonical right answers every test, "
                   "val and train problem has at least")
    p.add_argument("--chain-sft-problems", type=int, default=700, help="countdown: chain rows mixed into SFT's "
                   "countdown rows (--sft-problems); 700 puts the base's chain test pass@1 at 0.374, 1500 at 0.650 "
                   "(seed 0, 40 new tokens: experiments/labs/countdown/)")
    p.add_argument("--chain-test-problems", type=int, default=200, help="countdown: the chain test split, the "
                   "out-of-domain score")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (intermediate: 2x)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--sft-lr", type=float, default=1e-3, help="AdamW lr of SFT (after 100 warm-up steps)")
    p.add_argument("--sft-batch", type=int, default=64, help="solutions per SFT step")
    p.add_argument("--max-sft-steps", type=int, default=4000, help="SFT stops here if no check reached --target")
    p.add_argument("--check-every", type=int, default=20, help="SFT steps between two validation checks")
    p.add_argument("--check-problems", type=int, default=100, help="validation problems per check")
    p.add_argument("--check-n", type=int, default=4, help="samples per problem per check")
    p.add_argument("--target", type=float, default=0.3, help="SFT stops at the first check with validation "
                   "pass@1 at or above this, and keeps that check's weights or the previous check's, the closer")
    p.add_argument("--max-new-tokens", type=int, default=32, help="response length limit of every sample")
    p.add_argument("--eval-n", type=int, default=64, help="samples per test problem for the base model's pass@k")
    p.add_argument("--window-pass1", type=float, nargs=2, default=[0.15, 0.5], metavar=("LO", "HI"),
                   help="warn when the base model's test pass@1 is outside [LO, HI]")
    p.add_argument("--window-passn", type=float, nargs=2, default=[0.8, 1.0], metavar=("LO", "HI"),
                   help="warn when its test pass@eval-n is outside [LO, HI]")
    return p.parse_args(argv)


def check_args(args):
    if os.path.exists(args.out):
        raise LabError(f"--out {args.out} exists; the lab is built into a new directory")
    for flag in ("max_operand", "sft_problems", "train_problems", "val_problems", "test_problems", "hidden", "layers",
                 "heads",
                 "sft_batch", "max_sft_steps", "check_every", "check_problems", "check_n", "max_new_tokens", "eval_n"):
        if getattr(args, flag) < 1:
            raise LabError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    parse_ops(args.ops), parse_ops(args.sft_ops or args.ops)
    if args.task == "countdown" and (args.max_number < 2 or args.chain_test_problems < 1 or args.chain_sft_problems < 0
                                     or args.min_forms < 1):
        raise LabError("countdown: --max-number must be at least 2, --chain-test-problems and --min-forms at least 1, "
                       "--chain-sft-problems at least 0")
    if args.hidden % args.heads:
        raise LabError(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    if not args.sft_lr > 0:
        raise LabError(f"--sft-lr must be > 0, got {args.sft_lr}")
    if not 0 < args.target <= 1:
        raise LabError(f"--target must be in (0, 1], got {args.target}")


def build(args):
    t0 = time.time()
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    sizes = {"sft": args.sft_problems, "train": args.train_problems, "val": args.val_problems,
             "test": args.test_problems}
    if args.task == "countdown":
        sizes.update(chain_sft=args.chain_sft_problems, chain_test=args.chain_test_problems)
        splits = make_countdown_splits(args.seed, sizes, args.max_number, args.min_forms)
    else:
        splits = make_splits(args.seed, sizes, args.max_operand, args.ops, args.sft_ops)
    os.makedirs(args.out)
    write_splits(args.out, splits)
    tokenizer = make_tokenizer(args.task)
    tokenizer.padding_side = "left"  # generate's side; encode_sft pads by hand
    model = make_model(tokenizer, args.hidden, args.layers, args.heads, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[lab] {len(tokenizer)} tokens, Qwen2ForCausalLM {args.layers} x {args.hidden}: {n_params:,} parameters; "
          + ", ".join(f"{s} {len(r)}" for s, r in splits.items()), file=sys.stderr)
    with open(os.path.join(args.out, "sft_log.jsonl"), "w") as log:
        steps, val_pass1 = sft(model, tokenizer, splits["sft"], splits["val"], args, log)
    model_dir = os.path.join(args.out, "model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    t_sft = time.time() - t0
    if args.task == "countdown":
        return build_countdown_summary(args, model, tokenizer, splits, steps, val_pass1, n_params, t0, t_sft)
    # the base model's pass@k on the test split, by eval.py (the sweep reuses these files as its eval_base)
    ks = ",".join(str(k) for k in range(1, args.eval_n + 1))
    ev = pacs_eval.evaluate(plumbing.parse_flags(pacs_eval.EvalConfig, "", [
        "--model", model_dir, "--datasets", os.path.join(args.out, "test.jsonl"), "--n", str(args.eval_n),
        "--k", ks, "--temperature", "1.0", "--top-p", "1.0", "--max-new-tokens", str(args.max_new_tokens),
        "--batch-size", "1024", "--device", "cpu", "--out", os.path.join(args.out, "eval_base")]))
    passk = ev["datasets"]["test"]["pass@k"]
    with open(os.path.join(args.out, "eval_base", "samples.jsonl")) as f:
        right = [sum(json.loads(line)["correct"]) for line in f if line.strip()]  # per test problem, of eval_n
    summary = {"settings": vars(args), "sft_steps": steps, "val_pass1_at_stop": val_pass1,
               "parameters": n_params, "vocab": len(tokenizer), "weights_sha256": weights_sha(model),
               "splits_sha256": splits_sha(splits), "machine": machine(),
               "sft_s": t_sft, "wall_s": time.time() - t0, "test_pass@k": {k: passk[k] for k in passk},
               "test_rare_share": sum(c <= 1 for c in right) / len(right)}  # solved by at most 1 sample of eval_n
    with open(os.path.join(args.out, "lab.json"), "w") as f:
        json.dump(summary, f, indent=1)
    p1, pn = passk["1"], passk[str(args.eval_n)]
    (lo1, hi1), (lon, hin) = args.window_pass1, args.window_passn
    if not (lo1 <= p1 <= hi1 and lon <= pn <= hin):
        print(f"[lab] warning: the base model is outside the window asked for (pass@1 in [{lo1}, {hi1}], "
              f"pass@{args.eval_n} in [{lon}, {hin}])", file=sys.stderr)
    ks = [k for k in (1, 8, 64, 256) if k <= args.eval_n]
    print(f"[lab] {args.out}: {steps} SFT steps, {summary['wall_s']:.0f}s; base model on the test split at T = 1.0:")
    print("  ".join(f"pass@{k} {passk[str(k)]:.3f}" for k in ks)
          + f"  solved by at most 1 of {args.eval_n}: {summary['test_rare_share']:.3f}")
    return summary


def build_countdown_summary(args, model, tokenizer, splits, steps, val_pass1, n_params, t0, t_sft):
    """The countdown lab's base eval (sample_passk, scored by countdown.check and verify.py: eval.py's files for
    the chain task's lab) on its test split and the chain test split, and its lab.json."""
    os.makedirs(os.path.join(args.out, "eval_base"))
    model.eval()
    passk = {split: sample_passk(model, tokenizer, splits[split], args.eval_n, args.max_new_tokens, args.seed,
                                 os.path.join(args.out, "eval_base", f"{split}.jsonl"))
             for split in ("test", "chain_test")}
    with open(os.path.join(args.out, "eval_base", "test.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    summary = {"settings": vars(args), "sft_steps": steps, "val_pass1_at_stop": val_pass1,
               "parameters": n_params, "vocab": len(tokenizer), "weights_sha256": weights_sha(model),
               "splits_sha256": splits_sha(splits), "machine": machine(), "sft_s": t_sft, "wall_s": time.time() - t0,
               "test_pass@k": passk["test"], "chain_test_pass@k": passk["chain_test"],
               "test_rare_share": sum(sum(r["correct"]) <= 1 for r in rows) / len(rows),
               "test_right_answers": countdown_forms(splits["test"]),  # {canonical right answers: problems}
               "test_forms_found": sum(r["forms"] for r in rows) / len(rows)}  # mean distinct forms the base boxed
    with open(os.path.join(args.out, "lab.json"), "w") as f:
        json.dump(summary, f, indent=1)
    ks = [k for k in (1, 8, 64, 256) if k <= args.eval_n]
    print(f"[lab] {args.out}: {steps} SFT steps, {summary['wall_s']:.0f}s; base model at T = 1.0:")
    for name, split in (("countdown test", "test"), ("chain test", "chain_test")):
        print(f"  {name}: " + "  ".join(f"pass@{k} {passk[split][str(k)]:.3f}" for k in ks))
    print(f"  countdown test: {summary['test_forms_found']:.2f} distinct right answers found per problem; right "
          f"answers per problem (canonical forms: problems) {summary['test_right_answers']}")
    return summary


def main(argv=None):
    args = parse_args(argv)
    try:
        check_args(args)
        build(args)
    except (LabError, plumbing.ConfigError) as e:
        sys.exit(f"lab.py: error: {e}")


if __name__ == "__main__":
    main()
