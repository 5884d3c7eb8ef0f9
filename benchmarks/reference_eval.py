"""Evaluation speed against torchvision's reference: `references/detection/train.py --test-only`.

    python -m benchmarks.reference_eval --checkpoint RUN/best.pt [--config X.yaml --set ... [--force]]
        [--compare] [--rounds 2] [--workers N] [--json out.json]

The reference path, as torchvision's engine.evaluate runs it (rewritten here, not copied):
torch.set_num_threads(1), a test loader of batch size 1 (sequential), model.eval() under
inference_mode, per batch a forward, the outputs moved to the CPU, their detections in COCO
results format loaded with pycocotools' loadRes and scored by COCOeval.evaluate for the batch's
images (the per-image tables kept), then all tables merged, accumulate() and summarize() at the
end. The model is the plain one of the registry with the checkpoint's weights (no recipes).

--compare also runs this project's evaluation path (evaluate.py: the config's eval loader, recipes
and evaluator, default threads) on the same checkpoint and val images, alternating with the
reference round by round in one process, and prints both images/s (inference + scoring, over the
whole pass), their ratio and whether the 12 COCO stats are identical.
"""
import argparse
import contextlib
import copy
import io
import os
import statistics
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, SequentialSampler

from commands.evaluate import timed_run_evaluation
from artifacts.load import open_checkpoint
from engine.build import build_data, build_model, build_run
from engine.checkpoint import load_model_state
from commands.cli import add_checkpoint_options, run_or_exit
from engine.evaluation import eval_streams
from engine.files import write_json

import datasets, models, recipes  # noqa: E401,F401  (register builders)

STAT_KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_checkpoint_options(p, "compare", "a best.pt / last.pt of train.py (a COCO-style detector)")
    p.add_argument("--workers", type=int, help="reference loader workers (default: the config's data.workers)")
    p.add_argument("--compare", action="store_true", help="also time evaluate.py's path, alternating")
    p.add_argument("--streams", type=int, help="batches evaluate.py runs at once on CPU (default: one per thread; "
                   "1: one stream on the intra-op threads)")
    p.add_argument("--rounds", type=int, default=1, help="passes per path (alternating with --compare)")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def load(args):
    """The checkpoint and its config, as evaluate.py takes them (artifacts.config)."""
    state, cfg = open_checkpoint(args.checkpoint, args.config, args.set, args.force)
    return cfg, state


# ---------------------------------------------------------------- torchvision's reference path

@contextlib.contextmanager
def quiet():
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def coco_results(outputs, label_to_cat):
    """{image_id: output} -> detections in COCO results format ([x, y, w, h], category ids)."""
    results = []
    for image_id, out in outputs.items():
        boxes = out["boxes"].clone()
        boxes[:, 2:] -= boxes[:, :2]
        results += [{"image_id": image_id, "category_id": label_to_cat[label], "bbox": box, "score": score}
                    for box, score, label in zip(boxes.tolist(), out["scores"].tolist(), out["labels"].tolist())]
    return results


@torch.inference_mode()
def reference_pass(model, dataset, collate_fn, coco_gt, label_to_cat, workers):
    """One pass as torchvision's engine.evaluate: -> (seconds, 12 stats, seconds of them scoring)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        loader = DataLoader(dataset, batch_size=1, sampler=SequentialSampler(dataset), num_workers=workers,
                            collate_fn=collate_fn)
        model.eval()
        gt = copy.deepcopy(coco_gt)
        scorer = COCOeval(gt, iouType="bbox")
        img_ids, tables, scoring = [], [], 0.0
        for images, targets in loader:
            outputs = model(list(images))
            outputs = [{k: v.to("cpu") for k, v in o.items()} for o in outputs]
            batch = {int(t["image_id"]): o for t, o in zip(targets, outputs)}  # a tensor in torchvision, an int here
            tick = time.perf_counter()
            ids = list(np.unique(list(batch)))
            img_ids += ids
            results = coco_results(batch, label_to_cat)
            with quiet():
                scorer.cocoDt = gt.loadRes(results) if results else COCO()
                scorer.params.imgIds = ids
                scorer.evaluate()
            p = scorer.params
            tables.append(np.asarray(scorer.evalImgs).reshape(len(p.catIds), len(p.areaRng), len(p.imgIds)))
            scoring += time.perf_counter() - tick
        tick = time.perf_counter()
        ids, index = np.unique(img_ids, return_index=True)
        scorer.evalImgs = list(np.concatenate(tables, 2)[..., index].flatten())
        scorer.params.imgIds = list(ids)
        scorer._paramsEval = copy.deepcopy(scorer.params)
        with quiet():
            scorer.accumulate()
            scorer.summarize()
        done = time.perf_counter()
        return done - start, dict(zip(STAT_KEYS, map(float, scorer.stats))), scoring + done - tick
    finally:
        torch.set_num_threads(threads)


def reference_model(cfg, data, state, path):
    model = build_model(cfg, data)
    load_model_state(model, state["model"], path, cfg.checkpoint.strict)
    return model.eval()


# ---------------------------------------------------------------- this project's path

def project_pass(run, streams=None):
    _, report = timed_run_evaluation(run.model, run, streams)
    speed = report["speed"]
    return speed["total_s"], {k: report["metrics"][f"bbox/{k}"] for k in STAT_KEYS}, speed


def main(argv=None):
    args = parse_args(argv)
    cfg, state = run_or_exit(load, args)
    with tempfile.TemporaryDirectory() as workdir:
        data = build_data(cfg, workdir)
        n = len(data.val)
        evaluator = data.evaluator()
        coco_gt, label_to_cat = evaluator.coco_gt, evaluator.label_to_cat
        workers = cfg.data.workers if args.workers is None else args.workers
        ref = reference_model(cfg, data, state, args.checkpoint)
        run = None
        if args.compare:
            run = build_run(cfg, workdir, data=data, recipe_states=state.get("recipes"), inference=True)
            load_model_state(run.model, state["model"], args.checkpoint, cfg.checkpoint.strict)
        rates = {"reference": [], "project": []}
        stats, parts = {}, []
        for r in range(args.rounds):
            seconds, stats["reference"], scoring = reference_pass(ref, data.val, data.collate_fn, coco_gt,
                                                                  label_to_cat, workers)
            rates["reference"].append(n / seconds)
            line = f"round {r + 1}: reference {n / seconds:.2f} images/s ({seconds:.1f} s, scoring {scoring:.1f} s)"
            if run is not None:
                seconds, stats["project"], speed = project_pass(run, args.streams)
                rates["project"].append(n / seconds)
                parts.append(speed)
                line += (f", project {n / seconds:.2f} images/s ({seconds:.1f} s: inference {speed['inference_s']:.1f} s, "
                         f"scoring {speed['scoring_s']:.1f} s), ratio {rates['project'][-1] / rates['reference'][-1]:.2f}")
            print(line, flush=True)
    result = {"checkpoint": os.path.abspath(args.checkpoint), "images": n, "reference_workers": workers,
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "reference_images_per_s": rates["reference"], "reference_stats": stats["reference"]}
    print(f"\n{n} val images, {cfg.model.name} at {cfg.model.model_extra.get('size', '?')} px")
    print(f"reference (batch 1, 1 thread): {statistics.median(rates['reference']):.2f} images/s (median of {args.rounds})")
    if run is not None:
        ratios = [a / b for a, b in zip(rates["project"], rates["reference"])]
        identical = stats["project"] == stats["reference"]
        streams = args.streams or eval_streams(run.model, run.device, run.recipes, run)
        print(f"project (evaluate.py, batch {run.val_loader.batch_size}, {torch.get_num_threads()} threads, "
              f"{streams} stream(s)): "
              f"{statistics.median(rates['project']):.2f} images/s; ratio {statistics.median(ratios):.2f} "
              f"(per round {', '.join(f'{x:.2f}' for x in ratios)})")
        print(f"12 COCO stats identical: {identical}")
        if not identical:
            for k in STAT_KEYS:
                print(f"  {k:6s} reference {stats['reference'][k]:.6f}  project {stats['project'][k]:.6f}")
        result.update(project_images_per_s=rates["project"], project_stats=stats["project"], ratios=ratios,
                      stats_identical=identical, project_speed=parts)
    print("stats: " + "  ".join(f"{k} {v:.4f}" for k, v in stats["reference"].items()))
    if args.json:
        write_json(args.json, result, indent=2)
    return result


if __name__ == "__main__":
    main()
