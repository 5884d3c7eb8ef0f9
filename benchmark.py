"""Measure a config's model on this machine: precision / memory-format / compile variants, the real
training loop against a bare one, and the data loader, all in one run.

    python benchmark.py --config configs/shapes_demo.yaml [--set data.batch_size=8 ...]
    python benchmark.py --checkpoint runs/X/best.pt [--config X.yaml] [--set ...] [--force]
        [--variants fp32,channels_last,bf16,bf16+channels_last,compile,int8,inplace_abn,checkpoint]
        [--mode train|infer|both]
        [--steps 10] [--rounds 3] [--loop] [--json out.json]

Variants are tokens joined by '+': fp32 (no recipe), bf16 / fp16 (the amp recipe with that dtype),
fp32_depthwise (with bf16: depthwise convolutions kept in float32), channels_last, compile, int8 (post-training quantized copy, inference only, for quantizable
models), script (inference only, for models that trace: the TorchScript file as it is deployed; with
int8, the artifact the qat recipe / quantize.py write, saved and loaded back; else traced and frozen).
inplace_abn (the inplace_abn recipe: BatchNorm + activation pairs as InPlace-ABN) and checkpoint (the
activation_checkpointing recipe, with the config's recipe_args for it) are the memory variants.
The config's other recipes are kept; its precision and memory recipes are replaced by the variant's. With
--checkpoint, its config (with --set, under artifacts.config's policy: model, data and preprocessing
keys that differ from training's are refused unless --force) and its weights are measured.
Every figure is measured after warm-up, the variants alternating round by round, so a noisy
machine moves them all alike; the table gives the median over rounds, the spread (min-max) and the
ratio against the first variant. Peak memory is the process's peak resident set size while the
variant ran (CPU; reset between variants through /proc/self/clear_refs), or CUDA's peak allocation.
"saved for backward MB" is the activation memory of one training step: the bytes of the unique
storages autograd saves for backward (torch.autograd.graph.saved_tensors_hooks) plus the inputs
activation checkpointing keeps, parameters and buffers left out; "train step ms" is the batch over
the median samples/s, so time and memory of each variant sit in one row.

--loop also times the real training loop (loader, recipes, logging, progress bar: engine.epoch's
train_one_epoch) against a bare loop (forward, backward, step on pre-loaded batches) on the same
model, and the loader alone, and reports loop / bare and loader / training throughput.
"""
import argparse

import commands.benchmark

import datasets, models, recipes  # noqa: E401,F401  (their modules register builders)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    return commands.benchmark.add_arguments(p).parse_args(argv)


def main(argv=None):
    return commands.benchmark.main(parse_args(argv))


if __name__ == "__main__":
    main()
