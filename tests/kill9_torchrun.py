"""Run: python tests/kill9_torchrun.py OUT_DIR  (about 2 minutes on 2 CPU cores)

issue 9 acceptance 2: torchrun --max-restarts=1 train.py --resume auto, rank 1 killed with kill -9
in the middle of epoch 2 (found through /proc, no test hooks); final weights vs an uninterrupted run."""
import os
import signal
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.abspath(sys.argv[1])
SET = ["data.train_size=256", "data.val_size=64", "data.image_size=32", "data.batch_size=8", "data.workers=0",
       "train.epochs=2", "train.log_every=4", "recipes=[]", "checkpoint.every_n_steps=2"]  # 16 steps an epoch
env = dict(os.environ, OMP_NUM_THREADS="1")
def cmd(out, *extra):
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *extra,
            "train.py", "--config", "configs/demo.yaml", "--output-dir", out, "--resume", "auto", "--set", *SET]
t = time.time()
subprocess.run(cmd(f"{OUT}/straight"), cwd=ROOT, env=env, check=True, capture_output=True)
print(f"uninterrupted run: {time.time() - t:.0f} s")
agent = subprocess.Popen(cmd(f"{OUT}/killed", "--max-restarts=1"), cwd=ROOT, env=env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
last = f"{OUT}/killed/last.pt"
deadline = time.time() + 600
while True:
    assert agent.poll() is None and time.time() < deadline, "the run ended before epoch 2"
    time.sleep(0.2)
    try:
        step = torch.load(last, weights_only=True)["step"]
    except Exception:
        continue
    if step >= 20:
        break
def workers():
    kids = open(f"/proc/{agent.pid}/task/{agent.pid}/children").read().split()
    return {open(f"/proc/{k}/environ").read().split("LOCAL_RANK=")[1].split("\0")[0]: int(k) for k in kids}
pid = workers()["1"]
os.kill(pid, signal.SIGKILL)
print(f"kill -9 {pid} (rank 1) after last.pt reached step {step} (epoch 2 = steps 17..32)")
out = agent.communicate()[0]
print("torchrun exit code", agent.returncode)
print("\n".join(l for l in out.splitlines() if "resumed from" in l or "exitcode" in l or "INFO epoch" in l))
a = torch.load(f"{OUT}/straight/last.pt", weights_only=True)
b = torch.load(f"{OUT}/killed/last.pt", weights_only=True)
same = all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
print(f"final step {a['step']} vs {b['step']}; all {len(a['model'])} tensors bit-identical: {same}")
print("val/top1", a["metrics"], b["metrics"])
