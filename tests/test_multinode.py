"""Two torchrun agents on one host, as two machines (issue 37): launch.py agents over loopback, one
worker each, restarted across agents after kill -9 of a worker (c10d and etcd-v2), the job re-formed
on one process after kill -9 of a whole agent (etcd-v2, --nnodes=1:2), and a rendezvous that cannot
be reached or is lost ending in one line. Each job resumes from its step checkpoint and ends with
the uninterrupted run's weights; every subprocess has its own timeout."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch

from engine.checkpoint import load_checkpoint

from multinode_helper import ENV, HELPER, ROOT, TINY, Etcd, agent, children, free_port, kill_machine, listening, \
    output, parent, stop

pytestmark = [pytest.mark.distributed, pytest.mark.process, pytest.mark.slow]

# no BatchNorm, no dropout: the weights depend on each global step's samples only (up to float sums)
COMMON = ["model={name: _linear}", "data.train_size=48", "data.batch_size=4", "checkpoint.every_n_steps=2",
          "train.log_every=100"]  # global batch 8 on 2 processes: 6 steps an epoch, 12 in all
RECIPES = "recipes=[_log_ids, _fault]"
TIMEOUT = 300  # each job's own bound: a hang fails there, with the output


def fault(pid_file, rank, step=9):
    return f"recipe_args._fault={{kind: block, rank: {rank}, step: {step}, pid_file: {pid_file}}}"


def steps(path):
    """{global step: its sample keys}; a step logged twice (before a kill and after the resume) keeps the last."""
    return {e["step"]: e["keys"] for e in map(json.loads, open(path))}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-process run: its final weights and the sample keys of every global step."""
    out = tmp_path_factory.mktemp("straight")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", HELPER, "train",
           "--config", TINY, "--output-dir", str(out), "--set", *COMMON, RECIPES, "recipe_args._fault={kind: none}"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=ENV, cwd=ROOT)
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    ids = steps(out / "ids.jsonl")
    assert sorted(ids) == list(range(1, 13)) and all(len(k) == 8 for k in ids.values())
    return load_checkpoint(str(out / "last.pt"))["model"], ids


def same_run(out, reference):
    weights, ids = reference
    assert steps(out / "ids.jsonl") == ids
    state = load_checkpoint(str(out / "last.pt"))
    assert state["step"] == 12
    for k in weights:
        assert torch.allclose(weights[k], state["model"][k], rtol=1e-4, atol=1e-6), k


def wait_pid(path, procs, timeout=TIMEOUT):
    """The pid a blocking fault writes to `path`; fails with the agents' output if one ends first."""
    start = time.time()
    while not os.path.exists(path):
        for p in procs:
            if p.poll() is not None:
                pytest.fail("an agent ended before the fault:\n" + "\n".join(o[-3000:] for o in stop(*procs)))
        assert time.time() - start < timeout, f"{path} never appeared"
        time.sleep(0.05)
    return int(open(path).read())


def finish(*procs):
    """(exit code, output) of each agent; one still running after TIMEOUT is killed and fails the test."""
    deadline = time.time() + TIMEOUT
    try:
        codes = [p.wait(timeout=max(1.0, deadline - time.time())) for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail("the job hung:\n" + "\n".join(o[-3000:] for o in stop(*procs)))
    return [(code, output(p)) for code, p in zip(codes, procs)]


def two_agents(out, backend, endpoint, *sets, nnodes="2", launcher=("--max-restarts=1",), torchrun=False):
    """Two agents of one job (a run id of its own: etcd keeps a finished job's rendezvous closed); under c10d the
    first hosts the rendezvous store (it is up before the second starts)."""
    run_id = uuid.uuid4().hex
    first = agent(out, *COMMON, RECIPES, *sets, backend=backend, endpoint=endpoint, nnodes=nnodes, launcher=launcher,
                  run_id=run_id, torchrun=torchrun)
    if backend == "c10d":
        port, deadline = int(endpoint.rsplit(":", 1)[1]), time.time() + 120
        while not listening(port):
            if first.poll() is not None or time.time() > deadline:
                pytest.fail("the first agent does not host the c10d store:\n" + stop(first)[0][-3000:])
            time.sleep(0.1)
    second = agent(out, *COMMON, RECIPES, *sets, backend=backend, endpoint=endpoint, nnodes=nnodes, launcher=launcher,
                   run_id=run_id, torchrun=torchrun)
    first.run_id = run_id  # for an agent that joins later
    return first, second


def worker_kill(tmp_path, reference, backend, endpoint, which):
    """kill -9 of the worker of the first agent (rank 0: the rendezvous sorts the agents by pid; under c10d it
    hosts the store) or of the second, while the other agent's worker is busy in its step (blocked after step 9,
    step 8 checkpointed): that agent learns of the new round from the rendezvous, not from its worker's failure."""
    out, pid_file = tmp_path / "run", tmp_path / "pid"
    busy = 1 if which == "first" else 0
    procs = two_agents(out, backend, endpoint, fault(pid_file, rank=busy))
    target, survivor = procs if which == "first" else procs[::-1]
    try:
        blocked = wait_pid(pid_file, procs)
        assert parent(blocked) == survivor.pid  # rank 0 is the first agent's
        os.kill(children(target.pid)[0], signal.SIGKILL)
        results = finish(*procs)
    finally:
        stop(*procs)
    for code, text in results:
        assert code == 0, text[-4000:]
    assert any("(2 processes)" in text for _, text in results)  # rank 0 logs
    assert any("resumed from" in text and "step 8" in text for _, text in results), results[0][1][-3000:]
    same_run(out, reference)


@pytest.mark.parametrize("which", ["second", "first"])
def test_c10d_worker_killed_on_either_agent_restarts_across_agents_to_the_same_weights(tmp_path, reference, which):
    """Acceptance 1: kill -9 of the worker on the agent that does not host the c10d store (second), and on the
    one that does (first), after the step checkpoint of step 8: both agents restart their workers
    (--max-restarts=1; the busy one's agent counts no restart), which meet in the new round's own store
    (the old code: the busy agent's restarted worker read the dead round's addresses), resume from step 8
    and end 0 with the uninterrupted weights and sample stream."""
    worker_kill(tmp_path, reference, "c10d", f"127.0.0.1:{free_port()}", which)


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    """A real etcd server (Debian's etcd-server, .ci/run installs it) for torchrun's etcd-v2 backend."""
    if shutil.which("etcd") is None:
        pytest.skip("no etcd server on this machine: .ci/run installs Debian's etcd-server where apt is usable")
    try:
        import etcd as _  # noqa: F401  (python-etcd, requirements.txt: the client torchrun's etcd-v2 backend imports)
    except ImportError:
        pytest.skip("python-etcd is not installed (requirements.txt)")
    server = Etcd(tmp_path_factory.mktemp("etcd"))
    yield server
    server.close()


@pytest.mark.parametrize("which", ["second", "first"])
def test_etcd_worker_killed_on_either_agent_restarts_across_agents_to_the_same_weights(tmp_path, reference, etcd,
                                                                                       which):
    """Acceptance 2: the same kills under --rdzv-backend etcd-v2 (the old code: the busy agent's restarted
    worker waited in the dead round's keys until the job's timeout)."""
    worker_kill(tmp_path, reference, "etcd-v2", etcd.endpoint, which)


# the survivor closes a round of 1 agent 10 s after it joined; a dead agent's heartbeat is missed after 3 s
ELASTIC = ("--max-restarts=1", "--rdzv-conf=join_timeout=120,last_call_timeout=10,keep_alive_interval=1,"
           "keep_alive_max_attempt=3")


@pytest.mark.parametrize("backend, which", [("etcd-v2", "second"), ("etcd-v2", "first"), ("c10d", "second")])
def test_node_lost_the_survivor_continues_on_one_process_with_the_same_samples(tmp_path, reference, request, backend,
                                                                               which):
    """Acceptance 2: --nnodes=1:2, kill -9 of a whole agent and its worker (the machine gone: under etcd the
    first, whose worker is rank 0 and hosts the round's store, or the second; under c10d the second, the one
    not hosting the rendezvous) after step 9, step 8 checkpointed. The survivor's worker fails, its agent
    re-forms the job alone after the last call, and the worker resumes from step 8 on 1 process with the
    global batch kept: every global step trains on the uninterrupted run's samples, and the job ends 0
    with its weights."""
    endpoint = request.getfixturevalue("etcd").endpoint if backend == "etcd-v2" else f"127.0.0.1:{free_port()}"
    out, pid_file = tmp_path / "run", tmp_path / "pid"
    doomed = 0 if which == "first" else 1
    procs = two_agents(out, backend, endpoint, fault(pid_file, rank=doomed), nnodes="1:2", launcher=ELASTIC)
    target, survivor = procs if which == "first" else procs[::-1]
    try:
        blocked = wait_pid(pid_file, procs)
        assert parent(blocked) == target.pid  # rank 0 is the first agent's
        kill_machine(target)
        (code, text), = finish(survivor)
    finally:
        stop(*procs)
    assert code == 0, text[-4000:]
    assert "resuming a run of 2 process(es) on 1: global batch 8 kept = 4 per process x 1 process(es) x 2 " \
           "accumulation step(s)" in text and "step 8" in text, text[-4000:]
    assert "(1 process)" in text
    same_run(out, reference)


def test_a_lost_node_that_comes_back_joins_the_job_at_the_next_restart(tmp_path, reference, etcd):
    """Acceptance 2's last point, under etcd-v2 and --nnodes=1:2: the second agent is killed with its worker
    after step 9 (step 8 checkpointed); the survivor goes on alone from step 8 on 1 process and blocks after
    step 10. A new agent of the same job then starts (the node is back): the survivor's agent sees it waiting
    and restarts its worker (SIGTERM: a checkpoint at its next step), the job re-forms on 2 processes, resumes
    from that step with the global batch kept, and both agents end 0 with the uninterrupted run's samples and weights."""
    out, pid_file, back_pid = tmp_path / "run", tmp_path / "pid", tmp_path / "pid_back"
    alone = f"recipe_args._fault2={{kind: block, rank: 0, step: 10, pid_file: {back_pid}}}"
    procs = two_agents(out, "etcd-v2", etcd.endpoint, fault(pid_file, rank=1), "recipes=[_log_ids, _fault, _fault2]",
                       alone, nnodes="1:2", launcher=ELASTIC)
    survivor, lost = procs
    back = None
    try:
        blocked = wait_pid(pid_file, procs)
        assert parent(blocked) == lost.pid
        kill_machine(lost)
        wait_pid(back_pid, [survivor])  # the survivor, alone, after step 10
        back = agent(out, *COMMON, "recipes=[_log_ids, _fault, _fault2]", fault(pid_file, rank=1), alone,
                     backend="etcd-v2", endpoint=etcd.endpoint, nnodes="1:2", launcher=ELASTIC, run_id=survivor.run_id)
        (code, text), (back_code, back_text) = finish(survivor, back)
    finally:
        stop(*procs, *([back] if back else []))
    assert code == 0 and back_code == 0, text[-3000:] + back_text[-3000:]
    assert "resuming a run of 2 process(es) on 1" in text and "(1 process)" in text, text[-4000:]
    grown = (text + back_text).split("resumed from")[-1]  # the round after the node came back
    assert re.search(r"at epoch 2 \(batch \d+\), step 1[01]\n", grown), grown[:2000]
    assert "(2 processes)" in grown and "global batch 8 = 4 per process x 2 process(es)" in grown, grown[:2000]
    same_run(out, reference)


def test_c10d_loses_the_job_with_the_agent_hosting_its_store_and_says_so(tmp_path):
    """Acceptance 1: c10d keeps its rendezvous in the first agent's process; kill -9 of that whole agent
    ends the job: the survivor's restarted rendezvous cannot reach the store and ends with one line naming
    the backend and the endpoint, within its timeout (read_timeout 10 s, tried twice), not a hang."""
    out, pid_file = tmp_path / "run", tmp_path / "pid"
    endpoint = f"127.0.0.1:{free_port()}"
    procs = two_agents(out, "c10d", endpoint, fault(pid_file, rank=0), nnodes="1:2",
                       launcher=("--max-restarts=1", "--rdzv-conf=read_timeout=10"))
    host, survivor = procs
    try:
        assert parent(wait_pid(pid_file, procs)) == host.pid
        kill_machine(host)
        (code, text), = finish(survivor)
    finally:
        stop(*procs)
    assert code == 1, text[-4000:]
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"launch.py: the c10d rendezvous at {endpoint} (run id ") and "RendezvousConnectionError" in last \
        and "c10d keeps its rendezvous in the agent that hosts the endpoint" in last, text[-4000:]
    assert load_checkpoint(str(out / "last.pt"))["step"] == 8  # the job's last checkpoint, for --resume


@pytest.mark.parametrize("backend", ["etcd-v2", "c10d"])
def test_a_rendezvous_that_cannot_be_reached_at_start_up_is_one_line(tmp_path, backend):
    """Acceptance 4 and "clear failures": no etcd at the endpoint, no c10d store (this agent told not to host
    it): one line naming the backend and the endpoint, within the configured timeout (c10d: read_timeout
    5 s, tried twice)."""
    endpoint = f"127.0.0.1:{free_port()}"
    proc = agent(tmp_path, *COMMON, backend=backend, endpoint=endpoint,
                 launcher=("--rdzv-conf=is_host=0,read_timeout=5,join_timeout=10",) if backend == "c10d" else ())
    try:
        (code, text), = finish(proc)
    finally:
        stop(proc)
    assert code == 1
    lines = [line for line in text.splitlines() if line.startswith("launch.py:")]
    assert len(lines) == 1 and text.strip().splitlines()[-1] == lines[0], text[-3000:]
    assert lines[0].startswith(f"launch.py: the {backend} rendezvous at {endpoint} (run id job) failed: "
                               f"RendezvousConnectionError: The connection to "), text[-3000:]
    assert "Traceback" not in text


def test_plain_torchrun_across_agents_names_the_gone_peer_instead_of_hanging(tmp_path):
    """Clear failures: plain torchrun keeps one agent's store for every round, so after the same kill as above
    the busy agent's restarted worker (its agent counted no restart) reads the dead round's addresses. The
    worker names the peer address it could not reach and says that peer's worker is gone; the other agent's
    worker (restart 1) refuses the shared store, saying what to run instead (--max-restarts=2: the busy agent's
    worker mostly reaches its connection before the job ends; in 3 of 4 runs here). The job ends, nothing hangs."""
    out, pid_file = tmp_path / "run", tmp_path / "pid"
    procs = two_agents(out, "c10d", f"127.0.0.1:{free_port()}", fault(pid_file, rank=1), torchrun=True,
                       launcher=("--max-restarts=2",))
    first, second = procs
    try:
        assert parent(wait_pid(pid_file, procs)) == second.pid
        os.kill(children(first.pid)[0], signal.SIGKILL)
        results = finish(*procs)
    finally:
        stop(*procs)
    text = "\n".join(t for _, t in results)
    assert all(code != 0 for code, _ in results), text[-4000:]
    # the busy agent's worker reaches its connection before the job ends in most runs (a race): then it names the peer,
    # never a bare traceback
    assert "RuntimeError: Gloo connectFullMesh failed" not in text, text[-4000:]
    gone = re.search(r"rank \d: the process group could not connect to the peer at 127\.0\.0\.1:\d+: that peer's "
                     r"worker is gone", text)
    assert gone or "Gloo connectFullMesh failed" not in text, text[-4000:]
    assert "on torchrun's shared agent store, which keeps the previous round's worker addresses: run the job " \
           "through launch.py, or set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text, text[-4000:]


def test_sigterm_on_every_node_exits_75_on_every_node_with_a_checkpoint(tmp_path):
    """The SLURM script's contract across nodes: SIGTERM to every agent's process group (a scheduler's
    preemption of each node): the workers agree on the stop at the next step, write one checkpoint there, and
    launch.py exits 75 on every node, so the script requeues the job."""
    out, pid_file = tmp_path / "run", tmp_path / "pid"
    procs = two_agents(out, "c10d", f"127.0.0.1:{free_port()}", fault(pid_file, rank=1, step=3))
    try:
        wait_pid(pid_file, procs)
        for proc in procs:
            os.killpg(proc.pid, signal.SIGTERM)
        results = finish(*procs)
    finally:
        stop(*procs)
    text = "\n".join(t for _, t in results)
    assert [code for code, _ in results] == [75, 75], text[-4000:]
    assert "checkpoint written at step 4" in text, text[-4000:]
    assert load_checkpoint(str(out / "last.pt"))["step"] == 4
