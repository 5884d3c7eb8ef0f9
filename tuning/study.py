"""The study: Optuna's storage (an SQLite file in the study folder by default; a PostgreSQL or any
SQLAlchemy URL, or a journal file, for many machines), its identity (the config, the space, the budget
and the objective it was made for) and its N trials.

Exactly N trials, whatever the number of processes: the process that creates the study adds N WAITING
trials (slots) at once, and every process only claims a waiting one (Optuna's own atomic claim, the one
study.ask uses) and never creates one. An interrupted trial (its tune.py killed, or SIGTERM) is marked
failed and a waiting copy with the same parameters takes its place (Optuna's
RetryHeartbeatStaleTrialCallback), so no number is reused and no trial counts twice; the copy resumes
the run folder of the trial it retries. A trial of a tune.py that died on this host is found at once (its
pid is gone); one of another host by Optuna's heartbeat (RDB storages)."""
import hashlib
import json
import logging
import os
import socket
import time
import warnings

import optuna
from optuna.storages import RetryHeartbeatStaleTrialCallback
from optuna.trial import TrialState

from engine import processes
from engine.errors import UserError
from engine.files import atomic_write

log = logging.getLogger(__name__)

HEARTBEAT_SECONDS = 10  # a running trial's heartbeat (RDB storages); stale after GRACE_SECONDS without one
GRACE_SECONDS = 60
IDENTITY_KEYS = ("config_sha256", "space_sha256", "objective", "direction", "trial_budget")


class StudyError(UserError):
    pass


def storage_url(storage, study_dir):
    """The storage's URL: --storage, else an SQLite file in the study folder."""
    return storage or f"sqlite:///{os.path.abspath(os.path.join(study_dir, 'study.db'))}"


def open_storage(url):
    """Optuna's storage for url: journal:PATH (a journal file, e.g. on a shared file system), else an
    SQLAlchemy URL (sqlite:///PATH, postgresql://user@host/db, ...). One clear error when it cannot be
    reached; nothing is written then."""
    given = url
    try:
        if url.startswith("journal:"):
            path = url[len("journal:"):]
            if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
                raise StudyError(f"--storage {url}: the folder of the journal file does not exist")
            return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
        if url.startswith("postgresql://"):  # SQLAlchemy's default driver is psycopg2; requirements.txt has psycopg 3
            url = "postgresql+psycopg://" + url[len("postgresql://"):]
        kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else \
            {"connect_args": {"connect_timeout": 10}} if url.startswith("postgresql") else {}
        for attempt in range(5):
            try:
                return optuna.storages.RDBStorage(url, engine_kwargs=kwargs, heartbeat_interval=HEARTBEAT_SECONDS,
                                                  grace_period=GRACE_SECONDS,
                                                  heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback())
            except Exception as e:  # two processes creating the tables at once: one wins, the other reads them
                if attempt == 4 or not ("IntegrityError" in type(e).__name__ or "already exists" in str(e)):
                    raise
                time.sleep(0.5 + attempt)
    except StudyError:
        raise
    except Exception as e:  # sqlalchemy's OperationalError, ArgumentError, a missing driver, ...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StudyError(f"--storage {hide_password(given)}: cannot open the study storage: {reason}") from None


def hide_password(url):
    head, sep, rest = url.partition("://")
    if sep and "@" in rest and ":" in rest.split("@", 1)[0]:
        user = rest.split("@", 1)[0].split(":", 1)[0]
        return f"{head}://{user}:***@{rest.split('@', 1)[1]}"
    return url


def sha256(text):
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def identity(cfg_yaml, space, budget, objective, direction):
    return {"config_sha256": sha256(cfg_yaml), "space_sha256": sha256(space.text), "objective": objective,
            "direction": direction, "trial_budget": budget}


def open_study(storage, name, ident, trials, sampler, pruner, force=False, wait=60.0):
    """The study `name` in storage: created with its N waiting trials by the first process, joined by the
    others. One made for another config, space, budget or objective, or another number of trials, is
    refused unless force (then its plan grows to `trials` where that is more)."""
    try:
        study = optuna.create_study(storage=storage, study_name=name, direction=ident["direction"], sampler=sampler,
                                    pruner=pruner)
        for key, value in ident.items():
            study.set_user_attr(key, value)
        for _ in range(trials):
            study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING))
        study.set_user_attr("planned", trials)
        log.info("study %s created with %d trials", name, trials)
        return study
    except optuna.exceptions.DuplicatedStudyError:
        pass
    study = optuna.load_study(storage=storage, study_name=name, sampler=sampler, pruner=pruner)
    deadline = time.monotonic() + wait
    while "planned" not in study.user_attrs:  # its creator is adding the trials
        if time.monotonic() > deadline:
            raise StudyError(f"study {name}: it has no planned trials {wait:g} s after its creation (its creator "
                             f"died early?); start again with another --study-dir")
        time.sleep(0.5)
    attrs = study.user_attrs
    changed = [f"{k}: {attrs.get(k)!r} in the study, {ident[k]!r} now" for k in IDENTITY_KEYS if attrs.get(k) != ident[k]]
    if attrs["planned"] != trials and not (force and trials > attrs["planned"]):
        changed.append(f"trials: {attrs['planned']} in the study, {trials} now")
    if changed and not force:
        raise StudyError(f"study {name} was made for another search:\n  " + "\n  ".join(changed) +
                         "\nuse another --study-dir for a new search, or --force to go on with this one")
    if force:
        for key, value in ident.items():
            study.set_user_attr(key, value)
        for _ in range(trials - attrs["planned"]):
            study.add_trial(optuna.trial.create_trial(state=TrialState.WAITING))
        study.set_user_attr("planned", max(trials, attrs["planned"]))
    return study


def claim(study):
    """A waiting trial of the study for this process, or None when every one is taken. Optuna's atomic
    claim (the one study.ask uses first): only one process gets each. study.ask itself would create a new
    trial when none waits, which would overrun the plan."""
    trial_id = study._pop_waiting_trial_id()  # optuna==5.0.0, pinned
    if trial_id is None:
        return None
    trial = optuna.Trial(study, trial_id)
    trial.set_user_attr("host", socket.gethostname())
    trial.set_user_attr("tune_pid", os.getpid())
    trial.set_user_attr("tune_started", processes.start_time(os.getpid()))
    return trial


def heartbeat(study, trial):
    """Optuna's heartbeat of a running trial (RDB storages; what study.optimize's thread records)."""
    storage = study._storage
    if isinstance(storage, optuna.storages.RDBStorage):
        storage.record_heartbeat(trial._trial_id)


def retry_history(frozen):
    """The numbers of the trials this one retries, oldest first (Optuna's, "experimental" since 3.0)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return RetryHeartbeatStaleTrialCallback.retry_history(frozen)


def slot(frozen):
    """The number of the trial whose run folder a trial uses: its own, or the first it retries."""
    history = retry_history(frozen)
    return history[0] if history else frozen.number


def _alive(pid, started):
    """The process pid lives and is the one that started at `started` (pids are reused)."""
    return bool(pid) and processes.alive(pid) and (started is None or processes.start_time(pid) == started)


def retry(study, frozen, reason):
    """Mark a running trial failed and queue a copy with its parameters (a new number), which resumes
    its run folder. False when another process did it first."""
    try:
        study.tell(frozen.number, state=TrialState.FAIL)
    except (ValueError, RuntimeError, optuna.exceptions.UpdateFinishedTrialError):
        return False
    RetryHeartbeatStaleTrialCallback()(study, frozen)
    log.warning("trial %d: %s; a copy with its parameters will resume its run", frozen.number, reason)
    return True


def recover(study, settle=1.0):
    """Trials left running by a tune.py that is gone: on this host, found by pid at once; elsewhere by
    Optuna's heartbeat (RDB storages, GRACE_SECONDS). Each is failed and queued again. A copy of a retried
    trial carries its original's attributes until its claimer writes its own, milliseconds after the claim:
    a dead-looking trial is looked at again `settle` seconds later."""
    host = socket.gethostname()

    def dead():
        return {t.number: t for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.user_attrs.get("host") == host
                and not _alive(t.user_attrs.get("tune_pid"), t.user_attrs.get("tune_started"))}

    first = dead()
    if first:
        time.sleep(settle)
        for number, t in dead().items():
            if number in first and t.user_attrs.get("tune_pid") == first[number].user_attrs.get("tune_pid"):
                retry(study, t, f"its tune.py (pid {t.user_attrs.get('tune_pid')}) on {host} is gone")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


def interrupted(study):
    """The numbers of the trials that were interrupted and queued again (each retried by another)."""
    return {n for t in study.get_trials(deepcopy=False) for n in retry_history(t)}


def counts(study):
    """{state: number} of the study's trials, the interrupted ones (failed and queued again) apart."""
    gone, out = interrupted(study), {}
    for t in study.get_trials(deepcopy=False):
        name = "interrupted" if t.number in gone else t.state.name.lower()
        out[name] = out.get(name, 0) + 1
    return out


def check_local_identity(study_dir, ident, force=False):
    """A study folder's study.json made for another config, space, budget or objective is refused unless
    force. Reads only."""
    path = os.path.join(study_dir, "study.json")
    if not os.path.isfile(path) or force:
        return
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError) as e:
        raise StudyError(f"{path}: unreadable ({e}); use another --study-dir, or --force") from None
    changed = [f"{k}: {old.get(k)!r} there, {ident[k]!r} now" for k in IDENTITY_KEYS if old.get(k) != ident[k]]
    if changed:
        raise StudyError(f"--study-dir {study_dir} holds a study of another search ({path}):\n  " +
                         "\n  ".join(changed) + "\nuse another --study-dir, or --force to go on with it")


def save_local_identity(study_dir, ident, url, name):
    """study.json in the study folder: what its runs were made for."""
    record = {**ident, "storage": hide_password(url), "study_name": name}
    atomic_write(os.path.join(study_dir, "study.json"), lambda f: json.dump(record, f, indent=1))


def frozen(study, number):
    """The trial `number` as stored now."""
    return study.get_trials(deepcopy=False)[number]
