"""Run: python tests/world_size_torchrun.py OUT_DIR [transformer|mobilenet ...]  (minutes on 2 CPU cores)

issue 23 acceptance 3: a 2-process run (torchrun, gloo) killed with kill -9 in the middle of an epoch,
resumed on 1 process and on 4: the sample keys of every global step (tests/dist_helper.py's _log_ids)
against the uninterrupted 2-process run; final weights (Transformer, no BatchNorm) and held-out top-1
(MobileNetV3-Small on digits, ../shared/data/digits)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.abspath(sys.argv[1])
HELPER = os.path.join(ROOT, "tests", "dist_helper.py")
RUNS = {  # config, overrides, the step rank 1 is killed after (checkpoints every 4 steps)
    "transformer": ("configs/transformer_text_synthetic.yaml",
                    # plain batches (no length buckets: their grouping depends on the per-process batch)
                    ["model.dropout=0.0", "model.embed_dropout=0.0", "train.epochs=2", "data.bucket_batches=0"],
                    21),  # 15 steps an epoch
    "mobilenet": ("configs/mobilenet_v3_small_digits.yaml",
                  [f"data.root={os.path.join(ROOT, '..', 'shared', 'data', 'digits')}", "train.epochs=2",
                   "train.eval_every=2"], 13),  # 11 steps an epoch
}
env = dict(os.environ, OMP_NUM_THREADS="1")


def cmd(nproc, out, config, sets, resume=False):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*(launcher if nproc > 1 else [sys.executable]), HELPER, "train", "--config", config, "--output-dir", out,
            *(["--resume"] if resume else []), "--set", "data.workers=0", "checkpoint.every_n_steps=4", *sets]


def steps(folder):
    return {e["step"]: e["keys"] for e in map(json.loads, open(os.path.join(folder, "ids.jsonl")))}


for name in sys.argv[2:] or list(RUNS):
    config, sets, kill_step = RUNS[name]
    base, pid_file = os.path.join(OUT, name), os.path.join(OUT, name, "pid")
    os.makedirs(base, exist_ok=True)
    recipes = ["recipes=[channels_last, precise_bn, _log_ids, _fault]" if name == "mobilenet" else
               "recipes=[_log_ids, _fault]", f"recipe_args._fault={{kind: block, rank: 1, step: {kill_step}, pid_file: {pid_file}}}"]
    t = time.time()
    subprocess.run(cmd(2, f"{base}/straight", config, sets + recipes[:1] + ["recipe_args._fault={kind: none}"]),
                   cwd=ROOT, env=env, check=True, capture_output=True)
    print(f"{name}: uninterrupted 2-process run {time.time() - t:.0f} s", flush=True)
    os.makedirs(f"{base}/killed", exist_ok=True)  # the same tokenizer (its training is not repeatable)
    for f in os.listdir(f"{base}/straight"):
        if f.startswith("tokenizer"):
            shutil.copy(f"{base}/straight/{f}", f"{base}/killed/{f}")
    agent = subprocess.Popen(cmd(2, f"{base}/killed", config, sets + recipes), cwd=ROOT, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    while not os.path.exists(pid_file):
        assert agent.poll() is None, agent.communicate()[0][-3000:]
        time.sleep(0.1)
    pid = int(open(pid_file).read())
    os.kill(pid, signal.SIGKILL)
    agent.communicate()
    state = torch.load(f"{base}/killed/last.pt", weights_only=True)
    print(f"kill -9 {pid} (rank 1) after step {kill_step}; torchrun exit {agent.returncode}; last.pt at step "
          f"{state['step']}, epoch {state['epoch'] + 1}, batch {state['batches_done']}", flush=True)
    shutil.copytree(f"{base}/killed", f"{base}/four")
    for nproc, folder in ((1, "killed"), (4, "four")):
        r = subprocess.run(cmd(nproc, f"{base}/{folder}", config, sets + recipes, resume=True), cwd=ROOT, env=env,
                           capture_output=True, text=True)
        print("\n".join(l for l in (r.stdout + r.stderr).splitlines() if "resum" in l or "global batch" in l))
        assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    ref = steps(f"{base}/straight")
    a = torch.load(f"{base}/straight/last.pt", weights_only=True)
    for nproc, folder in ((1, "killed"), (4, "four")):
        got = steps(f"{base}/{folder}")
        same = got == ref
        b = torch.load(f"{base}/{folder}/last.pt", weights_only=True)
        rel = max(((a["model"][k].float() - b["model"][k].float()).abs().max() /
                   a["model"][k].float().abs().max().clamp_min(1e-12)).item()
                  for k in a["model"] if a["model"][k].is_floating_point())
        print(f"{name}, resumed on {nproc}: {len(ref)} global steps, sample keys of every step equal: {same}; "
              f"max relative weight difference {rel:.2e}; val {b['metrics']} vs uninterrupted {a['metrics']}",
              flush=True)
