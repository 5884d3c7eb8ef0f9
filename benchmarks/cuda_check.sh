#!/usr/bin/env bash
# The CUDA checks, as one script for a lent GPU machine (no test needs a GPU; this is what CPU CI cannot see):
#   1. fp16 AMP with GradScaler: SSDlite trained on shapes, the checkpoint's loss scale and the eval mAP;
#   2. amp auto on CUDA: the dtype it picks, and that run's mAP;
#   3. DDP over NCCL through the project's ddp recipe (one GPU: one rank; NCCL refuses two ranks on one GPU);
#   4. timings: benchmark.py's fp32 / fp16 / bf16 x channels-last, train and inference.
#     bash benchmarks/cuda_check.sh OUT_DIR [WHEELS_DIR]
# WHEELS_DIR: wheels of requirements.txt the GPU image lacks (pip install --no-index from there).
set -u
out=${1:?OUT_DIR}; wheels=${2:-}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
if [ -n "$wheels" ]; then $py -m pip install -q --no-index --no-deps "$wheels"/*.whl 2>&1 | tail -2; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
$py -c "import torch, torchvision; print('torch', torch.__version__, 'torchvision', torchvision.__version__, torch.cuda.get_device_name())"

step() { echo; echo "== $1 ($(date +%T))"; }
common=(data.num_train=2000 data.num_val=200 data.batch_size=32 data.workers=4 train.eval_every=3 device=cuda)

step "1. fp16 AMP + GradScaler: SSDlite, shapes, 6 epochs"
timeout 150 $py train.py --config configs/shapes_demo.yaml --output-dir "$out/fp16" --set "${common[@]}" \
    train.epochs=6 recipe_args.amp.dtype=float16 2>&1 | grep -v "it/s\]" | tail -12
$py - "$out/fp16/last.pt" <<'EOF'
import sys, torch
s = torch.load(sys.argv[1], map_location="cpu", weights_only=False)
print("checkpoint scaler:", {k: s["scaler"].get(k) for k in ("scale", "_growth_tracker")}, "recipes:", s.get("config", {}).get("recipes"))
EOF
cat "$out/fp16/metrics.jsonl" 2>/dev/null | tail -2

step "2. amp auto on CUDA: SSDlite, shapes, 6 epochs"
timeout 120 $py train.py --config configs/shapes_demo.yaml --output-dir "$out/auto" --set "${common[@]}" \
    train.epochs=6 2>&1 | grep -iE "amp|AP50|error|Traceback" | grep -v "it/s\]" | tail -8

step "3. DDP over NCCL (one rank): the ddp recipe's wrapper, 20 SSDlite steps, an all_reduce"
timeout 60 $py - <<'EOF'
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
dist.init_process_group("nccl", rank=0, world_size=1)
from engine.config import load_config
from engine.build import build_model
from recipes.ddp import _DDP
from engine.build import build_data
cfg = load_config("configs/shapes_demo.yaml")
model = build_model(cfg, build_data(cfg, "/tmp")).cuda()
ddp = _DDP(model, device_ids=[0])
opt = torch.optim.AdamW(ddp.parameters(), 1e-3)
imgs = [torch.rand(3, 192, 192, device="cuda") for _ in range(16)]
tg = [{"boxes": torch.tensor([[20., 30., 90., 120.]], device="cuda"), "labels": torch.tensor([1], device="cuda")} for _ in imgs]
for i in range(20):
    loss = sum(ddp(imgs, tg).values()); opt.zero_grad(); loss.backward(); opt.step()
t = torch.ones(4, device="cuda"); dist.all_reduce(t)
print("nccl backend:", dist.get_backend(), "nccl version:", torch.cuda.nccl.version(), "last loss %.3f" % loss.item(),
      "all_reduce:", t.tolist())
dist.destroy_process_group()
EOF

step "4. timings: benchmark.py, SSDlite (shapes_demo, batch 64) and MobileNetV3-Small (demo, batch 256)"
timeout 120 $py benchmark.py --config configs/shapes_demo.yaml --set device=cuda data.batch_size=64 \
    --variants fp32,channels_last,fp16,bf16,bf16+channels_last --mode both --steps 20 --rounds 3 \
    --json "$out/bench_ssdlite.json" 2>&1 | grep -v "it/s\]" | tail -14
timeout 90 $py benchmark.py --config configs/demo.yaml --set device=cuda data.batch_size=256 \
    --variants fp32,channels_last,fp16,bf16,bf16+channels_last --mode both --steps 20 --rounds 3 \
    --json "$out/bench_mnv3.json" 2>&1 | grep -v "it/s\]" | tail -14
step "done"
