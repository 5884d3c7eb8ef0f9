"""Evaluation: each task's evaluator (an engine.evaluation.Evaluator), its analysis sections, its
results scorer (registered in engine.registry.SCORERS) and the comparison of reports.

| module | what |
|---|---|
| classification.py | top-1 / top-5, per class, confusion matrix (images, text, audio) |
| coco.py | COCOeval (bbox, segm), per-category AP, drawn boxes; the `--coco-*` scorer |
| segmentation.py | mIoU, pixel accuracy, per class |
| panoptic.py | PQ, SQ, RQ (things, stuff, per class); the `--panoptic-*` scorer; panoptic_ids.py: the PNG codec |
| *_analysis.py, calibration.py | the sections a report shows beyond its numbers (docs/evaluation.md) |
| compare.py | `evaluate.py --compare` |

Imports only engine/ (the report format is engine/report/); data sets build their evaluators from here.
"""
