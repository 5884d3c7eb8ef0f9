"""tune.py (issue 38): a search over any config, each trial a real train.py process in its own folder,
pruned by its own evaluations, resumed after kill -9 and SIGTERM, shared by processes (--jobs, two
tune.py on one SQLite file, two on a real PostgreSQL server) with exactly N trials; its report (study.md,
study.html, best.yaml, TensorBoard's hparams) and its refusals of bad input."""
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import optuna
import pytest
import yaml

from conftest import ROOT
from engine.config import ConfigError, load_config
from engine.checkpoint import load_checkpoint
from tuning.space import SpaceError, load_space
from tuning.study import counts, interrupted

TINY = os.path.join(ROOT, "tests", "configs", "tiny.yaml")
TUNE = os.path.join(ROOT, "tune.py")
TRAIN = os.path.join(ROOT, "train.py")
QUICK = ["train.epochs=1"]  # a trial of seconds: mostly its process's start-up
SPACE = {"optim.lr": {"log_uniform": [1.0e-3, 1.0e-1]}, "optim.weight_decay": {"uniform": [0, 0.1]},
         "model.label_smoothing": {"uniform": [0, 0.2]}}
TIMEOUT = 300

process = [pytest.mark.slow, pytest.mark.process]


def space_file(folder, space=SPACE):
    path = os.path.join(folder, "space.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(space, f, sort_keys=False)
    return path


def tune_cmd(study_dir, space, trials, *args, sets=QUICK, config=TINY):
    return [sys.executable, TUNE, "--config", config, "--space", space, "--trials", str(trials), "--study-dir",
            str(study_dir), *args, "--set", *sets]


def tune(study_dir, space, trials, *args, sets=QUICK, config=TINY, timeout=TIMEOUT):
    return subprocess.run(tune_cmd(study_dir, space, trials, *args, sets=sets, config=config), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def said(out):
    return out.stdout[-3000:] + out.stderr[-3000:]


def start(study_dir, space, trials, *args, sets=QUICK, log=None):
    out = open(log or os.path.join(tempfile.mkdtemp(), "tune.log"), "w+")
    proc = subprocess.Popen(tune_cmd(study_dir, space, trials, *args, sets=sets), cwd=ROOT, stdout=out,
                            stderr=subprocess.STDOUT, text=True)
    proc.out = out
    return proc


def output(proc):
    proc.out.seek(0)
    return proc.out.read()


def load(study_dir, storage=None, name=None):
    """The study as tune.py stored it (its own SQLite file unless `storage`)."""
    storage = storage or f"sqlite:///{os.path.join(study_dir, 'study.db')}"
    return optuna.load_study(study_name=name or os.path.basename(str(study_dir)), storage=storage)


def assert_exactly(study, n, study_dirs):
    """N trials finished, none lost or counted twice: the trials not interrupted are 0..N-1 plus the numbers
    of the copies that replaced the interrupted ones; every one finished; one run folder per trial slot."""
    trials = study.get_trials(deepcopy=False)
    numbers = [t.number for t in trials]
    assert numbers == list(range(len(trials)))  # Optuna numbers them: none reused
    gone = interrupted(study)
    kept = [t for t in trials if t.number not in gone]
    assert len(kept) == n, counts(study)
    assert all(t.state.is_finished() for t in trials), counts(study)
    folders = sorted(f for d in study_dirs for f in glob.glob(os.path.join(str(d), "trial_*")))
    assert len(folders) == n and len({os.path.basename(f) for f in folders}) == n, folders
    for t in kept:  # each trial's config is its own: the sampled values of that trial
        cfg = yaml.safe_load(open(os.path.join(t.user_attrs["folder"], "trial.yaml")))
        assert cfg["optim"]["lr"] == pytest.approx(t.params["optim.lr"])


# ---------------------------------------------------------------- the space, checked like a config

@pytest.fixture(scope="module")
def base():
    return load_config(TINY).model_dump(mode="json")


@pytest.mark.parametrize("space, message", [
    ({"optim.lrr": {"log_uniform": [1e-4, 1e-1]}}, r"unknown key 'optim.lrr'; did you mean 'optim.lr'"),
    ({"model.label_smothing": {"uniform": [0, 0.2]}}, r"unknown key 'model.label_smothing'.*did you mean "
                                                       r"'model.label_smoothing'"),
    ({"optim.weight_decay": {"uniform": [-0.1, 0.1]}}, r"optim.weight_decay = -0.1 .*refused by the config.*"
                                                       r"greater than or equal to 0"),
    ({"optim.momentum": {"uniform": [0.5, 1.0]}}, r"optim.momentum = 1.0 .*less than 1"),
    ({"optim.lr": {"log_uniform": [0.1, 0.001]}}, r"optim.lr: log_uniform \[0.1, 0.001\]: low must be below high"),
    ({"optim.weight_decay": {"log_uniform": [0, 0.1]}}, r"a log range must be above 0"),
    ({"train.eval_every": {"int": [1, 2.5]}}, r"int takes integer ends"),
    ({"recipes": {"choice": [["ema"], ["emaa"]]}}, r"recipes = \['emaa'\].*did you mean 'ema'"),
    ({"data.batch_size": {"choice": [16, "x"]}}, r"data.batch_size = 'x'"),
    ({"optim.lr": {"normal": [0, 1]}}, r"optim.lr: expected one of uniform, log_uniform, int, log_int, choice"),
    ({"optim lr": {"uniform": [0, 1]}}, r"'optim lr' is not a config key"),
])
def test_a_space_is_refused_before_any_trial_naming_the_file_and_key(tmp_path, base, space, message):
    path = space_file(str(tmp_path), space)
    with pytest.raises(SpaceError, match=message) as e:
        load_space(path, base)
    assert path in str(e.value)


def test_a_valid_space_keeps_its_keys_in_order(tmp_path, base):
    space = load_space(space_file(str(tmp_path), {**SPACE, "recipes": {"choice": [[], ["ema"]]}}), base)
    assert [p.key for p in space] == [*SPACE, "recipes"]
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(8):  # every sampled point is a valid config (the ends were checked, the points are too)
        trial = study.ask()
        values = space.sample(trial)
        assert 1e-3 <= values["optim.lr"] <= 1e-1 and values["recipes"] in ([], ["ema"])
        assert space.values(trial.params) == values


def test_a_space_key_that_is_not_a_config_key_ends_tune_py_in_one_line_writing_nothing(tmp_path):
    path = space_file(str(tmp_path), {"optim.lrr": {"log_uniform": [1e-4, 1e-1]}})
    out = tune(tmp_path / "study", path, 2)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines()[0].startswith(f"error: {path}: optim.lrr")
    assert "did you mean 'optim.lr'" in out.stderr
    assert not (tmp_path / "study").exists()


@pytest.mark.slow
def test_metrics_jsonl_has_a_line_per_evaluation_and_goes_aside_with_overwrite(tmp_path):
    """What the pruner reads: each evaluation of a run, appended by train.py; --overwrite replaces it with
    the rest of the run (it was appended to the old run's lines)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for epochs in (2, 1):
        run = subprocess.run([sys.executable, TRAIN, "--config", TINY, "--output-dir", str(tmp_path), "--overwrite",
                              "--set", f"train.epochs={epochs}"], cwd=ROOT, capture_output=True, text=True,
                             timeout=TIMEOUT, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
        assert [e["epoch"] for e in lines] == list(range(1, epochs + 1))
        assert lines[-1]["metrics"] == load_checkpoint(str(tmp_path / "last.pt"))["metrics"]


# ---------------------------------------------------------------- a study and its report

@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """One study of 8 trials of the tiny config run by two tune.py processes at once, --jobs 2 each (4 trials
    at once), on one SQLite file (TPE, median pruner): acceptance 2's first two cases, and the study whose
    report the tests below read."""
    folder = tmp_path_factory.mktemp("tune")
    space = space_file(str(folder))
    procs = [start(folder / "study", space, 8, "--jobs", "2", sets=["train.epochs=2"]) for _ in range(2)]
    for p in procs:
        assert p.wait(timeout=TIMEOUT) == 0, output(p)[-3000:]
    return folder / "study", space, output(procs[0]) + output(procs[1])


@pytest.mark.slow
def test_two_tune_py_of_two_jobs_each_on_one_sqlite_file_run_exactly_8_trials_each_a_train_py_run(study):
    study_dir, _, out = study
    s = load(study_dir)
    assert_exactly(s, 8, [study_dir])
    for t in s.trials:
        folder = t.user_attrs["folder"]
        assert os.path.basename(folder) == f"trial_{t.number:03d}"
        state = load_checkpoint(os.path.join(folder, "last.pt"))  # a real run: its checkpoint and metrics log
        assert state["config"]["optim"]["lr"] == pytest.approx(t.params["optim.lr"])
        evaluations = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
        # every evaluation reported to the pruner: both epochs, or those up to where it pruned the run
        assert t.intermediate_values == {e["epoch"]: e["metrics"]["val/top1"] for e in evaluations}
        if t.state == optuna.trial.TrialState.COMPLETE:  # the objective: the run's best val/top1
            assert state["epoch"] == 1 and [e["epoch"] for e in evaluations] == [1, 2]
            assert t.value == max(e["metrics"]["val/top1"] for e in evaluations)
        else:
            assert t.state == optuna.trial.TrialState.PRUNED and evaluations, t.state
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in s.trials) >= 5  # the median pruner's start
    for jobs, threads, cores in re.findall(r"(\d+) trial\(s\) at once x (\d+) thread\(s\) each on (\d+) core", out):
        assert int(jobs) == 2 and 1 <= int(jobs) * int(threads) <= int(cores)  # the cores split between the jobs


@pytest.mark.slow
def test_the_report_leads_with_the_best_trial_and_best_yaml_trains_as_it_is(study, tmp_path):
    study_dir, _, _ = study
    s = load(study_dir)
    md = open(study_dir / "study.md").read()
    best = s.best_trial
    assert f"Best: trial {best.number}, val/top1 {best.value:.4f}" in md.splitlines()[2]
    for t in s.trials:
        assert re.search(rf"^\| {t.number} \| {t.state.name.lower()} \|", md, re.M), md
    for plot in ("history", "importances", "slices", "parallel", "intermediate"):
        assert os.path.getsize(study_dir / "plots" / f"{plot}.png") > 1000
    assert len(glob.glob(str(study_dir / "tensorboard" / "trial_*" / "events.out.tfevents.*"))) == 8
    # best.yaml is the best trial's config: train.py takes it as it is and reaches the trial's metric
    cfg = load_config(str(study_dir / "best.yaml"))
    assert cfg.optim.lr == pytest.approx(best.params["optim.lr"])
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, TRAIN, "--config", str(study_dir / "best.yaml"), "--output-dir",
                          str(tmp_path / "again")], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    again = [json.loads(line)["metrics"]["val/top1"] for line in open(tmp_path / "again" / "metrics.jsonl")]
    assert max(again) == best.value  # the same seed, data and threads on CPU: the same run


@pytest.mark.slow
def test_tensorboard_hparams_hold_every_trial(study):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    study_dir, _, _ = study
    s = load(study_dir)
    for t in s.trials:
        acc = EventAccumulator(str(study_dir / "tensorboard" / f"trial_{t.number:03d}"))
        acc.Reload()
        assert "_hparams_/session_start_info" in acc.summary_metadata
        assert acc.Scalars("tune/val/top1")[0].value == pytest.approx(max(t.intermediate_values.values()))


BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.skipif(BROWSER is None, reason="headless Chromium not installed (apt-get install chromium; .ci/run "
                                            "installs it when apt is available)")
def test_study_html_opens_offline_in_chromium_with_its_plots(study, tmp_path):
    from test_report_browser import screenshot
    import numpy as np
    from PIL import Image
    study_dir, _, _ = study
    page = str(study_dir / "study.html")
    html = open(page, encoding="utf-8").read()
    sources = re.findall(r'\bsrc="([^"]*)"', html)
    assert len(sources) == 5 and all(s.startswith("data:image/png;base64,") for s in sources)  # self-contained
    assert "href=" not in html and "<script" not in html
    console, _ = screenshot(page, str(tmp_path / "shot.png"))
    assert console == [], console
    shot = np.asarray(Image.open(tmp_path / "shot.png").convert("RGB")).astype(int)
    blue = (np.abs(shot - [31, 119, 180]).sum(axis=2) < 40).sum()  # matplotlib's first colour: the plots' marks
    assert blue > 200


@pytest.mark.slow
def test_a_study_folder_of_another_config_or_space_is_refused_unless_force(study, tmp_path):
    study_dir, space, _ = study
    before = sorted(os.listdir(study_dir))
    out = tune(study_dir, space, 8, sets=["train.epochs=3"])
    assert out.returncode == 1 and "holds a study of another search" in out.stderr and "config_sha256" in out.stderr
    other = space_file(str(tmp_path), {"optim.lr": {"log_uniform": [1e-3, 1e-1]}})
    out = tune(study_dir, other, 8, sets=["train.epochs=2"])
    assert out.returncode == 1 and "space_sha256" in out.stderr
    assert sorted(os.listdir(study_dir)) == before
    out = tune(study_dir, space, 8, "--force", sets=["train.epochs=2", "train.log_every=2"])  # a changed config
    assert out.returncode == 0, said(out)
    assert len(load(study_dir).trials) == 8  # nothing left to run: the plan is kept


@pytest.mark.slow
def test_a_storage_that_cannot_be_reached_is_one_line_and_nothing_is_written(tmp_path):
    space = space_file(str(tmp_path))
    out = tune(tmp_path / "study", space, 2, "--storage", "postgresql://tune:secret@127.0.0.1:9/none")
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --storage postgresql://tune:***@127.0.0.1:9/none: "
                                                    "cannot open the study storage"), lines
    assert "secret" not in out.stderr and not (tmp_path / "study").exists()


# ---------------------------------------------------------------- pruning

@pytest.mark.slow
def test_the_pruner_stops_bad_trials_at_an_evaluation_with_their_checkpoint(tmp_path):
    """lr 1e-7 learns nothing, lr 0.02 learns (the same seed: equal runs); the random sampler's seed 30 draws
    them as GGGGGb: after 5 completed trials (the median pruner's start, Optuna's default), trial 5 (1e-7) is
    below the median at an
    evaluation, gets SIGTERM, stops with its checkpoint (exit 75) and is recorded as pruned at that epoch."""
    space = space_file(str(tmp_path), {"optim.lr": {"choice": [0.02, 1.0e-7]}})
    # precise_bn: MobileNetV3's BatchNorm statistics lag in a short run, and eval mode would stay at chance
    sets = ["train.epochs=4", "data.train_size=64", "data.val_size=48", "recipes=[precise_bn]",
            "recipe_args={precise_bn: {num_batches: 4}}"]
    out = tune(tmp_path / "study", space, 6, "--sampler", "random", "--seed", "30", sets=sets)
    assert out.returncode == 0, said(out)
    s = load(tmp_path / "study")
    pruned = [t for t in s.trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, [(t.params, t.intermediate_values) for t in s.trials]
    for t in pruned:
        at = t.user_attrs["pruned_at"]
        assert t.params["optim.lr"] == 1.0e-7 and t.number == 5
        assert at["epoch"] < 4 and max(t.intermediate_values) == at["epoch"] and at["pruner"] == "median"
        log = open(os.path.join(t.user_attrs["folder"], "train.log")).read()
        assert re.search(r"stopped: SIGTERM.*checkpoint (was )?written", log), log[-2000:]  # in a step or an evaluation
        assert load_checkpoint(os.path.join(t.user_attrs["folder"], "last.pt"))["step"] > 0
    md = open(tmp_path / "study" / "study.md").read()
    assert f"| {pruned[0].number} | pruned |" in md and f"epoch {pruned[0].user_attrs['pruned_at']['epoch']}" in md


@pytest.mark.slow
def test_the_grid_sampler_takes_each_point_once_and_the_study_ends_without_optuna_s_stop(tmp_path):
    """Optuna's GridSampler stops study.optimize once every point is taken, and raises outside it (was: the
    last trial's tell failed with `Study.stop is supposed to be invoked inside an objective function`)."""
    space = space_file(str(tmp_path), {"optim.lr": {"choice": [0.01, 0.001]}, "recipes": {"choice": [[], ["ema"]]}})
    out = tune(tmp_path / "study", space, 4, "--sampler", "grid", "--pruner", "none")
    assert out.returncode == 0, said(out)
    s = load(tmp_path / "study")
    points = sorted((t.params["optim.lr"], t.params["recipes"]) for t in s.trials)
    assert points == [(0.001, "[\"ema\"]"), (0.001, "[]"), (0.01, "[\"ema\"]"), (0.01, "[]")]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in s.trials)


# ---------------------------------------------------------------- failures, SIGTERM, kill -9

@pytest.mark.slow
def test_failed_trials_are_recorded_and_the_study_stops_after_max_failures_in_a_row(tmp_path):
    """An lr that sends the loss to inf: each trial fails (train.py's non-finite loss error), is recorded
    with that error, and after --max-failures 2 in a row the study stops naming them."""
    space = space_file(str(tmp_path), {"optim.lr": {"log_uniform": [1.0e+20, 1.0e+30]}})
    out = tune(tmp_path / "study", space, 5, "--max-failures", "2")
    assert out.returncode == 1
    assert re.search(r"error: 2 trials failed in a row \(--max-failures 2\), the study stopped:\n  trial 0: "
                     r"train.py exited 1: .*non-finite loss.*\n  trial 1: train.py exited 1", out.stderr), \
        said(out)
    s = load(tmp_path / "study")
    failed = [t for t in s.trials if t.state == optuna.trial.TrialState.FAIL]
    assert [t.number for t in failed] == [0, 1] and "non-finite loss" in failed[0].user_attrs["error"]
    assert counts(s) == {"fail": 2, "waiting": 3}  # the rest is still planned: the same command goes on


def running_with_checkpoint(study_dir, proc, since=0.0, timeout=TIMEOUT):
    """A running trial (as stored) whose run folder got a checkpoint after `since` (a time), while it trains."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, output(proc)[-3000:]
        if os.path.exists(os.path.join(str(study_dir), "study.json")):  # written once the study's tables exist
            for t in load(study_dir).get_trials(states=(optuna.trial.TrialState.RUNNING,)):
                last = os.path.join(t.user_attrs.get("folder", "-"), "last.pt")
                if "train_pid" in t.user_attrs and os.path.exists(last) and os.path.getmtime(last) > since:
                    return t
        time.sleep(0.2)
    pytest.fail("no running trial wrote a checkpoint")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.slow
@pytest.mark.process
def test_sigterm_then_kill_9_then_the_same_command_ends_with_exactly_n_trials(tmp_path):
    """SIGTERM: the running trial stops with its checkpoint and tune.py exits 75. kill -9 of the next
    tune.py: its trial's train.py stops within 10 s with a checkpoint (nothing trains on). The same command
    a third time resumes both interrupted trials from their last.pt and ends 0 with exactly 2 trials."""
    space = space_file(str(tmp_path))
    study_dir = tmp_path / "study"
    sets = ["train.epochs=3", "checkpoint.every_n_steps=2", "data.train_size=64"]
    first = start(study_dir, space, 2, sets=sets)
    folder = running_with_checkpoint(study_dir, first).user_attrs["folder"]
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=120) == 75, output(first)[-3000:]
    assert "stopped: the running trials wrote their checkpoints" in output(first)
    assert "stopped: SIGTERM" in open(os.path.join(folder, "train.log")).read()

    second = start(study_dir, space, 2, sets=sets)
    running = running_with_checkpoint(study_dir, second, since=time.time())
    pid = running.user_attrs["train_pid"]
    second.kill()
    second.wait(timeout=60)
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(pid), "the trial's train.py still runs 10 s after its tune.py was killed"
    assert "stopped: SIGTERM" in open(os.path.join(running.user_attrs["folder"], "train.log")).read()

    third = tune(study_dir, space, 2, sets=sets)
    assert third.returncode == 0, said(third)
    s = load(study_dir)
    assert_exactly(s, 2, [study_dir])
    assert len(interrupted(s)) == 2
    for t in s.trials:
        if "failed_trial" in t.system_attrs and t.number not in interrupted(s):  # a copy: it resumed its run
            log = open(t.user_attrs["folder"] + "/train.log").read()
            assert "resumed from" in log, log[-2000:]


# ---------------------------------------------------------------- parallel: exactly N, no duplicates

@pytest.fixture
def postgres(tmp_path):
    """A real PostgreSQL server (Debian's postgresql; .ci/run installs it) on a free port, trust auth."""
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not bins:
        pytest.skip("no PostgreSQL server on this machine: .ci/run installs Debian's postgresql where apt is usable")
    bin_dir = os.path.dirname(bins[-1])
    folder = tempfile.mkdtemp(prefix="tune-pg-")  # the server's user must reach it
    os.chmod(folder, 0o777)
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(folder, "postgres")
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = os.path.join(folder, "data")
    subprocess.run(as_user + [f"{bin_dir}/initdb", "-D", data, "--auth=trust", "-U", "postgres"], check=True,
                   capture_output=True, timeout=120)
    subprocess.run(as_user + [f"{bin_dir}/pg_ctl", "-D", data, "-l", os.path.join(folder, "log"), "-w", "-o",
                              f"-p {port} -k {folder} -c listen_addresses=127.0.0.1", "start"], check=True,
                   capture_output=True, timeout=120)
    yield f"postgresql://postgres@127.0.0.1:{port}/postgres"
    subprocess.run(as_user + [f"{bin_dir}/pg_ctl", "-D", data, "-m", "immediate", "stop"], capture_output=True,
                   timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_two_tune_py_on_one_postgresql_server_share_one_study_of_exactly_8_trials(tmp_path, postgres):
    """As two machines would: each its own study folder (its run folders), one study in PostgreSQL."""
    space = space_file(str(tmp_path))
    dirs = [tmp_path / "a" / "search", tmp_path / "b" / "search"]  # the same name: the study's
    procs = [start(d, space, 8, "--storage", postgres) for d in dirs]
    for p in procs:
        assert p.wait(timeout=TIMEOUT) == 0, output(p)[-3000:]
    s = load(dirs[0], storage=postgres.replace("postgresql://", "postgresql+psycopg://"), name="search")
    assert_exactly(s, 8, dirs)
    assert all(len(glob.glob(str(d / "trial_*"))) > 0 for d in dirs)  # both ran trials
