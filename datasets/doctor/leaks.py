"""Duplicates within a split and leaks across splits: equal content hashes (file bytes, a normalised
text, decoded audio samples) and near-duplicate images (64-bit perceptual hashes within
doctor.near_duplicate_bits bits of each other). Only the hashes are kept, a few bytes per sample."""
from collections import defaultdict

import numpy as np

from datasets.doctor.findings import WARNING, Finding

CHUNK = 2048  # rows of the distance matrix computed at once (CHUNK x n bytes)


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


def find(results, bits):
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
                      "duplicate_pairs": duplicates, "near_duplicate_bits": bits}
