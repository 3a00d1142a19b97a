"""experiments/critic_probe.py: what sigma(psi) reads (the reliability diagram's explanation in
experiments/labs/lab)."""
import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "experiments"))
import critic_probe  # noqa: E402


def test_centred_subtracts_each_groups_mean():
    x = torch.tensor([1.0, 3.0, 10.0, 20.0])
    assert critic_probe.centred(x, 2).tolist() == [-1.0, 1.0, -5.0, 5.0]


def test_report_bins_sigma_and_counts_each_bin():
    psi = np.array([-1.0, -1.0, 0.0, 0.0, 0.0, 1.0])  # sigma 0.27, 0.27, 0.5 x 3, 0.73
    reward = np.array([0.0, 1.0, 1.0, 1.0, 0.0, 0.0])
    text = critic_probe.report(psi, reward, np.full(6, 18.0), np.array([-1.0, -1.0, 1.0, 1.0, 1.0, -1.0]))
    lines = text.splitlines()
    assert lines[0].startswith("6 responses") and "success rate 0.500" in lines[0]
    assert lines[3:] == ["[0.00, 0.45) | 2 | 0.500 | 18.0 | -1.00", "[0.49, 0.51) | 3 | 0.667 | 18.0 | +1.00",
                         "[0.55, 1.00) | 1 | 0.000 | 18.0 | -1.00"]
    assert f"corr(|psi|, centred log pi_old) {-1.0:+.3f}" in lines[1]


def test_probe_runs_pacs_on_the_shipped_base():
    psi, reward, length, old = critic_probe.probe(critic_probe.lab.SHIPPED, steps=1, beta=1.0, lr=1e-4, seed=0)
    assert len(psi) == 3 * 64  # mini-batches 1..3 of 32 prompts x 8
    assert set(np.unique(reward)) <= {0.0, 1.0} and (length >= 1).all() and (length <= 32).all()
    assert abs(psi.reshape(-1, 8).sum(1)).max() < 1e-4 and abs(old.reshape(-1, 8).sum(1)).max() < 1e-3  # centred
    assert np.abs(psi).max() > 0  # the updates on the other mini-batches moved the later ones


def test_bad_flags_give_one_line(capsys, tmp_path):
    for argv, message in ((["--steps", "0"], "--steps 0"), (["--lab", str(tmp_path)], "no lab.json")):
        with pytest.raises(SystemExit):
            critic_probe.main(argv)
        assert message in capsys.readouterr().err
