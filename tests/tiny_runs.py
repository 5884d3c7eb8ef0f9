"""Tiny training runs shared by tests/test_export.py and tests/test_predict.py: a few steps each,
enough for a checkpoint whose predictions are not all ties (what the export checks compare)."""
import os

from conftest import shared_data
from engine.config import config_from_data

COMMON = {"seed": 0, "device": "cpu", "optim": {"name": "adamw", "lr": 0.003}, "sched": {"name": "constant"}}


def _train(out, model, data, steps=3, recipes=()):
    from engine.loop import train
    cfg = config_from_data({**COMMON, "model": model, "data": {"workers": 0, "batch_size": 8, **data},
                            "train": {"epochs": 1, "max_steps_per_epoch": steps, "log_every": 100},
                            "recipes": list(recipes)})
    train(cfg, str(out))
    return os.path.join(str(out), "last.pt")


def classifier(out):
    """MobileNetV3-Small on 32x32 built-in synthetic shapes (4 classes)."""
    return _train(out, {"name": "mobilenet_v3_small", "dropout": 0.0},
                  {"name": "synthetic_classification", "num_classes": 4, "train_size": 32, "val_size": 8,
                   "image_size": 32}, recipes=["precise_bn"])


def detector(out):
    """SSDlite at 96 px on a small built-in shapes set (written under `out`)."""
    return _train(out, {"name": "ssdlite320_mobilenet_v3_large", "size": 96, "score_thresh": 0.01,
                        "detections_per_img": 50},
                  {"name": "shapes", "root": os.path.join(str(out), "shapes"), "num_train": 16, "num_val": 4,
                   "image_size": 96}, steps=2)


def text_agnews(out):
    """A small Transformer on 400 AG_NEWS rows (../shared/data/ag_news, skips when absent)."""
    root = shared_data("ag_news")
    return _train(out, {"name": "transformer_classifier", "dim": 32, "depth": 1, "heads": 2, "ff_dim": 64},
                  {"name": "csv_text", "root": root, "train_file": "test.csv", "val_fraction": 0.25,
                   "max_rows": 400, "classes": "ag_news", "vocab_size": 500, "max_length": 48})


def audio_fsdd(out, steps=3):
    """A small audio Transformer on the FSDD spoken digits (../shared/data/fsdd, skips when absent)."""
    root = shared_data("fsdd")
    return _train(out, {"name": "transformer_classifier", "front_end": "audio", "dim": 32, "depth": 1, "heads": 2,
                        "ff_dim": 64, "n_fft": 256, "hop_length": 80, "n_mels": 32, "conv_channels": 8},
                  {"name": "audio_folder", "root": root, "sample_rate": 8000, "duration": 1.0,
                   "val_fraction": 0.1}, steps=steps)
