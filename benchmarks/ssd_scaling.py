"""SSDlite's training step at several input sizes, in one job: where the time goes as model.size grows.

    python -m benchmarks.ssd_scaling [--sizes 192,320,512] [--batch-size 16] [--steps 3] [--rounds 2]
                                     [--channels-last | --no-channels-last] [--profile 512] [--threads N]
                                     [--clock wall|cpu] [--json out.json]

The model is configs/shapes_demo.yaml's (SSDlite-MobileNetV3, fp32 + channels-last: what amp auto
chooses on small CPUs) at each model.size, trained with AdamW on the same batch of built-in shapes
images (192 px, resized by the model). The sizes alternate round by round (a busy machine moves them
alike). Each step is split into its phases: the model's transform (normalize + resize), backbone,
head, default boxes, matching (box IoU + matcher), loss (encoding, cross-entropy, hard negative
mining), backward, optimizer step. --profile SIZE: torch.profiler's top operators of two steps at
that size and the smallest one, with the ratio per operator.
"""
import argparse
import contextlib
import json
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile
import torchvision.models.detection.ssd as ssd_module
import torchvision.ops.boxes as box_ops

from engine.build import build_data, build_loaders, build_model, keep_freed_memory
from engine.config import load_config
from engine.optim import build_optimizer
from recipes.channels_last import model_to_channels_last, to_channels_last

import datasets, models  # noqa: E401,F401  (their modules register builders)

clock = time.perf_counter
PHASES = ("transform", "backbone", "head", "anchors", "matching", "loss", "backward", "optimizer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/shapes_demo.yaml")
    p.add_argument("--sizes", default="192,320,512")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=3, help="timed steps per size and round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--profile", type=int, help="profile two steps at this size (and at the smallest)")
    p.add_argument("--set", nargs="*", default=[], help="more config overrides (e.g. data.root=...)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time "
                   "(time.process_time), steadier than wall time on a shared machine with --threads 1")
    p.add_argument("--json")
    return p.parse_args(argv)


class PhaseTimer:
    """Seconds spent in each wrapped callable of the model (inclusive), per step."""

    def __init__(self):
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def wrap(self, obj, attr, phase):
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[phase] += clock() - start
        setattr(obj, attr, timed)

    @contextlib.contextmanager
    def phase(self, name):
        start = clock()
        yield
        self.seconds[name] += clock() - start


def build(cfg, size, data, channels_last):
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"size": size})})
    torch.manual_seed(0)
    model = build_model(cfg, data).train()
    if channels_last:
        model = model_to_channels_last(model)
    timer = PhaseTimer()
    timer.wrap(model.transform, "forward", "transform")
    timer.wrap(model.backbone, "forward", "backbone")
    timer.wrap(model.head, "forward", "head")
    timer.wrap(model.anchor_generator, "forward", "anchors")
    timer.wrap(model, "proposal_matcher", "matching")  # called on box_iou's matrix: box_iou counts as "matching" below
    timer.wrap(model, "compute_loss", "loss")
    return model, build_optimizer(model, cfg.optim), timer, ssd_module


def step(model, optimizer, timer, batch, channels_last):
    inputs, targets = batch
    inputs = to_channels_last(inputs) if channels_last else inputs
    losses = model(inputs, targets)
    with timer.phase("backward"):
        sum(losses.values()).backward()
    with timer.phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def main(argv=None):
    global clock
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc = keep_freed_memory()  # as train.py's build_run does on CPU (ZOO_MALLOC=system: not)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as workdir:
        cfg = load_config(args.config, [f"data.batch_size={args.batch_size}", "data.workers=0", *args.set])
        data = build_data(cfg, workdir)
        batch = next(iter(build_loaders(cfg, data, 0)[0]))
    print(f"{cfg.model.name}, batch {args.batch_size} of {cfg.data.name} images "
          f"({', '.join(sorted({'x'.join(map(str, x.shape[-2:])) for x in batch[0]}))}), "
          f"{'channels-last' if args.channels_last else 'contiguous'} fp32, {torch.get_num_threads()} threads, "
          f"{args.clock} clock, malloc {'keeps freed memory' if malloc else 'as the system has it'}, "
          f"torch {torch.__version__}", flush=True)
    runs = {s: build(cfg, s, data, args.channels_last) for s in sizes}
    iou_seconds = {"size": None, "s": 0.0}
    original_iou = box_ops.box_iou

    def timed_iou(a, b):  # SSD.forward's box_iou of targets against default boxes, before the matcher
        start = clock()
        try:
            return original_iou(a, b)
        finally:
            if iou_seconds["size"] is not None:
                runs[iou_seconds["size"]][2].seconds["matching"] += clock() - start
    for s in sizes:
        runs[s][3].box_ops.box_iou = timed_iou
    step_times = {s: [] for s in sizes}
    phases = {s: {p: [] for p in PHASES} for s in sizes}
    for s in sizes:  # warm-up
        iou_seconds["size"] = s
        for _ in range(2):
            step(*runs[s][:3], batch, args.channels_last)
    for _ in range(args.rounds):
        for s in sizes:
            model, optimizer, timer, _ = runs[s]
            iou_seconds["size"] = s
            for _ in range(args.steps):
                timer.seconds = dict.fromkeys(PHASES, 0.0)
                start = clock()
                step(model, optimizer, timer, batch, args.channels_last)
                step_times[s].append(clock() - start)
                for p in PHASES:
                    phases[s][p].append(timer.seconds[p])
    anchors = {s: int(sum(runs[s][0].anchor_generator.num_anchors_per_location()[i] * n * n
                          for i, n in enumerate(feature_sizes(runs[s][0], s)))) for s in sizes}
    table = ["| size | pixels vs first | s/step (median, min-max) | vs previous size | default boxes | "
             + " | ".join(PHASES) + " |", "|---" * (5 + len(PHASES)) + "|"]
    prev = None
    for s in sizes:
        med = statistics.median(step_times[s])
        phase_cells = [f"{statistics.median(phases[s][p]):.3f}" for p in PHASES]
        table.append(f"| {s} | {s * s / sizes[0] ** 2:.2f}x | {med:.2f} ({min(step_times[s]):.2f}-"
                     f"{max(step_times[s]):.2f}) | {'-' if prev is None else f'{med / prev:.2f}x for {(s / sp) ** 2:.2f}x pixels'}"
                     f" | {anchors[s]} | " + " | ".join(phase_cells) + " |")
        prev, sp = med, s
    print("\n".join(table), flush=True)
    result = {"clock": args.clock, "keep_freed_memory": malloc, "sizes": sizes, "step_s": step_times, "phases_s": phases, "default_boxes": anchors,
              "threads": torch.get_num_threads(), "torch": torch.__version__}
    if args.profile:
        iou_seconds["size"] = None
        tops = {}
        for s in dict.fromkeys([sizes[0], args.profile]):
            model, optimizer, timer, _ = runs[s] if s in runs else build(cfg, s, data, args.channels_last)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    step(model, optimizer, timer, batch, args.channels_last)
            tops[s] = {e.key: e.self_cpu_time_total / 2e6 for e in prof.key_averages()}
        big, small = tops[args.profile], tops[sizes[0]]
        total_big, total_small = sum(big.values()), sum(small.values())
        print(f"\nprofile: self CPU s/step, {args.profile} px (total {total_big:.2f}) vs {sizes[0]} px "
              f"(total {total_small:.2f}); pixels x{(args.profile / sizes[0]) ** 2:.2f}")
        print("| operator | s/step at %d | share | s/step at %d | ratio |" % (args.profile, sizes[0]))
        print("|---|---|---|---|---|")
        for name, sec in sorted(big.items(), key=lambda kv: -kv[1])[:20]:
            lo = small.get(name, 0.0)
            print(f"| {name} | {sec:.3f} | {sec / total_big:.1%} | {lo:.3f} | "
                  f"{sec / lo if lo else float('nan'):.1f}x |")
        result["profile"] = tops
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


def feature_sizes(model, size):
    """The feature map sides of the SSD head at this input size (one forward of a zero image)."""
    model.eval()
    with torch.no_grad():
        features = model.backbone(torch.zeros(1, 3, size, size))
    model.train()
    return [f.shape[-1] for f in features.values()]


if __name__ == "__main__":
    main()
