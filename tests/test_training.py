"""Behaviours of the training loop that the metrics alone would not reveal, checked on a tiny random model
through pacs.py's stable interfaces (train_step, sample, reward_fn, algo_loss, response_logprobs,
batch_indices, save_checkpoint): the critic is scored against pi_old, the data order is a function of the
seed, a non-finite gradient never reaches the weights, and a kill mid-save never leaves a broken checkpoint.

Rows reach algo_loss in rollout order, each row once, each call within one mini-batch; the tests map a call
to its rows by counting rows, never through train_step's local variables."""
import copy
import hashlib
import math
import os
import shutil
import sys

import pytest
import torch

import pacs

import plumbing
import conftest

G, P, M, MICRO = 4, 6, 3, 4  # 6 prompts x 4 samples = 24 rows; 3 mini-batches of 8 rows; 2 micro-batches each
ROWS_PER_MINI = P * G // M
LOG2 = math.log(2.0)
PROBLEMS = [{"id": str(i), "problem": f"{i} + 1 =", "answer": str(i + 1)} for i in range(10)]


def make_cfg(model_dir, out_dir="unused", *extra):
    cfg = pacs.parse_args(["--model", model_dir, "--dataset", "synthetic", "--out-dir", str(out_dir),
                           "--group-size", str(G), "--prompts-per-step", str(P), "--num-mini-batches", str(M),
                           "--micro-batch-size", str(MICRO), "--max-new-tokens", "4", "--lr", "1e-2",
                           "--weight-decay", "0", "--eval-every", "0", *extra])
    plumbing.check_config(cfg)
    return cfg


def mixed_rewards(texts, answers):
    """R = 0, 1, 0, 1 in every group: every group is mixed, so every mini-batch has a gradient."""
    return torch.tensor([float(i % 2) for i in range(len(texts))])


def record_rollout_and_losses(monkeypatch, poison=None):
    """Wrap pacs.sample and pacs.algo_loss. Each algo_loss call is stored with its rows (counted in rollout
    order) and its mini-batch; poison(mini_batch, first_row) -> a factor for that call's loss, or None."""
    rec = {"rolls": [], "calls": [], "next_row": 0}
    real_sample, real_loss = pacs.sample, pacs.algo_loss

    def sample(*args, **kwargs):
        roll = real_sample(*args, **kwargs)
        rec["rolls"].append({k: v.clone() for k, v in roll.items()})
        rec["next_row"] = 0
        return roll

    def algo_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages=None):
        first = rec["next_row"]
        rows = range(first, first + logprobs.shape[0])
        rec["next_row"] = rows.stop
        mini = first // ROWS_PER_MINI
        assert (rows.stop - 1) // ROWS_PER_MINI == mini, "a loss call spans two mini-batches"
        if "on_call" in rec:
            rec["on_call"](mini, first)
        loss = real_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages)
        rec["calls"].append({"rows": rows, "mini": mini, "logprobs": logprobs.detach().clone(),
                             "old": old_logprobs.detach().clone(), "mask": mask.detach().clone(),
                             "loss": loss.item()})
        factor = poison(mini, first) if poison else None
        return loss if factor is None else loss * factor

    monkeypatch.setattr(pacs, "sample", sample)
    monkeypatch.setattr(pacs, "algo_loss", algo_loss)
    monkeypatch.setattr(pacs, "reward_fn", conftest.reward_stand_in(mixed_rewards))
    return rec


def masked_logprobs(model, roll, rows, T, temperature):
    """log pi(response) (len(rows), T) of `model` on rollout rows, the padding zeroed."""
    model.eval()
    with torch.no_grad():
        lp, _ = pacs.response_logprobs(model, roll["prompt_ids"][rows], roll["prompt_mask"][rows],
                                       roll["response_ids"][rows], roll["response_mask"][rows], temperature,
                                       group_size=G)
    return lp[:, :T] * roll["response_mask"][rows, :T]


def check_call_matches_rollout(call, roll):
    """The call's mask is the rollout's mask on the rows we think it holds: the row mapping is right."""
    rows, T = call["rows"], call["mask"].shape[1]
    assert torch.equal(call["mask"], roll["response_mask"][rows, :T].to(call["mask"].dtype))
    assert not roll["response_mask"][rows, T:].any()


# ---- 1. the critic is switched on: later mini-batches are scored against pi_old ------------------------
def test_later_mini_batches_score_against_the_weights_from_before_the_first_update(tiny_model_dir, monkeypatch):
    cfg = make_cfg(tiny_model_dir)
    model, tok = plumbing.load_model(tiny_model_dir)
    optimizer = pacs.make_optimizer(cfg, model)
    after_update = []  # the weights after each optimizer step
    optimizer.register_step_post_hook(lambda opt, args, kwargs: after_update.append(copy.deepcopy(model.state_dict())))
    rec = record_rollout_and_losses(monkeypatch)
    pi_old = copy.deepcopy(model)  # the rollout policy: the weights before this step's first update
    torch.manual_seed(0)
    metrics, _ = pacs.train_step(cfg, model, tok, optimizer, PROBLEMS, 0, torch.device("cpu"))

    roll, calls = rec["rolls"][0], rec["calls"]
    assert len(after_update) == M and metrics["skipped"] == 0  # one optimizer step per mini-batch
    assert sum(len(c["rows"]) for c in calls) == P * G and {c["mini"] for c in calls} == set(range(M))
    policy_at = copy.deepcopy(model)
    for c in calls:
        check_call_matches_rollout(c, roll)
        rows, T, mask = c["rows"], c["mask"].shape[1], c["mask"]
        # old_logprobs are pi_old's on every mini-batch, the later ones included (fp32, tight tolerance)
        torch.testing.assert_close(c["old"] * mask, masked_logprobs(pi_old, roll, rows, T, cfg.temperature),
                                   atol=1e-5, rtol=1e-5)
        # logprobs are the current policy's: the weights after the m updates before mini-batch m
        policy_at.load_state_dict(after_update[c["mini"] - 1] if c["mini"] else pi_old.state_dict())
        torch.testing.assert_close(c["logprobs"] * mask, masked_logprobs(policy_at, roll, rows, T, cfg.temperature),
                                   atol=1e-5, rtol=1e-5)
        psi = pacs.pacs_score(c["logprobs"], c["old"], mask, G, cfg.beta, cfg.estimator)
        if c["mini"] == 0:  # on-policy: psi is exactly 0 and the BCE at sigma = 1/2 is log 2
            assert torch.equal(psi, torch.zeros_like(psi))
            assert c["loss"] == pytest.approx(LOG2, abs=1e-6)
        else:  # the policy has moved: the critic sigma(psi) is no longer 1/2
            assert ((c["logprobs"] - c["old"]) * mask).abs().max() > 1e-3
            assert psi.abs().max() > 1e-3, f"psi == 0 on mini-batch {c['mini']}: PACS would be REINFORCE"
            assert abs(c["loss"] - LOG2) > 1e-5
    assert metrics["psi_std"] > 0


# ---- 2. the data order is a function of the seed; every epoch is reshuffled --------------------------
def test_data_order_is_a_seeded_reshuffle_each_epoch():
    n, per_step, epochs = 10, 3, 4  # 3 does not divide 10: steps straddle epoch boundaries

    def order(seed):
        flat = [i for step in range(math.ceil(epochs * n / per_step))
                for i in plumbing.batch_indices(step, n, per_step, seed)]
        return [flat[e * n:(e + 1) * n] for e in range(epochs)]

    a = order(0)
    torch.manual_seed(123)  # the global RNG (which sampling consumes) must not matter
    assert order(0) == a
    for e, perm in enumerate(a):
        assert sorted(perm) == list(range(n)), f"epoch {e} does not cover every problem exactly once"
        if e:
            assert perm != a[e - 1], f"epoch {e} repeats epoch {e - 1}'s order"
    assert a[0] != list(range(n))  # shuffled, not the file order
    b = order(1)
    assert all(x != y for x, y in zip(a, b)), "two seeds give the same order in some epoch"
    assert len({tuple(p) for e in range(epochs) for p in (a[e], b[e])}) == 2 * epochs


def test_train_step_samples_the_prompts_of_batch_indices(tiny_model_dir, monkeypatch):
    cfg = make_cfg(tiny_model_dir, "unused", "--seed", "5")
    model, tok = plumbing.load_model(tiny_model_dir)

    class Sampled(Exception):
        pass

    def sample(model, tokenizer, prompts, *args, **kwargs):
        raise Sampled(prompts)

    monkeypatch.setattr(pacs, "sample", sample)
    for step in (0, 1, 2):  # step 1 straddles the end of the first epoch (6 + 6 > 10 problems)
        with pytest.raises(Sampled) as got:
            pacs.train_step(cfg, model, tok, None, PROBLEMS, step, torch.device("cpu"))
        want = [plumbing.build_prompt(tok, PROBLEMS[i]["problem"])
                for i in plumbing.batch_indices(step, len(PROBLEMS), P, 5)]
        assert got.value.args[0] == want


# ---- 3. a non-finite gradient never reaches the weights ----------------------------------------------
def training_state(model, optimizer):
    """Every parameter and every AdamW tensor (exp_avg, exp_avg_sq, step), cloned."""
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = {(n, k): v.clone() if torch.is_tensor(v) else v
           for n, p in model.named_parameters() for k, v in optimizer.state.get(p, {}).items()}
    return params, opt


def same_state(a, b):
    return a[0].keys() == b[0].keys() and a[1].keys() == b[1].keys() and all(
        torch.equal(a[i][k], b[i][k]) if torch.is_tensor(a[i][k]) else a[i][k] == b[i][k]
        for i in (0, 1) for k in a[i])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_gradient_skips_that_mini_batch_only(tiny_model_dir, monkeypatch, bad):
    cfg = make_cfg(tiny_model_dir)
    model, tok = plumbing.load_model(tiny_model_dir)
    optimizer = pacs.make_optimizer(cfg, model)
    # the first micro-batch of mini-batch 1 gets a non-finite loss, so that mini-batch's gradient is non-finite
    poisoned = {"on": True}
    rec = record_rollout_and_losses(
        monkeypatch, poison=lambda mini, first: bad if poisoned["on"] and first == ROWS_PER_MINI else None)
    at_start = {}  # mini-batch -> training state when its first loss is computed (before its update)
    rec["on_call"] = lambda mini, first: at_start.setdefault(mini, training_state(model, optimizer))
    torch.manual_seed(0)
    metrics, _ = pacs.train_step(cfg, model, tok, optimizer, PROBLEMS, 0, torch.device("cpu"))
    end = training_state(model, optimizer)

    assert metrics["skipped"] == 1
    assert not same_state(at_start[0], at_start[1])  # mini-batch 0 trained
    untouched = same_state(at_start[1], at_start[2])
    assert untouched, "the non-finite mini-batch changed the weights or the AdamW state"
    assert not same_state(at_start[2], end)  # mini-batch 2 trained
    assert all(torch.isfinite(p).all() for p in end[0].values())
    assert all(torch.isfinite(v).all() for v in end[1].values() if torch.is_tensor(v))

    # the next rollout trains as usual
    poisoned["on"] = False
    rec["on_call"] = lambda mini, first: None
    metrics, _ = pacs.train_step(cfg, model, tok, optimizer, PROBLEMS, 1, torch.device("cpu"))
    after = training_state(model, optimizer)
    assert metrics["skipped"] == 0 and math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    assert not same_state(end, after)
    assert all(torch.isfinite(p).all() for p in after[0].values())


# ---- checkpoints: a kill at any point of a save leaves a complete latest checkpoint -------------------
class Killed(BaseException):
    """A kill: BaseException, so no `except Exception` in the code under test can swallow it."""


FS_EVENTS = {"open", "os.rename", "os.remove", "os.rmdir", "shutil.rmtree", "os.mkdir", "shutil.move",
             "shutil.copyfile", "shutil.copytree", "os.truncate", "os.link", "os.symlink"}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
KILL = {"armed": False, "at": -1, "seen": 0, "installed": False}


def _kill_hook(event, args):
    """Audit hook (installed once, inert unless armed): raise Killed at the KILL['at']-th file-system
    change, so a save can be interrupted before any of its writes, renames or deletions."""
    if not KILL["armed"] or event not in FS_EVENTS:
        return
    if event == "open" and not (args[1] is not None and any(c in args[1] for c in "wax+")
                                or args[1] is None and args[2] & WRITE_FLAGS):
        return  # a read
    KILL["seen"] += 1
    if KILL["seen"] - 1 == KILL["at"]:
        KILL["armed"] = False
        raise Killed(event, args)


def file_digests(d):
    return {os.path.relpath(os.path.join(r, f), d): hashlib.sha256(open(os.path.join(r, f), "rb").read()).hexdigest()
            for r, _, fs in os.walk(d) for f in fs}


def check_latest_is_complete(out_dir, previous, previous_digests, model, n_files):
    """The latest checkpoint is the previous one, untouched, or the new one (step 2), complete."""
    latest = plumbing.latest_checkpoint(out_dir)
    assert latest is not None, "no checkpoint left"
    if latest == previous:
        assert file_digests(latest) == previous_digests, "the previous checkpoint was damaged"
        return "previous"
    assert latest.endswith("checkpoint-000002"), latest
    state = torch.load(os.path.join(latest, "trainer_state.pt"), weights_only=False)
    assert state["step"] == 2 and len(file_digests(latest)) == n_files
    from safetensors.torch import load_file
    saved = load_file(os.path.join(latest, "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in model.state_dict().items() if k in saved)
    return "new"


@pytest.fixture
def two_checkpoints(tiny_model_dir, tmp_path):
    """(cfg, model, tokenizer, optimizer, pristine out dir holding checkpoint 1, its digests, files per checkpoint)
    with model/optimizer moved on since checkpoint 1, ready to save checkpoint 2."""
    cfg = make_cfg(tiny_model_dir, tmp_path / "pristine")
    model, tok = plumbing.load_model(tiny_model_dir)
    optimizer = pacs.make_optimizer(cfg, model)
    os.makedirs(cfg.out_dir)
    for step in (1, 2):
        sum(p.sum() for p in model.parameters()).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 1:
            previous = plumbing.save_checkpoint(cfg, model, tok, optimizer, 1)
    return cfg, model, tok, optimizer, previous, file_digests(previous), len(file_digests(previous))


def test_a_kill_at_any_point_of_a_save_leaves_a_complete_latest_checkpoint(two_checkpoints, tmp_path):
    cfg, model, tok, optimizer, previous, digests, n_files = two_checkpoints
    if not KILL["installed"]:
        sys.addaudithook(_kill_hook)  # audit hooks cannot be removed: one per process, inert when disarmed
        KILL["installed"] = True
    outcomes = []
    for k in range(200):
        out = tmp_path / f"kill{k}"
        shutil.copytree(cfg.out_dir, out)
        run_cfg = copy.copy(cfg)
        run_cfg.out_dir = str(out)
        KILL.update(armed=True, at=k, seen=0)
        try:
            plumbing.save_checkpoint(run_cfg, model, tok, optimizer, 2)
            killed = False
        except Killed:
            killed = True
        finally:
            KILL["armed"] = False
        outcomes.append(check_latest_is_complete(str(out), str(out / os.path.basename(previous)), digests, model,
                                                 n_files))
        if not killed:
            break  # the save ran past its last file-system change: every kill point was tried
        shutil.rmtree(out)
    assert not killed and outcomes[-1] == "new"
    assert len(outcomes) > 5 and "previous" in outcomes  # the kills really landed inside the save


def test_a_torn_trainer_state_write_leaves_the_previous_checkpoint_latest(two_checkpoints, monkeypatch):
    """A kill in the middle of writing a file: it is left half-written, wherever the save put it."""
    cfg, model, tok, optimizer, previous, digests, n_files = two_checkpoints
    real_save = torch.save

    def torn_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        size = os.path.getsize(f)
        with open(f, "r+b") as fh:
            fh.truncate(size // 2)
        raise Killed(f)

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(Killed):
        plumbing.save_checkpoint(cfg, model, tok, optimizer, 2)
    monkeypatch.setattr(torch, "save", real_save)
    assert check_latest_is_complete(cfg.out_dir, previous, digests, model, n_files) == "previous"
