"""Eval-mode speed of transformer_classifier with PyTorch's Transformer fast path on vs off.

    python -m benchmarks.transformer_fastpath [--batch-size 64] [--max-len 256] [--dim 128] [--depth 2]
                                              [--heads 4] [--repeats 15] [--threads N] [--device cpu]

The same model and the same padded batches are timed both ways in one process, interleaved:
  fast: `fast_path=True` - fused encoder-layer kernels and, because the batch has a key
        padding mask, a nested tensor: padded positions cost no compute;
  slow: `fast_path=False` - the regular autograd-capable modules (torch.backends.mha fast path off).
  fused, no nested: the fused layer kernels on the padded tensor (nested tensors off), to split the effect.
Two batch shapes: ragged lengths (uniform 8..max-len, the usual padded text batch) and full length
(no padding: only the fused kernels differ). Prints median milliseconds per batch and the ratio.
"""
import argparse
import statistics
import time

import torch

from engine.registry import MODELS

import models  # noqa: F401  (registers the builders)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=12000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ff-dim", type=int, default=256)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def batch_of(lengths, max_len, vocab, gen):
    tokens = torch.zeros(len(lengths), max_len, dtype=torch.long)
    for i, n in enumerate(lengths):
        tokens[i, :n] = torch.randint(1, vocab, (n,), generator=gen)
    return tokens[:, : max(lengths)]


def timed(model, tokens, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = model(tokens)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


VARIANTS = {  # name -> (model.fast_path, encoder.use_nested_tensor)
    "fast path": (True, True),          # fused layers + nested tensor
    "fused, no nested": (True, False),  # fused layers on the padded tensor
    "disabled": (False, False),         # regular modules (SDPA attention)
}


def _set(model, variant):
    model.fast_path, model.encoder.use_nested_tensor = VARIANTS[variant]


@torch.no_grad()
def compare(model, tokens, repeats, device):
    """Median ms per batch for each variant (interleaved) and the max logit difference to 'disabled'."""
    tokens = tokens.to(device)
    nested = model.encoder.use_nested_tensor
    times, outs = {v: [] for v in VARIANTS}, {}
    for v in VARIANTS:  # warm-up
        _set(model, v)
        outs[v] = model(tokens)
    for _ in range(repeats):
        for v in VARIANTS:
            _set(model, v)
            times[v].append(timed(model, tokens, device)[0])
    model.fast_path, model.encoder.use_nested_tensor = "auto", nested
    diff = max((outs[v] - outs["disabled"]).abs().max().item() for v in VARIANTS)
    return {v: statistics.median(t) * 1e3 for v, t in times.items()}, diff


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = MODELS.build("transformer_classifier", num_classes=4, vocab_size=args.vocab_size, dim=args.dim,
                         depth=args.depth, heads=args.heads, ff_dim=args.ff_dim, max_len=args.max_len).to(device).eval()
    if not model.encoder.use_nested_tensor:
        print("note: nested tensors are off for this model (norm_first or odd heads)")
    gen = torch.Generator().manual_seed(args.seed)
    ragged = torch.randint(8, args.max_len + 1, (args.batch_size,), generator=gen).tolist()
    ragged[0] = args.max_len
    cases = {"ragged": ragged, "full": [args.max_len] * args.batch_size}
    print(f"transformer_classifier dim={args.dim} depth={args.depth} heads={args.heads} ff={args.ff_dim}, "
          f"batch {args.batch_size} x {args.max_len}, device {device}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, median of {args.repeats}")
    ratios = {}
    for name, lengths in cases.items():
        tokens = batch_of(lengths, args.max_len, args.vocab_size, gen)
        fill = sum(lengths) / (len(lengths) * tokens.shape[1])
        ms, diff = compare(model, tokens, args.repeats, device)
        ratios[name] = ms["disabled"] / ms["fast path"]
        print(f"{name:>6} batch (tokens / padded slots {fill:.2f}): " + "   ".join(f"{v} {t:.1f} ms" for v, t in ms.items())
              + f"   max |logit diff| {diff:.1e}")
    print("fast-path ratio, time disabled / time fast path (> 1: the fast path is faster): "
          + ", ".join(f"{k} x{r:.2f}" for k, r in ratios.items()))
    return ratios


if __name__ == "__main__":
    main()
