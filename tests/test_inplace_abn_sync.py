"""InPlaceABNSync under torchrun --nproc_per_node=2 (gloo) with unequal and zero per-process batches
equals one process's BatchNorm over the concatenated batch (issue 21, acceptance 2).

Run by the test as a real 2-process job: python -m torch.distributed.run ... tests/test_inplace_abn_sync.py
"""
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPLITS = [(3, 1), (0, 4), (4, 0)]  # samples on rank 0, rank 1


def worker():
    import torch.distributed as tdist
    sys.path.insert(0, ROOT)
    from models.inplace_abn import InPlaceABN, InPlaceABNSync, SyncBatchNormCPU

    tdist.init_process_group("gloo")
    rank = tdist.get_rank()
    worst = 0.0
    cases = [(InPlaceABNSync, InPlaceABN, dict(activation="leaky_relu", activation_param=0.01)),
             (InPlaceABNSync, InPlaceABN, dict(activation="elu", activation_param=1.0)),
             (SyncBatchNormCPU, torch.nn.BatchNorm2d, {})]
    for sync_cls, single_cls, kwargs in cases:
        for split in SPLITS:
            torch.manual_seed(0)
            single, synced = single_cls(5, **kwargs), sync_cls(5, **kwargs)
            with torch.no_grad():
                single.weight.uniform_(0.5, 1.5), single.bias.normal_()
            synced.load_state_dict(single.state_dict())
            start = split[0] * rank
            for step in range(3):  # running statistics over several steps
                x = torch.randn(sum(split), 5, 6, 6) * (step + 1) + step
                grad = torch.randn(sum(split), 5, 6, 6)
                xs, xl = x.clone().requires_grad_(), x[start:start + split[rank]].clone().requires_grad_()
                ys, yl = single(xs * 1), synced(xl * 1)
                (ys * grad).sum().backward()
                (yl * grad[start:start + split[rank]]).sum().backward()
                pairs = [(yl, ys[start:start + split[rank]]), (xl.grad, xs.grad[start:start + split[rank]])]
                for p_single, p_sync in ((single.weight, synced.weight), (single.bias, synced.bias)):
                    total = p_sync.grad.clone()
                    tdist.all_reduce(total)  # per-process parameter gradients, summed as DDP does (x world)
                    pairs.append((total, p_single.grad))
                    p_single.grad = p_sync.grad = None
                pairs += [(synced.running_mean, single.running_mean), (synced.running_var, single.running_var)]
                for got, want in pairs:
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                    if got.numel():
                        worst = max(worst, (got - want).abs().max().item())
    if rank == 0:
        print(f"max abs difference {worst:.2e} over {len(cases) * len(SPLITS)} cases x 3 steps")
    tdist.destroy_process_group()


def test_sync_equals_single_process_batchnorm_with_unequal_and_empty_batches():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "max abs difference" in result.stdout


def test_torchrun_trains_with_inplace_abn_sync_checkpointing_and_ddp(tmp_path):
    """The recipes composed under a real 2-process job: synchronized InPlace-ABN, checkpointed stages, DDP."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           os.path.join(ROOT, "train.py"), "--config", os.path.join(ROOT, "tests", "configs", "tiny.yaml"),
           "--output-dir", str(tmp_path), "--set", "train.epochs=1",
           "recipes=[inplace_abn_sync,activation_checkpointing,ddp]", "recipe_args.ddp.find_unused_parameters=true"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "(2 processes)" in out and "(statistics over all processes)" in out
    assert "activation_checkpointing: 13 module(s)" in out
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state["model"])  # the saved weights load into the plain model


if __name__ == "__main__":
    worker()
