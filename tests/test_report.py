"""--report-to and curves.png: what pacs.py and eval.py write to TensorBoard, Trackio and W&B (offline), read back
with each tracker's own reader and compared with metrics.jsonl; a killed run resumed continues the same run at the
right step; a tracker that fails warns once and the run goes on; logging never changes the logged steps; the curves
are drawn beside the training, from metrics.jsonl. A tracker's tests skip, naming the package, where it is absent."""
import importlib.util
import json
import os
import subprocess
import sys
import threading

import pytest

import eval as ev
import pacs
import plumbing

TIMING_KEYS = {"time_generate", "time_verify", "time_old_logprobs", "time_update", "time_eval", "time_save",
               "step_time", "samples_per_s"}
INSTALLED = [t for t in plumbing.TRACKERS if importlib.util.find_spec(t)]


def needs(tracker):
    return pytest.mark.skipif(tracker not in INSTALLED, reason=f"{tracker} is not installed (pip install {tracker})")


def train(model, dataset, out_dir, *extra):
    pacs.main(["--model", model, "--dataset", dataset, "--out-dir", str(out_dir), "--group-size", "8",
               "--prompts-per-step", "8", "--num-mini-batches", "2", "--micro-batch-size", "16",
               "--max-new-tokens", "1", "--lr", "1e-2", "--eval-every", "0", "--log-samples-every", "1", *extra])
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def drawings_done():
    """Wait for the threads drawing curves.png: train() returns without waiting for its last."""
    for thread in threading.enumerate():
        if thread.name == "pacs-curves":
            thread.join()


def untimed(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def scalars_of(row):
    return {k: v for k, v in row.items() if k != "step" and isinstance(v, (int, float))}


@pytest.fixture(scope="module")
def watched(digit_model, const7_file, tmp_path_factory):
    """A run logged to every installed tracker, completions every second step, killed while saving step 3 (steps
    0-3 logged, step 1 the last checkpoint), then resumed to its end; and the same run uninterrupted, logged
    nowhere."""
    tmp = tmp_path_factory.mktemp("watched")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        for name in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR"):  # W&B's staging: not the home's
            mp.setenv(name, str(tmp / name.lower()))
        mp.setenv("TRACKIO_DIR", str(tmp / "trackio"))
        if "trackio" in INSTALLED:
            import trackio.sqlite_storage
            mp.setattr(trackio.sqlite_storage, "TRACKIO_DIR", tmp / "trackio")
        save = plumbing.save_checkpoint

        def killed_at_step_3(cfg, model, tokenizer, optimizer, step, *args):
            if step == 3:
                raise KeyboardInterrupt("killed")
            return save(cfg, model, tokenizer, optimizer, step, *args)
        mp.setattr(plumbing, "save_checkpoint", killed_at_step_3)
        args = ["--steps", "4", "--save-every", "2", "--log-samples-every", "2", "--report-to", "all"]
        with pytest.raises(KeyboardInterrupt):
            train(digit_model, const7_file, tmp / "run", *args)
        drawings_done()
        with open(tmp / "run" / "metrics.jsonl") as f:
            killed = [json.loads(line) for line in f]
        mp.setattr(plumbing, "save_checkpoint", save)
        rows = train(digit_model, const7_file, tmp / "run", *args, "--resume")
    plain = train(digit_model, const7_file, tmp / "plain", "--steps", "4", "--save-every", "2",
                  "--log-samples-every", "2")
    drawings_done()
    return {"dir": tmp / "run", "rows": rows, "killed": killed, "plain": plain, "trackio_dir": tmp / "trackio"}


def test_logging_never_changes_the_logged_steps(watched):
    assert [r["step"] for r in watched["killed"]] == [0, 1, 2, 3]  # the kill came after step 3 was logged
    assert [r["step"] for r in watched["rows"]] == [0, 1, 2, 3]
    assert untimed(watched["rows"]) == untimed(watched["plain"])


def tensorboard_events(log_dir):
    """{tag: [(step, value)]} of a TensorBoard log dir, read by the accumulator TensorBoard's server reads with:
    scalars as numbers, text as str; what a restarted writer purged (purge_step) is left out, as it shows it."""
    from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    value = lambda e: tensor_util.make_ndarray(e.tensor_proto).item()
    return {tag: [(e.step, value(e).decode() if isinstance(value(e), bytes) else value(e)) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"]}


@needs("tensorboard")
def test_tensorboard_scalars_are_metrics_jsonl_once_per_step_after_a_resume(watched):
    import numpy as np
    events, rows = tensorboard_events(watched["dir"] / "tensorboard"), watched["rows"]
    keys = {k for r in rows for k in scalars_of(r)}
    assert set(events) == keys | {"samples/text_summary", "config/text_summary"}
    for key in keys:  # float32, as TensorBoard stores them; the killed run's steps 2 and 3 purged, not repeated
        want = [(r["step"], float(np.float32(r[key]))) for r in rows if key in scalars_of(r)]
        assert events[key] == want, key
    samples = events["samples/text_summary"]
    assert [step for step, _ in samples] == [0, 2]
    with open(watched["dir"] / "samples.jsonl") as f:
        first = json.loads(f.readline())
    assert samples[0][1].startswith("| step | problem | answer | response | reward |")
    assert f"| 0 | {first['problem']} | {first['answer']} |" in samples[0][1]
    ((step, config),) = events["config/text_summary"]  # once, when the run started
    assert step == 0 and json.loads(config)["report_to"] == ["all"]


def wandb_records(run_dir):
    """The records of an offline W&B run, read by W&B's own reader (`wandb leet inspect --json`)."""
    wandb = os.path.join(os.path.dirname(sys.executable), "wandb")
    out = subprocess.run([wandb, "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@needs("wandb")
def test_wandb_offline_records_hold_every_step_and_the_resume_continues_the_same_run(watched):
    run_dirs = sorted((watched["dir"] / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2  # the killed run and its resumption
    with open(watched["dir"] / "trackers.json") as f:
        run_id = json.load(f)["wandb"]
    with open(watched["dir"] / "samples.jsonl") as f:
        samples = [json.loads(line) for line in f]
    logged = {}  # step -> the scalars last logged at it
    for i, run_dir in enumerate(run_dirs):
        records = wandb_records(run_dir)
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert run["run_id"] == run_id
        assert ("report_to" in run["config"]["update"]) == (i == 0)  # the config once, at the run's start
        history = [r["history"] for r in records if r["type"] == "history"]
        assert [h["step"].get("num", 0) for h in history] == ([0, 1, 2, 3] if i == 0 else [2, 3])
        for h in history:
            step = h["step"].get("num", 0)
            assert ("samples._type" in h["item"]) == (step % 2 == 0), step  # --log-samples-every 2
            if step % 2:
                logged[step] = {k: v for k, v in h["item"].items() if not k.startswith("_")}
                continue
            assert h["item"]["samples._type"] == "table-file"
            with open(run_dir / "files" / h["item"]["samples.path"]) as f:
                table = json.load(f)
            assert table["columns"] == ["step", "problem", "answer", "response", "reward"]
            logged_samples = [[step, s["problem"], s["answer"]] for s in samples if s["step"] == step]
            assert [row[:3] for row in table["data"]] == logged_samples[-4:]  # samples.jsonl appends a redone step
            logged[step] = {k: v for k, v in h["item"].items() if not k.startswith(("_", "samples."))}
    assert logged == {r["step"]: pytest.approx(scalars_of(r), rel=1e-12) for r in watched["rows"]}


@needs("trackio")
def test_trackio_local_logs_hold_every_step_and_the_resume_continues_the_same_run(watched, monkeypatch):
    import trackio.sqlite_storage
    from trackio.sqlite_storage import SQLiteStorage
    # read where the fixture's runs wrote: its patch of TRACKIO_DIR ended with it, and where trackio was imported
    # before the fixture (another test), the module's own value is the home's directory, not the fixture's
    monkeypatch.setattr(trackio.sqlite_storage, "TRACKIO_DIR", watched["trackio_dir"])
    with open(watched["dir"] / "trackers.json") as f:
        name = json.load(f)["trackio"]
    assert SQLiteStorage.get_runs("pacs") == [name]  # one run, continued by the resumed one
    logs = SQLiteStorage.get_logs("pacs", name)
    scalars = [r for r in logs if "reward" in r]
    # the killed run's steps 2 and 3 stay in Trackio's log, the resumed run's follow them
    assert [r["step"] for r in scalars] == [0, 1, 2, 3, 2, 3]
    last = {r["step"]: {k: v for k, v in r.items() if k not in ("step", "timestamp", "samples")} for r in scalars}
    assert last == {r["step"]: pytest.approx(scalars_of(r)) for r in watched["rows"]}
    tables = [r for r in logs if "samples" in r]
    assert [r["step"] for r in tables] == [0, 2, 2]  # --log-samples-every 2; step 2 redone after the kill
    assert all(r["samples"]["_type"] == "trackio.table" for r in tables)
    assert SQLiteStorage.get_run_config("pacs", name)["report_to"] == ["all"]


def test_curves_png_is_drawn_from_metrics_jsonl(watched):
    path = watched["dir"] / "curves.png"
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    fig = plumbing.draw_curves(str(watched["dir"]))
    titles = [ax.get_title() for ax in fig.axes]
    assert titles[:8] == [title for title, _ in plumbing.CURVES] + ["step time by phase (s)"]
    reward = fig.axes[0].lines[0]
    assert list(reward.get_xdata()) == [0, 1, 2, 3]
    assert list(reward.get_ydata()) == [r["reward"] for r in watched["rows"]]
    assert fig.axes[6].texts[0].get_text() == "not logged by this run"  # no --eval-every
    phases = [t.get_text() for t in fig.axes[7].get_legend().get_texts()]
    assert phases == ["generate", "verify", "old logprobs", "update"]


def test_curves_split_the_step_time_by_every_phase_logged(tmp_path):
    rows = [{"step": s, "reward": 0.5, "time_generate": 3.0, "time_verify": 0.1, "time_old_logprobs": 1.0,
             "time_update": 2.0, **({"time_eval": 4.0, "eval_acc": 0.25} if s % 2 == 0 else {}),
             **({"time_save": 1.5} if s == 2 else {})} for s in range(60)]
    partial = '{"step": 60, "reward": 0.'  # the row the loop is writing while the thread reads
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + partial)
    fig = plumbing.draw_curves(str(tmp_path))
    assert list(fig.axes[0].lines[0].get_xdata()) == list(range(60))
    phases = [t.get_text() for t in fig.axes[7].get_legend().get_texts()]
    assert phases == ["generate", "verify", "old logprobs", "update", "eval", "save"]
    top = fig.axes[7].collections[-1].get_paths()[0].vertices[:, 1].max()
    assert top == pytest.approx(3.0 + 0.1 + 1.0 + 2.0 + 4.0 + 1.5)  # the stack's top: step 2, every phase
    acc = fig.axes[6].lines[0]
    assert list(acc.get_xdata()) == list(range(0, 60, 2))  # held-out accuracy where it was measured only
    assert fig.axes[0].get_legend().get_texts()[0].get_text() == "running mean of 3"  # 60 points
    assert fig.axes[6].get_legend() is None  # 30 points: drawn as they are


def test_curves_are_drawn_beside_the_step_one_drawing_at_a_time(tmp_path, monkeypatch):
    drawings_done()
    started, release, drawn = threading.Event(), threading.Event(), []

    def slow_draw(out_dir):
        started.set()
        release.wait(10)
        drawn.append(out_dir)
    monkeypatch.setattr(plumbing, "draw_curves", slow_draw)
    first = plumbing.redraw_curves("a")
    assert started.wait(10) and first.is_alive()  # returned while drawing: the step goes on
    assert plumbing.redraw_curves("b", first) is first  # a checkpoint during a drawing skips its own
    last = plumbing.redraw_curves("c", first, last=True)  # the run's last: queued after it, not waited for
    assert last is not first and last.is_alive() and not last.daemon  # the process exits once it is drawn
    release.set()
    last.join(10)
    assert not first.is_alive() and not last.is_alive() and drawn == ["a", "c"]


def test_a_failing_figure_warns_and_the_run_goes_on(digit_model, const7_file, tmp_path, monkeypatch, capsys):
    drawings_done()
    monkeypatch.setattr(plumbing, "draw_curves", lambda out_dir: (_ for _ in ()).throw(OSError("No space left")))
    rows = train(digit_model, const7_file, tmp_path, "--steps", "2", "--save-every", "1")
    drawings_done()
    assert [r["step"] for r in rows] == [0, 1]
    assert capsys.readouterr().err.count("curves.png not drawn (OSError: No space left)") == 2


def test_a_tracker_failing_mid_run_warns_once_and_the_run_goes_on(digit_model, const7_file, tmp_path,
                                                                  monkeypatch, capsys):
    logged = []

    def broken(out_dir, name, config, start, ids):
        def log(scalars, step, samples):
            if step == 1:
                raise OSError("No space left on device")
            logged.append(step)
        return log, lambda: logged.append("closed")
    monkeypatch.setitem(plumbing.OPEN_TRACKER, "tensorboard", broken)
    monkeypatch.setattr(plumbing, "report_targets", lambda names: ["tensorboard"] if names else [])
    rows = train(digit_model, const7_file, tmp_path, "--steps", "3", "--report-to", "tensorboard")
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert logged == [0]  # dropped at its failure: never called again, not even to close
    err = capsys.readouterr().err
    assert err.count("[report] tensorboard failed (OSError: No space left on device)") == 1


def test_asking_for_a_tracker_not_installed_or_unknown_is_a_one_line_error(tiny_model_dir, monkeypatch):
    real = importlib.util.find_spec  # wandb missing, tensorboard there (installed or not here): the missing one named
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else
                        real("json") if name == "tensorboard" else real(name, *a))
    argv = ["--model", tiny_model_dir, "--dataset", "synthetic", "--device", "cpu", "--report-to"]
    with pytest.raises(SystemExit) as e:
        pacs.main(argv + ["tensorboard,wandb"])
    assert str(e.value) == "pacs.py: error: --report-to wandb: the package is not installed: pip install wandb"
    with pytest.raises(SystemExit) as e:
        pacs.main(argv + ["mlflow"])
    assert str(e.value) == ("pacs.py: error: --report-to 'mlflow': use none, all, or some of tensorboard, trackio, "
                            "wandb")
    with pytest.raises(SystemExit) as e:
        ev.main(["--model", tiny_model_dir, "--datasets", "synthetic", "--report-to", "wandb"])
    assert str(e.value) == "eval.py: error: --report-to wandb: the package is not installed: pip install wandb"
    assert plumbing.report_targets(["none"]) == plumbing.report_targets(None) == []
    assert plumbing.report_targets(["all"]) == [t for t in plumbing.TRACKERS if t == "tensorboard" or t in INSTALLED
                                            and t != "wandb"]


@needs("tensorboard")
def test_eval_reports_its_summary(tiny_model_dir, tiny_problems_file, tmp_path):
    import numpy as np
    ev.main(["--model", tiny_model_dir, "--datasets", tiny_problems_file, "--n", "2", "--k", "1,2",
             "--max-new-tokens", "6", "--temperature", "1.0", "--batch-size", "4", "--out", str(tmp_path),
             "--report-to", "tensorboard"])
    m = json.loads((tmp_path / "metrics.json").read_text())["datasets"]["tiny"]
    got = tensorboard_events(tmp_path / "tensorboard")
    assert json.loads(got.pop("config/text_summary")[0][1])["report_to"] == ["tensorboard"]
    want = {"tiny/pass@1": m["pass@k"]["1"], "tiny/pass@2": m["pass@k"]["2"], "tiny/avg@n": m["avg@n"],
            "tiny/avg@n_ci95_low": m["avg@n_ci95"][0], "tiny/avg@n_ci95_high": m["avg@n_ci95"][1],
            "tiny/mean_length": m["mean_length"], "tiny/truncated": m["truncated"], "tiny/problems": 8}
    assert got == {k: [(0, float(np.float32(v)))] for k, v in want.items()}
