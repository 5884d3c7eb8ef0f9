"""Evaluation speed against torchvision's reference: `references/detection/train.py --test-only`.

    python benchmarks/reference_eval.py --checkpoint RUN/best.pt [--config X.yaml --set ...]
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
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, SequentialSampler

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.checkpoint import load_checkpoint, load_weights  # noqa: E402
from engine.config import config_from_dict, load_config  # noqa: E402
from engine.loop import build_data, build_model, build_run, eval_streams  # noqa: E402
import datasets, models, recipes  # noqa: E401,E402,F401  (register builders)

STAT_KEYS = ("AP", "AP50", "AP75", "APs", "APm", "APl", "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="a best.pt / last.pt of train.py (a COCO-style detector)")
    p.add_argument("--config", help="YAML config (default: the config saved in the checkpoint)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE", help="override config keys")
    p.add_argument("--workers", type=int, help="reference loader workers (default: the config's data.workers)")
    p.add_argument("--compare", action="store_true", help="also time evaluate.py's path, alternating")
    p.add_argument("--streams", type=int, help="batches evaluate.py runs at once on CPU (default: one per thread; "
                   "1: one stream on the intra-op threads)")
    p.add_argument("--rounds", type=int, default=1, help="passes per path (alternating with --compare)")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args(argv)


def load(args):
    """The checkpoint and its config, as evaluate.py takes them (--config, or the saved one with --set)."""
    from evaluate import check_config_against_checkpoint, saved_config_with
    state = load_checkpoint(args.checkpoint)
    if args.config:
        cfg = load_config(args.config, args.set)
    else:
        cfg = config_from_dict(state["config"])
        cfg = saved_config_with(cfg, args.set) if args.set else cfg
    args.force = False
    check_config_against_checkpoint(cfg, state, args)
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
    load_weights(model, state["model"], path, cfg.checkpoint.strict)
    return model.eval()


# ---------------------------------------------------------------- this project's path

def project_pass(run, streams=None):
    from evaluate import timed_evaluation
    _, report = timed_evaluation(run.model, run, streams)
    speed = report["speed"]
    return speed["total_s"], {k: report["metrics"][f"bbox/{k}"] for k in STAT_KEYS}, speed


def main(argv=None):
    args = parse_args(argv)
    cfg, state = load(args)
    with tempfile.TemporaryDirectory() as workdir:
        data = build_data(cfg, workdir)
        n = len(data.val)
        evaluator = data.evaluator()
        coco_gt, label_to_cat = evaluator.coco_gt, evaluator.label_to_cat
        workers = cfg.data.workers if args.workers is None else args.workers
        ref = reference_model(cfg, data, state, args.checkpoint)
        run = None
        if args.compare:
            run = build_run(cfg, workdir, data=data)
            load_weights(run.model, state["model"], args.checkpoint, cfg.checkpoint.strict)
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
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
