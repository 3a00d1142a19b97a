"""Every committed summary.json and scan.json of a lab that ships its base regenerates from the committed result
files beside it, every number: stability.summary_json (what trend.py --summary-json writes, without its figures)
and lab_summary.lab_scan recompute them, and `differences` compares them number by number, a p-value included (its
3 significant digits are all it keeps, so a relative tolerance, not an absolute one, reads it). The first sweep's
archive, written by older code, is compared in tests/test_trend.py."""
import glob
import json
import math
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
import lab_summary  # noqa: E402
import stability  # noqa: E402

LABS_DIR = os.path.join(ROOT, "experiments", "labs")
LABS = sorted(os.path.dirname(p) for p in glob.glob(os.path.join(LABS_DIR, "*", "summary.json"))
              if os.path.isfile(os.path.join(os.path.dirname(p), "base", "lab.json")))  # experiments/labs/lab, lab2
SCANS = sorted(p for lab in LABS for p in glob.glob(os.path.join(lab, "scan*.json")))  # scan.json, scan-p4.json


def differences(a, b, path="", rel=1e-9):
    """Every place two JSON trees differ: a key or item on one side only, a string, bool or None that is not the
    same, or a number off by more than `rel` of its size (1e-12 absolute near 0). [] when they agree."""
    if isinstance(a, dict) and isinstance(b, dict):
        return ([f"{path}/{k}: only on one side" for k in sorted(set(a) ^ set(b))]
                + [d for k in sorted(set(a) & set(b)) for d in differences(a[k], b[k], f"{path}/{k}", rel)])
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items against {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]", rel)]
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    if number(a) and number(b):
        return [] if math.isclose(a, b, rel_tol=rel, abs_tol=1e-12) else [f"{path}: {a!r} against {b!r}"]
    return [] if (a == b and type(a) is type(b)) else [f"{path}: {a!r} against {b!r}"]


def regenerate(lab_docs):
    """A lab's summary.json recomputed from lab_docs/results/ and lab_docs/base/, with the settings it states."""
    with open(os.path.join(lab_docs, "summary.json")) as f:
        settings = json.load(f)["settings"]
    return stability.summary_json(os.path.join(lab_docs, "results"), os.path.join(lab_docs, "base"),
                                  prompts=settings["prompts"], last=settings["final_mean_of_last_steps"])


def test_differences_reads_every_number_at_its_own_size():
    assert differences({"p_t": 0.0044, "x": [1, 0.5]}, {"p_t": 0.0044, "x": [1, 0.5]}) == []
    assert differences({"p_t": 0.0022}, {"p_t": 0.0044}) == ["/p_t: 0.0022 against 0.0044"]  # a p halved
    assert differences({"p_t": 1e-5}, {"p_t": 2e-5}) == ["/p_t: 1e-05 against 2e-05"]  # an absolute 1e-4 passes this
    assert differences({"m": 0.31234}, {"m": 0.31235}) == ["/m: 0.31234 against 0.31235"]  # the 5th decimal
    assert differences({"a": 1, "b": 2}, {"a": 1}) == ["/b: only on one side"]
    assert differences([1, 2], [1, 2, 3]) == [": 2 items against 3"]
    assert differences({"f": True}, {"f": 1}) == ["/f: True against 1"] and differences(None, 0.0) == [
        ": None against 0.0"]
    assert differences({"n": 3}, {"n": 3.0}) == [] and differences({"s": "pacs"}, {"s": "grpo"}) == [
        "/s: 'pacs' against 'grpo'"]


def test_there_are_summaries_and_scans_to_regenerate():
    assert {os.path.basename(d) for d in LABS} >= {"lab", "lab2"}
    assert {os.path.relpath(p, LABS_DIR) for p in SCANS} >= {"lab/scan.json", "lab/scan-p4.json", "lab2/scan.json"}


@pytest.mark.parametrize("lab_docs", LABS, ids=[os.path.basename(d) for d in LABS])
def test_every_committed_summary_regenerates_from_its_result_files(lab_docs):
    with open(os.path.join(lab_docs, "summary.json")) as f:
        committed = json.load(f)
    diff = differences(regenerate(lab_docs), committed)
    assert diff == [], (f"{os.path.relpath(lab_docs, ROOT)}/summary.json is not what its result files give "
                        f"({len(diff)} differences: rewrite it with trend.py --summary-json; an entry only in the "
                        f"committed file is one stability.summary_json does not compute: add it there): {diff[:8]}")


@pytest.mark.parametrize("path", SCANS, ids=[os.path.relpath(p, LABS_DIR) for p in SCANS])
def test_every_committed_scan_regenerates_from_its_result_files(path):
    name = os.path.basename(path)  # scan.json: the sweep's 32 prompts a step; scan-p<N>.json: N
    prompts = int(name[len("scan-p"):-len(".json")]) if name.startswith("scan-p") else 32
    with open(path) as f:
        committed = json.load(f)
    again = json.loads(json.dumps(lab_summary.lab_scan(os.path.join(os.path.dirname(path), "results"), prompts)))
    assert differences(again, committed) == []


@pytest.fixture(scope="module")
def lab_copy(tmp_path_factory):
    """The first lab's sweep, scan, base lab.json and model config copied, with the summary.json they give."""
    src, dst = os.path.join(LABS_DIR, "lab"), tmp_path_factory.mktemp("regen") / "lab"
    for sub in ("results/test-p32", "results/val-p32-lr5e-05", "results/val-p32-lr0.0001", "results/val-p32-lr0.0002"):
        shutil.copytree(os.path.join(src, sub), dst / sub)
    os.makedirs(dst / "base" / "model")
    shutil.copy(os.path.join(src, "base", "lab.json"), dst / "base" / "lab.json")
    shutil.copy(os.path.join(src, "base", "model", "config.json"), dst / "base" / "model" / "config.json")
    summary = stability.summary_json(str(dst / "results"), str(dst / "base"), prompts=32, last=10)
    (dst / "summary.json").write_text(json.dumps(summary, indent=1))
    return dst


def test_a_summary_regenerates_until_a_result_file_changes(lab_copy):
    """The comparison is sharp: a copy regenerates exactly, and one step's gradient norm changed in one result file
    shows in that run's spike and in the paired entries that use it, nowhere else."""
    assert differences(regenerate(str(lab_copy)), json.loads((lab_copy / "summary.json").read_text())) == []
    path = lab_copy / "results" / "test-p32" / "ppo-s3.json"
    result = json.loads(path.read_text())
    result["metrics"]["grad_norm"][70] = 3 * max(result["metrics"]["grad_norm"])
    path.write_text(json.dumps(result))
    diff = differences(regenerate(str(lab_copy)), json.loads((lab_copy / "summary.json").read_text()))
    spike = next(i for i, r in enumerate(json.loads((lab_copy / "summary.json").read_text())["stability"]["runs"])
                 if (r["method"], r["seed"]) == ("ppo", 3))
    assert f"/stability/runs[{spike}]/grad_spike" in {d.split(":")[0] for d in diff}
    assert all(d.startswith("/stability/") and ("grad_spike" in d or "/paired[" in d or "/claim/" in d) for d in diff)


def test_a_p_value_halved_in_the_paired_entries_is_caught(monkeypatch):
    """The bug the suite once let through: p / 2 in the p_t every paired entry writes."""
    runs = os.path.join(LABS_DIR, "lab", "results")
    honest = lab_summary.lab_summary(runs, prompts=32, last=10)
    paired_p = lab_summary.paired_p
    monkeypatch.setattr(lab_summary, "paired_p", lambda d: paired_p(d) / 2)
    diff = differences(lab_summary.lab_summary(runs, prompts=32, last=10), honest)
    assert diff and all(d.split(":")[0].endswith("/p_t") for d in diff)


def test_a_summary_takes_methods_that_land_beside_the_sweep(tmp_path):
    """New arms land in test-p32/ and val-p32-lr*/ while a sweep runs (another method's test runs with no scan entry,
    a method scanned at one lr only): the summary takes them as they are, each in runs and settings, its lr cliff
    None where the grid lacks the lr, and the claims over bases and their tests keep to their own methods."""
    src, dst = os.path.join(LABS_DIR, "lab"), tmp_path / "lab"
    shutil.copytree(os.path.join(src, "results", "val-p32-lr0.0001"), dst / "results" / "val-p32-lr0.0001")
    os.makedirs(dst / "results" / "test-p32")
    for m in ("pacs", "grpo", "ppo", "pacs-critic-off"):
        for s in (0, 1, 2):
            shutil.copy(os.path.join(src, "results", "test-p32", f"{m}-s{s}.json"), dst / "results" / "test-p32")
    for s in (0, 1):  # a new arm's test runs, no scan entry for it
        result = json.loads((dst / "results" / "test-p32" / f"pacs-s{s}.json").read_text())
        (dst / "results" / "test-p32" / f"pacs-new-arm-s{s}.json").write_text(json.dumps({**result, "method":
                                                                                            "pacs-new-arm"}))
    scanned = json.loads((dst / "results" / "val-p32-lr0.0001" / "pacs-s1000.json").read_text())
    (dst / "results" / "val-p32-lr0.0001" / "pacs-scan-only-s1000.json").write_text(json.dumps(
        {**scanned, "method": "pacs-scan-only"}))
    os.makedirs(dst / "base" / "model")
    shutil.copy(os.path.join(src, "base", "lab.json"), dst / "base" / "lab.json")
    shutil.copy(os.path.join(src, "base", "model", "config.json"), dst / "base" / "model" / "config.json")
    summary = stability.summary_json(str(dst / "results"), str(dst / "base"), prompts=32, last=10)
    assert summary["settings"]["seeds"]["pacs-new-arm"] == [0, 1] and "pacs-new-arm" in summary["settings"]["lr"]
    assert {r["method"] for r in summary["runs"]} == {"pacs", "grpo", "ppo", "pacs-critic-off", "pacs-new-arm"}
    lr = summary["stability"]["lr"]["methods"]["pacs-scan-only"]
    assert lr["chosen"] == 0.0001 and lr["loss_2x"] is None and lr["loss_half"] is None
    assert {p["b"] for p in summary["paired"]} <= {"pacs-critic-off", "grpo", "ppo", "reinforce"}
    assert lab_summary.lab_scan(str(dst / "results"), 32)["choice"]["pacs-scan-only"] == 0.0001


def test_the_lora_scan_and_its_answer_regenerate_from_their_result_files():
    import lora_scan
    with open(os.path.join(LABS_DIR, "lab", "lora.json")) as f:
        committed = json.load(f)
    again = json.loads(json.dumps(lora_scan.summary()))
    assert set(committed["arms"]) == {"pacs-lora-r1", "pacs-lora-r16"}
    diff = differences(again, committed)
    assert diff == [], f"experiments/labs/lab/lora.json: rewrite it with python experiments/lora_scan.py: {diff[:8]}"
    with open(lora_scan.DOCS, encoding="utf-8") as f:
        text = f.read()
    shown = text[text.index(lora_scan.BEGIN) + len(lora_scan.BEGIN):text.index(lora_scan.END)].strip()
    assert shown == lora_scan.table(committed), "docs/lora.md's tables are stale: python experiments/lora_scan.py"
