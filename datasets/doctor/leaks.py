"""Duplicates within a split and leaks across splits: equal content hashes (file bytes, a normalised
text, decoded audio samples), near-duplicate images (64-bit perceptual hashes within
doctor.near_duplicate_bits bits of each other) and, for images under MIN_PHASH_SIZE px (digits, MNIST),
resized copies found by resizing one image to the other's size (small_pairs). Only hashes are kept per
sample, and the grey pixels of the small images (under 1 KB each)."""
import math
from collections import defaultdict

import numpy as np

from datasets.base import read_image
from datasets.doctor.findings import WARNING, Finding
from datasets.doctor.sources import MIN_PHASH_SIZE

CHUNK = 2048  # rows of the distance matrix computed at once (CHUNK x n bytes)
POOL_MAX = 64  # a small image is compared with the images up to this many px a side (its resized copies)
TOLERANCE = 0.1  # RMS difference of two z-scored grey images (in standard deviations) at most for a near-duplicate
COARSE = 8  # px a side of the prefilter's block averages
FLAT = 1.0  # grey standard deviation under which an image is flat (not z-scored; exact hashes only)
MAX_SHAPES = 16  # sizes compared with each other (the most common; the images of the others are counted)
# the resamplers a copy is likely made with: PIL's (what torchvision uses on PIL images; OpenCV's linear
# upscaling is the same) and the floor-index nearest of OpenCV and torch
FILTERS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming", "nearest-floor")


def exact_groups(keys):
    """[[sample ids]] of two or more samples with the same key (None keys ignored)."""
    groups = defaultdict(list)
    for sample, key in keys:
        if key is not None:
            groups[key].append(sample)
    return [g for g in groups.values() if len(g) > 1]


def near_pairs(samples, hashes, bits):
    """[(a, b, distance)] of the samples whose hashes differ by at most `bits` bits (a before b),
    computed chunk by chunk."""
    if len(hashes) < 2:
        return []
    h = np.array(hashes, dtype=np.uint64)
    out = []
    for start in range(0, len(h), CHUNK):
        block = h[start:start + CHUNK]
        distance = np.bitwise_count(block[:, None] ^ h[None, :])
        rows, cols = np.nonzero(distance <= bits)
        for r, c in zip(rows.tolist(), cols.tolist()):
            if start + r < c:
                out.append((samples[start + r], samples[c], int(distance[r, c])))
    return out


def _kernel(how):
    """(support, function) of PIL's resampling filter `how` (Pillow's libImaging/Resample.c)."""
    def sinc(x):
        return 1.0 if x == 0 else math.sin(math.pi * x) / (math.pi * x)

    def hamming(x):
        x = abs(x) * math.pi
        return 1.0 if x == 0 else 0.0 if x >= math.pi else math.sin(x) / x * (0.54 + 0.46 * math.cos(x))

    def bicubic(x, a=-0.5):
        x = abs(x)
        return ((a + 2) * x - (a + 3)) * x * x + 1 if x < 1 else (((x - 5) * x + 8) * x - 4) * a if x < 2 else 0.0
    return {"box": (0.5, lambda x: 1.0 if -0.5 < x <= 0.5 else 0.0), "bilinear": (1.0, lambda x: max(0.0, 1 - abs(x))),
            "hamming": (1.0, hamming), "bicubic": (2.0, bicubic),
            "lanczos": (3.0, lambda x: sinc(x) * sinc(x / 3) if -3 < x < 3 else 0.0)}[how]


def _weights(n_in, n_out, how):
    """[n_out, n_in] weights of one axis of PIL's resize with filter `how` (as Resample.c computes them)."""
    support, f = _kernel(how)
    scale = n_in / n_out
    stretch = max(scale, 1.0)
    support *= stretch
    w = np.zeros((n_out, n_in))
    for o in range(n_out):
        center = (o + 0.5) * scale
        lo, hi = max(int(center - support + 0.5), 0), min(int(center + support + 0.5), n_in)
        row = np.array([f((x - center + 0.5) / stretch) for x in range(lo, hi)])
        w[o, lo:hi] = row / row.sum()
    return w


def _nearest(n_in, n_out, floor=False):
    """Source indices of a nearest-neighbour resize: PIL's (pixel centres, its running sum) or floor(i * scale)."""
    if floor:  # OpenCV's and torch's
        return np.arange(n_out) * n_in // n_out
    step, v, out = n_in / n_out, n_in / n_out * 0.5, []
    for _ in range(n_out):
        out.append(min(int(v), n_in - 1))
        v += step
    return np.array(out)


def resize(images, size, how):
    """[n, h, w] uint8 grey images resized to size (w, h) with one of FILTERS, all at once: PIL's result to
    within 2 grey levels (its two passes, horizontal first, rounded and clipped in between)."""
    w, h = size
    if how.startswith("nearest"):
        floor = how != "nearest"
        ys, xs = _nearest(images.shape[1], h, floor), _nearest(images.shape[2], w, floor)
        return images[:, ys[:, None], xs[None, :]].astype(np.float32)
    across = np.clip(np.rint(images.astype(np.float64) @ _weights(images.shape[2], w, how).T), 0, 255)
    return np.clip(np.rint(_weights(images.shape[1], h, how) @ across), 0, 255).astype(np.float32)


def _area(n_in, n_out):
    """[n_out, n_in] exact area averaging (rows sum to 1, columns to n_out / n_in)."""
    edges = np.arange(n_out + 1) * n_in / n_out
    x = np.arange(n_in)
    overlap = np.clip(np.minimum(x[None, :] + 1, edges[1:, None]) - np.maximum(x[None, :], edges[:-1, None]), 0, None)
    return overlap * n_out / n_in


def _zscored(images):
    """[n, h, w] float32 -> (z-scored [n, h*w], their COARSE x COARSE area averages [n, k], mask of the
    images that are not flat). The averages' RMS difference is never more than the full images' (Jensen)."""
    n, h, w = images.shape
    x = images.reshape(n, -1)
    std = x.std(1)
    ok = std >= FLAT
    z = ((x - x.mean(1, keepdims=True)) / np.where(ok, std, 1)[:, None]).astype(np.float32)
    rows, cols = _area(h, min(COARSE, h)).astype(np.float32), _area(w, min(COARSE, w)).astype(np.float32)
    coarse = rows @ (z.reshape(n, h, w) @ cols.T)
    return z, coarse.reshape(n, -1), ok


def _close(za, ca, zb, cb, tolerance, same):
    """[(i, j, rms)] of the rows of za and zb (z-scored, one shape) within `tolerance` RMS, the coarse
    averages first (a pair they put further apart cannot be within it). same: za is zb (i < j only)."""
    out = []
    nb = (cb ** 2).sum(1)
    for start in range(0, len(ca), CHUNK):
        block = ca[start:start + CHUNK]
        d = ((block ** 2).sum(1)[:, None] + nb[None, :] - 2 * block @ cb.T) / ca.shape[1]
        rows, cols = np.nonzero(d <= tolerance ** 2 + 1e-4)  # + float32 rounding
        for r, c in zip(rows.tolist(), cols.tolist()):
            i = start + r
            if same and i >= c:
                continue
            rms = float(np.sqrt(np.mean((za[i] - zb[c]) ** 2)))
            if rms <= tolerance:
                out.append((i, c, rms))
    return out


def small_pairs(items, tolerance=TOLERANCE):
    """Near-duplicates among small images, which have no useful perceptual hash.

    items: [(sample, uint8 grey array)] of the small images (under MIN_PHASH_SIZE px a side) and of the
    images up to POOL_MAX px. Images of one size are compared as they are; of two sizes, each image of
    one is resized to the other's size with each of FILTERS, both ways (a copy made with one of them
    then matches to rounding). Grey levels are z-scored (brightness and contrast do not count); a pair
    is a near-duplicate when they differ by at most `tolerance` standard deviations (RMS).
    -> ([(a, b, rms, how)], at least one of a and b small, a before b; images left out: more than
    MAX_SHAPES sizes, only those of the most common are compared)."""
    groups = defaultdict(list)
    for sample, grey in items:
        groups[grey.shape].append((sample, grey))
    shapes = sorted(groups, key=lambda s: (-len(groups[s]), s))
    left_out = sum(len(groups[s]) for s in shapes[MAX_SHAPES:])
    shapes = shapes[:MAX_SHAPES]
    small = {s for s in shapes if min(s) < MIN_PHASH_SIZE}
    best = {}  # (a, b) -> (rms, how)
    data = {}
    for s in shapes:
        samples, greys = zip(*groups[s])
        data[s] = (list(samples), np.stack(greys))
    for s in small:  # one size: as they are
        samples, images = data[s]
        z, coarse, ok = _zscored(images.astype(np.float32))
        idx = np.flatnonzero(ok)
        for i, j, rms in _close(z[idx], coarse[idx], z[idx], coarse[idx], tolerance, True):
            _keep(best, samples[idx[i]], samples[idx[j]], rms, f"both {s[1]}x{s[0]}")
    for src in shapes:  # two sizes: the images of src resized to dst's size
        for dst in shapes:
            if src == dst or not (src in small or dst in small):
                continue
            (src_samples, src_images), (dst_samples, dst_images) = data[src], data[dst]
            zd, cd, okd = _zscored(dst_images.astype(np.float32))
            jdx = np.flatnonzero(okd)
            for how in FILTERS:
                zv, cv, okv = _zscored(resize(src_images, (dst[1], dst[0]), how))
                idx = np.flatnonzero(okv)
                for i, j, rms in _close(zv[idx], cv[idx], zd[jdx], cd[jdx], tolerance, False):
                    _keep(best, src_samples[idx[i]], dst_samples[jdx[j]], rms,
                          f"{src[1]}x{src[0]} resized to {dst[1]}x{dst[0]}, {how}")
    return [(a, b, rms, how) for (a, b), (rms, how) in sorted(best.items())], left_out


def _keep(best, a, b, rms, how):
    pair = (a, b) if a < b else (b, a)
    if pair not in best or rms < best[pair][0]:
        best[pair] = (rms, how)


def _pool(results):
    """[(sample, grey)] for small_pairs: the small images' grey pixels (from the workers) and, when there
    are small images, the images up to POOL_MAX px a side read again (their resized copies)."""
    items = [(k, r["grey"]) for k, r in sorted(results.items()) if r.get("grey") is not None]
    if not items:
        return items
    for k, r in sorted(results.items()):
        if r.get("grey") is None and r.get("file") and "width" in r and max(r["width"], r["height"]) <= POOL_MAX:
            try:
                items.append((k, np.asarray(read_image(r["file"]).convert("L"))))
            except Exception:  # noqa: BLE001  (unreadable now: its integrity finding says so)
                continue
    return items


def find(results, bits, tolerance=TOLERANCE):
    """Findings and figures from the per-sample results {(split, index): result}."""
    by_sha = [(k, r.get("sha")) for k, r in results.items()]
    by_content = [(k, r.get("content")) for k, r in results.items()]
    pairs = {}  # (a, b) -> how
    for key_list, how in ((by_sha, "identical file"), (by_content, "identical content")):
        for group in exact_groups(key_list):
            group = sorted(group)
            for b in group[1:]:
                pairs.setdefault((group[0], b), how)
    with_hash = [(k, r["phash"]) for k, r in sorted(results.items()) if r.get("phash") is not None]
    if with_hash:
        samples, hashes = zip(*with_hash)
        for a, b, d in near_pairs(list(samples), list(hashes), bits):
            pairs.setdefault((a, b), f"near-duplicate image (perceptual hashes {d} bits apart)")
    pool = _pool(results)
    small, left_out = small_pairs(pool, tolerance)
    for a, b, rms, how in small:
        pairs.setdefault((a, b), f"near-duplicate small image ({how}: {rms:.2f} standard deviations apart, RMS)")
    findings, leaks, duplicates = [], [], []
    for (a, b), how in sorted(pairs.items()):
        fa, fb = results[a]["file"] or results[a]["record"], results[b]["file"] or results[b]["record"]
        ra = f"{fa}, {results[a]['record']}" if results[a]["file"] and results[a]["record"] else fa
        rb = f"{fb}, {results[b]['record']}" if results[b]["file"] and results[b]["record"] else fb
        pair = {"a": {"split": a[0], "index": a[1], "file": fa, "record": results[a]["record"]},
                "b": {"split": b[0], "index": b[1], "file": fb, "record": results[b]["record"]}, "how": how}
        if a[0] != b[0]:
            leaks.append(pair)
            findings.append(Finding("leaks", WARNING, "leak", f"leak between {a[0]} and {b[0]}: {ra} and {rb}: {how}",
                                    file=fb, record=results[b]["record"], split=b[0]))
        else:
            duplicates.append(pair)
            findings.append(Finding("leaks", WARNING, "duplicate", f"duplicate in {a[0]}: {ra} and {rb}: {how}",
                                    file=fb, record=results[b]["record"], split=b[0]))
    return findings, {"leaks": len(leaks), "duplicates": len(duplicates), "leak_pairs": leaks,
                      "duplicate_pairs": duplicates, "near_duplicate_bits": bits,
                      "small_images": sum(min(g.shape) < MIN_PHASH_SIZE for _, g in pool),
                      "small_tolerance": tolerance, "small_left_out": left_out}
