"""Several torchrun agents on this host, as several machines would run them (tests/test_multinode.py):
launch.py agents over loopback, an etcd server of our own, a worker or a whole agent killed with kill -9."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPER = os.path.join(ROOT, "tests", "dist_helper.py")
TINY = os.path.join(ROOT, "tests", "configs", "tiny.yaml")
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port, host="127.0.0.1"):
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def agent(out, *overrides, backend="c10d", endpoint, nnodes="2", run_id="job", launcher=(), flags=("--resume", "auto"),
          torchrun=False):
    """One launch.py agent (`torchrun`: plain torchrun's) with one worker, in a process group of its own, as on a
    machine of its own."""
    script = ["-m", "torch.distributed.run"] if torchrun else [os.path.join(ROOT, "launch.py")]
    cmd = [sys.executable, *script, f"--nnodes={nnodes}", "--nproc_per_node=1",
           f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}", *launcher,
           HELPER, "train", "--config", TINY, "--output-dir", str(out), *flags, "--set", *overrides]
    log = tempfile.TemporaryFile("w+")  # not a pipe: an agent that writes much never blocks on it
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, text=True, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    proc.log = log
    return proc


def output(proc):
    """What an agent (and its workers) wrote so far."""
    proc.log.seek(0)
    return proc.log.read()


def children(pid):
    """The pids of a process's children (its workers, for an agent)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            found += [int(p) for p in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except FileNotFoundError:
            pass
    return found


def parent(pid):
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])


def kill_machine(proc):
    """kill -9 of an agent and its workers at once (torchrun starts each worker in a session of its own):
    the machine is gone."""
    workers = children(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def stop(*procs):
    """What a test leaves running is killed, whatever the test's outcome; each one's output."""
    for proc in procs:
        if proc.poll() is None:
            kill_machine(proc)
        proc.wait(timeout=60)
    return [output(proc) for proc in procs]


class Etcd:
    """An etcd 3.4 server with its v2 API (torchrun's etcd-v2 backend) on free ports, its data in `folder`."""

    def __init__(self, folder):
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        url, peer_url = f"http://{self.endpoint}", f"http://127.0.0.1:{peer}"
        self.log = open(os.path.join(folder, "etcd.log"), "w")
        self.proc = subprocess.Popen([shutil.which("etcd"), "--enable-v2", "--data-dir", os.path.join(folder, "etcd"),
                                      "--name", "test", "--listen-client-urls", url, "--advertise-client-urls", url,
                                      "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                                      "--initial-cluster", f"test={peer_url}"],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 30
        while not listening(self.port):
            assert self.proc.poll() is None and time.time() < deadline, open(self.log.name).read()[-2000:]
            time.sleep(0.1)

    def close(self):
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()
