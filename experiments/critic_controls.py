"""What the implicit critic does: PACS with sigma(psi) replaced, in the gradient, by a permutation of itself.

PACS's advantage (the derivation above pacs.pacs_score) is A_k = y_k - mean_group(y), y_k = w_k (R_k - sigma(psi_k)).
sigma(psi_k) does two things at once: it carries what psi knows of R (how it ranks a group's right responses above
its wrong ones), and it is tied to response k's own probability move (psi_k is beta times k's log-ratio, centred in
its group), so a response the earlier mini-batches already moved towards gets less push (the self-damping). Two
permutations of the detached sigma(psi) values, inside each group, separate the two:

    class-shuffled   permute sigma(psi) among the group's right responses and, apart, among its wrong ones: each
                     class keeps its multiset of values, so the substitute ranks exactly as sigma(psi) does (the
                     same AUC), but a response no longer gets its own value: the ranking stays, the tie goes
    group-shuffled   permute sigma(psi) among all of the group's responses, whatever R: neither the ranking nor the
                     tie survives; the values, and so the size of the perturbation off 1/2, do

so that, paired by seed, PACS - class-shuffled is the self-damping, class-shuffled - group-shuffled the ranking, and
group-shuffled - critic-off the noise of the values themselves (experiments/results.md, "What the critic does").

The substitute p enters the loss the way pacs.pacs_loss(implicit_critic=False) puts 1/2 there: a loss whose gradient
in psi is the BCE's at sigma(psi) = p,
    L = BCE(0, R; w) + (1/B) sum_k w_k (p_k - R_k) psi_k     =>  dL/dpsi_k = w_k (p_k - R_k) / B
    =>  -dL/dlogprobs[k,t] = beta G/(B(G-1)) (y_k - mean_group(y)) mask[k,t],  y_k = w_k (R_k - p_k)
p = 1/2 is critic-off bit for bit; p = sigma(psi) is PACS's gradient. The permutation is drawn from a generator
seeded by (run seed, rollout step, call within the step): a resumed run draws what an uninterrupted one would.

pacs.py is unchanged: this script is pacs.py with one more flag, the sweep's methods pacs-critic-class-shuffled and
pacs-critic-group-shuffled (experiments/sweep.py) run it:
    python experiments/critic_controls.py --critic-control class-shuffled [any pacs.py flag ...]
"""
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import pacs  # noqa: E402
import plumbing  # noqa: E402

CONTROLS = ("class-shuffled", "group-shuffled")
SETTINGS_FILE = "critic_control.json"  # in the run dir: a resume with another control is refused


def pacs_loss_given_prediction(logprobs, old_logprobs, mask, rewards, group_size, prediction, beta=1.0,
                               estimator="rloo", balance=True):
    """PACS's loss (scalar) with `prediction` p (B,) in place of sigma(psi) in the gradient (p is detached).

    logprobs, old_logprobs, mask (B, T); rewards (B,) in {0, 1}; the rest as pacs.pacs_loss. The loss's value is
    BCE(0, R; w) plus a term that is 0 at psi = 0, as pacs_loss(implicit_critic=False) writes it."""
    psi = pacs.pacs_score(logprobs, old_logprobs, mask, group_size, beta, estimator)  # (B,)
    labels = rewards.to(psi.dtype)  # (B,)
    p = prediction.detach().to(psi.dtype)  # (B,)
    if p.shape != psi.shape:
        raise ValueError(f"prediction has shape {tuple(prediction.shape)}, expected ({psi.shape[0]},)")
    weight = pacs.class_balance_weights(labels, group_size).to(psi.dtype) if balance else None
    # dL/dpsi_k = w_k (p_k - R_k) / B: the BCE's w_k (sigma(psi_k) - R_k) / B with p_k for sigma(psi_k)
    c = (p - labels) / psi.shape[0] if weight is None else weight / psi.shape[0] * (p - labels)  # (B,)
    return F.binary_cross_entropy_with_logits(torch.zeros_like(psi), labels, weight=weight) + (c * psi).sum()


def class_shuffled(values, rewards, group_size, generator):
    """values (B,) permuted inside each group among the right responses and, apart, among the wrong ones."""
    out = values.clone()
    right = rewards.view(-1) > 0.5  # (B,)
    for start in range(0, values.shape[0], group_size):
        rows = torch.arange(start, start + group_size)
        for cls in (True, False):
            idx = rows[right[rows] == cls]
            out[idx] = values[idx[torch.randperm(len(idx), generator=generator)]]
    return out


def group_shuffled(values, rewards, group_size, generator):
    """values (B,) permuted inside each group, whatever R (rewards unused: the same signature as class_shuffled)."""
    out = values.clone()
    for start in range(0, values.shape[0], group_size):
        out[start:start + group_size] = values[start + torch.randperm(group_size, generator=generator)]
    return out


SHUFFLES = {"class-shuffled": class_shuffled, "group-shuffled": group_shuffled}


def step_generator(seed, step, call):
    """The permutation's generator for the `call`-th loss of rollout `step` of a run seeded `seed`."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + call)


# ---- pacs.py with the control in place of its PACS loss ----------------------------------------------------------
_state = {"control": None, "step": 0, "call": 0}


def control_algo_loss(cfg, logprobs, old_logprobs, mask, rewards, advantages=None):
    """pacs.algo_loss for --algo pacs under a control: sigma(psi) of these rows, detached and permuted in each group,
    in the gradient in place of sigma(psi)."""
    G = cfg.group_size
    psi = pacs.pacs_score(logprobs.detach(), old_logprobs, mask, G, cfg.beta, cfg.estimator)  # (b,)
    generator = step_generator(cfg.seed, _state["step"], _state["call"])
    _state["call"] += 1
    p = SHUFFLES[_state["control"]](torch.sigmoid(psi), rewards, G, generator)  # (b,)
    return pacs_loss_given_prediction(logprobs, old_logprobs, mask, rewards, G, p, cfg.beta, cfg.estimator,
                                      cfg.balance)


def _train_step(cfg, model, tokenizer, optimizer, problems, step, *args, **kwargs):
    _state["step"], _state["call"] = step, 0
    return ORIGINAL["train_step"](cfg, model, tokenizer, optimizer, problems, step, *args, **kwargs)


ORIGINAL = {"train_step": pacs.train_step, "algo_loss": pacs.algo_loss}


def check_control(control, out_dir, resume):
    """The run dir records its control; a resume into a run made with another control (or none) is refused."""
    path = os.path.join(out_dir, SETTINGS_FILE)
    if resume and os.path.isfile(path):
        with open(path) as f:
            made = json.load(f)["critic_control"]
        if made != control:
            raise plumbing.ConfigError(f"{out_dir} holds a run made with --critic-control {made}, not {control}")
    elif resume and plumbing.latest_checkpoint(out_dir) is not None:
        raise plumbing.ConfigError(f"{out_dir} holds a run made without --critic-control; use another --out-dir")
    os.makedirs(out_dir, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"critic_control": control}, f)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = f"critic_controls.py: error: --critic-control {{{','.join(CONTROLS)}}} is required, then pacs.py's flags"
    if "--critic-control" not in argv or argv.index("--critic-control") + 1 >= len(argv):
        sys.exit(usage)
    i = argv.index("--critic-control")
    control = argv[i + 1]
    if control not in CONTROLS:
        sys.exit(f"critic_controls.py: error: --critic-control {control!r}: use one of {', '.join(CONTROLS)}")
    rest = argv[:i] + argv[i + 2:]
    cfg = pacs.parse_args(rest)
    if cfg.algo != "pacs" or not cfg.implicit_critic:
        sys.exit("critic_controls.py: error: a critic control replaces PACS's sigma(psi): it needs --algo pacs "
                 "with the implicit critic on")
    try:
        check_control(control, cfg.out_dir, cfg.resume)
    except plumbing.ConfigError as e:
        sys.exit(f"critic_controls.py: error: {e}")
    _state["control"] = control
    pacs.algo_loss, pacs.train_step = control_algo_loss, _train_step
    try:
        pacs.main(rest)
    finally:
        pacs.algo_loss, pacs.train_step = ORIGINAL["algo_loss"], ORIGINAL["train_step"]
        _state["control"] = None


if __name__ == "__main__":
    main()
