"""Text classification: torchtext-style CSV data sets and a built-in synthetic set.

CSV layout (AG_NEWS, SogouNews, DBpedia, YelpReviewPolarity/Full, YahooAnswers,
AmazonReviewPolarity/Full): `ROOT/train.csv`, `ROOT/test.csv`, no header, the label in the first
column (1-based), one or more text columns joined with a space.

A WordPiece or BPE tokenizer (`tokenizers`) is trained on the training split only and saved as
`tokenizer.json` (+ `tokenizer_meta.json`) in the run folder; on resume and in evaluate.py (which
passes the checkpoint's folder) it is reloaded, so the model sees the same ids.
Batches: dynamic padding to the longest sequence (pad id 0), truncation to `max_length`, and a
length-bucketed training batch sampler.
"""
import csv
import hashlib
import itertools
import json
import logging
import os
import sys

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from datasets.base import DataSplits, problem, require_dir, stratified_split
from engine.errors import BadSample, DataError, MissingData
from evaluators.classification import ClassificationEvaluator
from engine import dist
from engine.config import ConfigError
from engine.files import atomic_write, write_json
from engine.registry import DATASETS, Range

log = logging.getLogger(__name__)

PAD, UNK = "[PAD]", "[UNK]"
CSV_LAYOUT = ("  ROOT/train.csv  ROOT/test.csv   (no header; \"label\",\"text\"[,\"text\"...]; labels 1..K)\n"
              "  or one file with data.val_fraction set (stratified validation carve-out)")

# class names of the data sets torchtext shipped (label k -> name [k - 1])
KNOWN_CLASSES = {
    "ag_news": ["World", "Sports", "Business", "Sci/Tech"],
    "sogou_news": ["Sports", "Finance", "Entertainment", "Automobile", "Technology"],
    "dbpedia": ["Company", "EducationalInstitution", "Artist", "Athlete", "OfficeHolder",
                "MeanOfTransportation", "Building", "NaturalPlace", "Village", "Animal", "Plant", "Album",
                "Film", "WrittenWork"],
    "yelp_review_polarity": ["negative", "positive"],
    "yelp_review_full": ["1 star", "2 stars", "3 stars", "4 stars", "5 stars"],
    "yahoo_answers": ["Society & Culture", "Science & Mathematics", "Health", "Education & Reference",
                      "Computers & Internet", "Sports", "Business & Finance", "Entertainment & Music",
                      "Family & Relationships", "Politics & Government"],
    "amazon_review_polarity": ["negative", "positive"],
    "amazon_review_full": ["1 star", "2 stars", "3 stars", "4 stars", "5 stars"],
}


# ---------------------------------------------------------------- CSV reading

RUN_ON_LINES = 10  # a row over this many lines, in a file of half as many rows as lines: an unclosed quote


def read_csv(path, num_classes=None, text_columns=None, max_rows=None, skip_bad_samples=False, rows=None):
    """-> (texts, labels 0-based). Errors name the file and the row; blank lines are not rows. With
    skip_bad_samples, bad rows are left out, each logged, and counted in one warning at the end.
    A file that parses to fewer than half as many rows as it has lines, one row running over
    RUN_ON_LINES lines or more, is a DataError naming the line where that row starts (an unbalanced
    quote takes every line up to the next quote into one field); fewer rows over several lines are
    a warning naming their lines. `rows`: a list that gets (row number, first line, last line) of
    each text returned (the data doctor names them)."""
    if not os.path.isfile(path):
        raise MissingData(f"text CSV not found: {os.path.abspath(path)}\nexpected layout:\n{CSV_LAYOUT}")
    csv.field_size_limit(min(sys.maxsize, 2 ** 31 - 1))
    texts, labels, skipped, spanning = [], [], [], []  # spanning: (row, first line, last line) over several lines
    parsed, blank, longest = 0, 0, (0, 0, 0)  # rows, blank lines, (lines, row, first line) of the longest row
    # undecodable bytes become surrogates, so that the row holding them is named (or skipped)
    with open(path, newline="", encoding="utf-8", errors="surrogateescape") as f:
        reader = csv.reader(f)
        for line in itertools.count(1):
            first = reader.line_num + 1
            try:
                row = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                row = e
            if isinstance(row, list) and (not row or (len(row) == 1 and not row[0].strip())):
                blank += reader.line_num - first + 1
                continue
            parsed += 1
            longest = max(longest, (reader.line_num - first + 1, line, first))
            if reader.line_num > first:
                spanning.append((line, first, reader.line_num))
            try:
                text, label = _parse_row(row, num_classes, text_columns)
            except ValueError as e:
                bad = BadSample(f"{path}, row {line}" + (f" (line {first})" if first != line else ""), str(e))
                if not skip_bad_samples:
                    problem(BadSample(bad.where, f"{e}; data.skip_bad_samples: true would skip it"))
                else:
                    log.warning("skipped bad sample %s", bad)
                skipped.append(line)
                continue
            texts.append(text)
            labels.append(label)
            if rows is not None:
                rows.append((line, first, reader.line_num))
            if max_rows and len(texts) >= max_rows:
                break
        lines = reader.line_num - blank
    span, row, first = longest
    if span >= RUN_ON_LINES and parsed < lines / 2:
        problem(DataError(f"{path}: {parsed} rows parsed from {lines} lines: row {row} runs from line {first} over "
                          f"{span} lines, so a quote at line {first} is probably not closed (a quoted field takes "
                          f"every line up to the next quote); fix the quoting of line {first}"))
    elif spanning:  # fewer: one unclosed quote merges the next line(s) into a row's text, without an error
        log.warning("%s: %d row(s) span several lines (%s): a quote that is not closed takes every line up to the "
                    "next quote into its text, and the rows there are lost (%d rows from %d lines); fix the quoting "
                    "at those lines, unless their texts hold line breaks", path, len(spanning),
                    ", ".join(f"row {r}: lines {a}-{b}" for r, a, b in spanning[:10]) +
                    (" ..." if len(spanning) > 10 else ""), parsed, lines)
    if skipped:
        log.warning("%s: %d bad rows skipped (data.skip_bad_samples): rows %s", path, len(skipped),
                    ", ".join(map(str, skipped[:20])) + (" ..." if len(skipped) > 20 else ""))
    if not texts:
        raise DataError(f"{path}: the CSV file is empty (no rows); expected \"label\",\"text\"... rows")
    return texts, labels


def _parse_row(row, num_classes, text_columns):
    """(text, 0-based label) of one CSV row, or ValueError saying what is wrong with it."""
    if isinstance(row, csv.Error):
        raise ValueError(f"malformed CSV ({row})")
    if any("\udc80" <= c <= "\udcff" for cell in row for c in cell):
        raise ValueError("not valid UTF-8 text")
    if all(not c.strip() for c in row):
        raise ValueError('empty row (expected "label","text"[,"text"...])')
    if len(row) < 2:
        raise ValueError(f"expected a label and at least one text column, got {row!r:.120}")
    raw = row[0].strip()
    try:
        label = int(raw)
    except ValueError:
        raise ValueError(f"unknown label {raw!r:.40} (expected an integer 1..{num_classes or 'K'})") from None
    if label < 1 or (num_classes is not None and label > num_classes):
        raise ValueError(f"unknown label {label} (labels are 1-based, expected 1..{num_classes or 'K'})")
    cols = row[1:] if text_columns is None else [row[i] for i in text_columns if i < len(row)]
    text = " ".join(c.strip() for c in cols if c.strip())
    if not text:
        raise ValueError("empty text")
    return text, label - 1


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(texts, kind="wordpiece", vocab_size=16000, lowercase=True, min_frequency=2):
    specials = [PAD, UNK]  # PAD gets id 0
    if kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token=UNK))
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                            special_tokens=specials, show_progress=False)
        tok.decoder = decoders.WordPiece()
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=UNK))
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                      special_tokens=specials, show_progress=False)
    else:
        raise ConfigError(f"tokenizer must be 'wordpiece' or 'bpe', got {kind!r}")
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(texts, trainer, length=len(texts))
    assert tok.token_to_id(PAD) == 0
    return tok


def _texts_digest(texts):
    h = hashlib.sha256()
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def load_tokenizer(path):
    """A saved tokenizer (the tokenizers library's JSON), read as data: a DataError naming the file
    when it is not one (truncated, not JSON, another kind of file)."""
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001  (tokenizers raises a plain Exception for a file it cannot parse)
        why = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise DataError(f"{path}: not a tokenizer file of the tokenizers library ({why}): restore the run's own "
                        f"tokenizer.json, or delete it to train a new one (the checkpoints' token ids come from "
                        f"it)") from None


def read_tokenizer_meta(path):
    """tokenizer_meta.json (the settings a run's tokenizer was trained with) as a JSON object, or a
    DataError naming the file."""
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"{path}: not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object of tokenizer settings, got {type(meta).__name__}")
    return meta


def run_tokenizer(texts, kind, vocab_size, lowercase, min_frequency, output_dir):
    """Load the run's tokenizer from output_dir, or train it on `texts` (training split) and save it."""
    meta = {"kind": kind, "vocab_size": vocab_size, "lowercase": lowercase, "min_frequency": min_frequency,
            "num_texts": len(texts), "texts_sha256": _texts_digest(texts)}
    if output_dir is None:
        return train_tokenizer(texts, kind, vocab_size, lowercase, min_frequency)
    path, meta_path = os.path.join(output_dir, "tokenizer.json"), os.path.join(output_dir, "tokenizer_meta.json")
    if os.path.isfile(path):
        saved = read_tokenizer_meta(meta_path) if os.path.isfile(meta_path) else {}
        diff = {k: (saved.get(k), v) for k, v in meta.items() if saved.get(k) != v}
        if diff:
            raise DataError(f"{path} was made for other settings or another training split "
                             f"({', '.join(f'{k}: saved {a!r}, now {b!r}' for k, (a, b) in diff.items())}); "
                             f"use a new --output-dir, or delete it to train a new one")
        log.info("tokenizer: loaded %s", path)
        return load_tokenizer(path)
    if os.path.isdir(output_dir) and any(n.endswith(".pt") for n in os.listdir(output_dir)):
        raise MissingData(f"{path} is missing but {output_dir} holds checkpoints: the model's token "
                                f"ids come from that file (it is saved next to the checkpoints)")
    tok = train_tokenizer(texts, kind, vocab_size, lowercase, min_frequency) if dist.is_main() else None
    if dist.is_distributed():  # every process takes rank 0's vocabulary
        tok = Tokenizer.from_str(dist.broadcast_object(tok.to_str() if tok else None))
    if dist.is_main():
        # written whole or not at all (tok.save's bytes: pretty JSON in UTF-8)
        atomic_write(path, lambda f: f.write(tok.to_str(pretty=True).encode("utf-8")), binary=True)
        write_json(meta_path, meta)
        log.info("tokenizer: trained on %d texts (vocabulary %d), saved to %s", len(texts),
                 tok.get_vocab_size(), path)
    return tok


# ---------------------------------------------------------------- datasets, batching

class TokenizedText(Dataset):
    """Texts tokenized once up front; items are (LongTensor ids, label)."""
    deterministic = True  # no random draws: engine.seeding.SeededSamples need not seed each item

    def __init__(self, texts, labels, tokenizer, max_length):
        self.tokenizer, self.max_length = tokenizer, max_length
        self.texts, self.labels = texts, list(labels)
        self.ids = [self._truncate(e.ids) for e in tokenizer.encode_batch(texts)]
        self.lengths = [len(i) for i in self.ids]

    def _truncate(self, ids):
        return torch.tensor((ids[: self.max_length] if self.max_length else ids) or [self.unk_id], dtype=torch.long)

    @property
    def unk_id(self):
        return self.tokenizer.token_to_id(UNK)

    def encode(self, text):
        """Ids the model sees for `text` (truncated like the data)."""
        return self._truncate(self.tokenizer.encode(text).ids)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.labels[i]


def pad_collate(batch, pad_id=0):
    """Dynamic padding: pad to the longest sequence of the batch (right side)."""
    seqs, labels = zip(*batch)
    tokens = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    return tokens, torch.as_tensor(labels, dtype=torch.long)


class LengthBucketBatchSampler(Sampler):
    """Takes the sampler's (shuffled) order, sorts pools of `bucket_batches` batches by length, cuts
    them into batches and shuffles the batches: little padding, still random. Incomplete batches are
    dropped like the loop's default BatchSampler. Deterministic given the sampler's generator/seed."""

    def __init__(self, lengths, sampler, batch_size, bucket_batches=50, drop_last=True):
        self.lengths, self.sampler, self.batch_size = lengths, sampler, batch_size
        self.bucket_batches, self.drop_last = bucket_batches, drop_last

    def _generator(self):
        g = getattr(self.sampler, "generator", None)
        if g is None:  # DistributedSampler: its seed and epoch
            g = torch.Generator().manual_seed(getattr(self.sampler, "seed", 0) + getattr(self.sampler, "epoch", 0))
        return g

    def __iter__(self):
        order = list(self.sampler)
        pool = self.batch_size * self.bucket_batches
        flat = []
        for start in range(0, len(order), pool):
            flat += sorted(order[start:start + pool], key=lambda i: self.lengths[i])
        stop = len(flat) - len(flat) % self.batch_size if self.drop_last else len(flat)
        batches = [flat[j:j + self.batch_size] for j in range(0, stop, self.batch_size)]
        for k in torch.randperm(len(batches), generator=self._generator()).tolist():
            yield batches[k]

    def __len__(self):
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)


def text_splits(train_texts, train_labels, val_texts, val_labels, classes, tokenizer, vocab_size, lowercase,
                min_frequency, max_length, bucket_batches, output_dir):
    tok = run_tokenizer(train_texts, tokenizer, vocab_size, lowercase, min_frequency, output_dir)
    train = TokenizedText(train_texts, train_labels, tok, max_length)
    val = TokenizedText(val_texts, val_labels, tok, max_length)

    def batch_sampler(dataset, sampler, batch_size):
        return LengthBucketBatchSampler(dataset.lengths, sampler, batch_size, bucket_batches)

    return DataSplits(train=train, val=val, classes=list(classes), collate_fn=pad_collate,
                      train_batch_sampler=batch_sampler if bucket_batches else None,
                      evaluator=lambda: ClassificationEvaluator(classes),
                      model_defaults={"num_classes": len(classes), "vocab_size": tok.get_vocab_size(),
                                      "pad_id": 0, **({"max_len": max_length} if max_length else {})})


def _resolve_classes(classes, labels, source):
    if isinstance(classes, str):
        if classes not in KNOWN_CLASSES:
            raise DataError(f"classes: unknown preset {classes!r} (known: {', '.join(KNOWN_CLASSES)}) "
                             f"or give a list of names")
        return list(KNOWN_CLASSES[classes])
    if classes:
        return [str(c) for c in classes]
    k = max(labels) + 1
    missing = sorted(set(range(k)) - set(labels))
    if missing:
        log.warning("%s: labels %s never occur", source, [m + 1 for m in missing])
    return [str(i + 1) for i in range(k)]


@DATASETS.register(inputs="text", doctor="text", ranges={
    "val_fraction": Range(gt=0, lt=1), "split_seed": Range(ge=0), "max_rows": Range(ge=1), "vocab_size": Range(ge=1),
    "min_frequency": Range(ge=1), "max_length": Range(ge=1), "bucket_batches": Range(ge=0)})  # 0: no buckets
def csv_text(root, train_file="train.csv", val_file="test.csv", val_fraction: float | None = None, split_seed=0,
             classes=None, text_columns=None, max_rows: int | None = None, tokenizer="wordpiece", vocab_size=16000,
             lowercase=True, min_frequency=2, max_length=256, bucket_batches=50, output_dir=None,
             skip_bad_samples=False):
    """torchtext-style CSV data sets. With val_fraction set, a stratified validation split (seed
    split_seed) is carved from train_file and val_file is not read. `classes`: a list of names or a
    preset (ag_news, dbpedia, yelp_review_full, ...); it fixes K so that labels outside 1..K are
    errors. text_columns: 0-based column indices to join (default: every column after the label).
    skip_bad_samples: leave malformed rows out (each logged with file and row, counted) instead of
    stopping on the first."""
    require_dir(root, CSV_LAYOUT, "csv_text")
    num_classes = len(_resolve_classes(classes, [0], root)) if classes else None
    train_path = os.path.join(root, train_file)
    texts, labels = read_csv(train_path, num_classes, text_columns, max_rows, skip_bad_samples)
    if val_fraction:
        tr, va = stratified_split(labels, val_fraction, split_seed)
        train_texts, train_labels = [texts[i] for i in tr], [labels[i] for i in tr]
        val_texts, val_labels = [texts[i] for i in va], [labels[i] for i in va]
    else:
        train_texts, train_labels = texts, labels
        val_texts, val_labels = read_csv(os.path.join(root, val_file), num_classes, text_columns,
                                         skip_bad_samples=skip_bad_samples)
    names = _resolve_classes(classes, train_labels + val_labels, train_path)
    log.info("csv_text %s: %d train / %d val texts, %d classes", root, len(train_texts), len(val_texts), len(names))
    return text_splits(train_texts, train_labels, val_texts, val_labels, names, tokenizer, vocab_size, lowercase,
                       min_frequency, max_length, bucket_batches, output_dir)


# ---------------------------------------------------------------- synthetic

FILLER = [a + b for a in ("ka", "lo", "mi", "ne", "pu", "ro", "si", "tu", "va", "ze", "bo", "da")
          for b in ("n", "r", "s", "l", "t", "m", "x", "k", "p", "d", "g", "f", "z", "b", "v")]


def _synthetic_texts(n, num_classes, seed, keywords=6):
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        label = int(rng.integers(num_classes))
        words = list(rng.choice(FILLER, size=int(rng.integers(6, 40))))
        own = [f"topic{label}word{k}" for k in rng.integers(keywords, size=int(rng.integers(1, 4)))]
        noise = [f"topic{int(rng.integers(num_classes))}word{int(rng.integers(keywords))}"]
        for w in own + (noise if rng.random() < 0.3 else []):
            words.insert(int(rng.integers(len(words) + 1)), w)
        texts.append(" ".join(words))
        labels.append(label)
    return texts, labels


@DATASETS.register(inputs="text", doctor="text", ranges={
    "num_classes": Range(ge=2), "train_size": Range(ge=1), "val_size": Range(ge=1), "seed": Range(ge=0),
    "vocab_size": Range(ge=1), "min_frequency": Range(ge=1), "max_length": Range(ge=1), "bucket_batches": Range(ge=0)})
def synthetic_text(num_classes=4, train_size=2000, val_size=500, seed=0, tokenizer="wordpiece", vocab_size=500,
                   lowercase=True, min_frequency=2, max_length=64, bucket_batches=20, output_dir=None):
    """Built-in, offline: filler words with 1-3 class keywords (and sometimes one from another class)."""
    if num_classes < 2:
        raise ConfigError("synthetic_text: num_classes must be >= 2")
    train_texts, train_labels = _synthetic_texts(train_size, num_classes, seed)
    val_texts, val_labels = _synthetic_texts(val_size, num_classes, seed + 1_000_003)
    classes = [f"topic{k}" for k in range(num_classes)]
    return text_splits(train_texts, train_labels, val_texts, val_labels, classes, tokenizer, vocab_size, lowercase,
                       min_frequency, max_length, bucket_batches, output_dir)
