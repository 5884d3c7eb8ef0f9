"""Speech / sound classification: an audio folder (Speech Commands layout) and a synthetic set.

Items are (waveform FloatTensor [N], length in samples before padding); batches are
({"audio": [B, N], "lengths": [B]}, targets). The model computes log-Mel features itself (front end
`audio`); SpecAugment settings given here reach it as a model default and act in training only.
"""
import logging
import math
import os
from functools import partial

import numpy as np
import torch
import torchaudio.functional as AF
import soundfile as sf
from torch.utils.data import Dataset

from datasets.base import DataSplits, Skipped, read_or_skip, require_dir, stratified_split
from engine.errors import BadSample, DataError, MissingData
from datasets.classification import class_files, class_folders
from evaluators.classification import ClassificationEvaluator
from engine.config import ConfigError
from engine.registry import DATASETS, Range

log = logging.getLogger(__name__)

AUDIO_LAYOUT = ("  ROOT/<label>/*.wav   (Speech Commands style; folders starting with '_' are skipped;\n"
                "  file names <speaker>_<idx>.wav for split: speaker)")
EXTENSIONS = (".wav", ".flac", ".ogg")


def read_audio(path, sample_rate):
    """Mono float32 tensor at `sample_rate`; other rates are resampled. Errors (BadSample) name the file."""
    try:
        data, rate = sf.read(path, dtype="float32", always_2d=True)
    except Exception as e:  # soundfile raises LibsndfileError / RuntimeError / TypeError
        raise BadSample(path, f"cannot read audio file ({type(e).__name__}: {e})") from None
    if data.shape[0] == 0:
        raise BadSample(path, "the audio file has no samples")
    if not np.isfinite(data).all():
        raise BadSample(path, "the audio file holds NaN or infinite samples")
    wave = torch.from_numpy(data.mean(axis=1) if data.shape[1] > 1 else data[:, 0]).contiguous()
    if rate != sample_rate:
        wave = AF.resample(wave, rate, sample_rate)
    return wave


def pad_or_trim(wave, num_samples):
    """-> (wave of exactly num_samples (zero padded at the end, or trimmed), length kept)."""
    n = min(len(wave), num_samples)
    if len(wave) >= num_samples:
        return wave[:num_samples], n
    return torch.nn.functional.pad(wave, (0, num_samples - len(wave))), n


class AudioFiles(Dataset):
    """With skip_bad_samples an unreadable file becomes a Skipped marker (left out by the batch collate);
    with preload too, bad files are left out (and logged) when they are read up front."""

    def __init__(self, files, labels, sample_rate, duration, preload=False, skip_bad_samples=False):
        self.files, self.labels = list(files), list(labels)
        self.sample_rate, self.num_samples = sample_rate, int(round(duration * sample_rate))
        self.skip_bad_samples = skip_bad_samples
        self.cache, self.root = None, None
        if preload:
            loaded = [read_or_skip(partial(self._load, f), skip_bad_samples) for f in self.files]
            keep = [i for i, item in enumerate(loaded) if not isinstance(item, Skipped)]
            if len(keep) < len(loaded):
                log.warning("audio_folder: %d unreadable files left out (data.skip_bad_samples)",
                            len(loaded) - len(keep))
            self.files, self.labels = [self.files[i] for i in keep], [self.labels[i] for i in keep]
            self.cache = [loaded[i] for i in keep]

    def _load(self, path):
        return pad_or_trim(read_audio(path, self.sample_rate), self.num_samples)

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        if self.cache is not None:
            return self.cache[i], self.labels[i]
        item = read_or_skip(partial(self._load, self.files[i]), self.skip_bad_samples)
        return item if isinstance(item, Skipped) else (item, self.labels[i])


def audio_collate(batch):
    items, labels = zip(*batch)
    waves, lengths = zip(*items)
    return ({"audio": torch.stack(waves), "lengths": torch.as_tensor(lengths, dtype=torch.long)},
            torch.as_tensor(labels, dtype=torch.long))


def speaker_of(path):
    stem = os.path.splitext(os.path.basename(path))[0]
    speaker, sep, idx = stem.rpartition("_")
    if not sep or not speaker:
        raise DataError(f"{path}: split: speaker needs file names <speaker>_<idx>.wav")
    return speaker


def _scan(root, classes, follow_symlinks=False):
    """(class names, files, labels): the class folders' audio files, sub-folders included, listed by
    engine.paths.walk_files (datasets.classification.class_files)."""
    names = list(classes) if classes else class_folders(root, ignore=("_", "."))
    for name in names:
        if not os.path.isdir(os.path.join(root, name)):
            raise MissingData(f"audio_folder: class folder not found: {os.path.join(root, name)}")
    found = class_files(root, names, EXTENSIONS, follow_symlinks)
    files, labels = [], []
    for k, name in enumerate(names):
        if not found[name]:
            raise MissingData(f"audio_folder: no audio files ({', '.join(EXTENSIONS)}) in the class "
                                    f"folder {os.path.abspath(os.path.join(root, name))}\nexpected layout:\n{AUDIO_LAYOUT}")
        files += found[name]
        labels += [k] * len(found[name])
    if not files:
        raise MissingData(f"audio_folder: no audio files ({', '.join(EXTENSIONS)}) under {root}\n"
                                f"expected layout:\n{AUDIO_LAYOUT}")
    return names, files, labels


def _split(root, files, labels, split, val_fraction, val_speakers, split_seed, val_list, test_list):
    if split == "stratified":
        return stratified_split(labels, val_fraction, split_seed)
    if split == "speaker":
        speakers = [speaker_of(f) for f in files]
        known = sorted(set(speakers))
        if val_speakers is None:
            n = max(1, int(round(len(known) * val_fraction)))
            val_speakers = sorted(np.random.default_rng(split_seed).choice(known, n, replace=False).tolist())
        val_speakers = [val_speakers] if isinstance(val_speakers, str) else list(val_speakers)
        unknown = sorted(set(val_speakers) - set(known))
        if unknown:
            raise DataError(f"audio_folder {root}: val_speakers {unknown} not found (speakers: {known})")
        if set(val_speakers) >= set(known):
            raise DataError(f"audio_folder {root}: val_speakers leaves no speaker for training")
        log.info("audio_folder: speaker-disjoint split, validation speakers %s", val_speakers)
        val = [i for i, s in enumerate(speakers) if s in val_speakers]
        train = [i for i, s in enumerate(speakers) if s not in val_speakers]
        return train, val
    if split == "lists":  # Speech Commands: validation_list.txt / testing_list.txt, paths relative to root
        def listed(name):
            path = os.path.join(root, name)
            if not os.path.isfile(path):
                raise MissingData(f"audio_folder split: lists needs {path}")
            with open(path) as f:
                return {os.path.normpath(line.strip()) for line in f if line.strip()}
        val_set = listed(val_list)
        held = val_set | (listed(test_list) if test_list else set())
        rel = [os.path.normpath(os.path.relpath(f, root)) for f in files]
        return [i for i, r in enumerate(rel) if r not in held], [i for i, r in enumerate(rel) if r in val_set]
    raise DataError(f"audio_folder: split must be stratified, speaker or lists, got {split!r}")


def _splits(train, val, classes, sample_rate, spec_augment):
    defaults = {"num_classes": len(classes), "sample_rate": sample_rate}
    if spec_augment:
        defaults["spec_augment"] = dict(spec_augment)
    return DataSplits(train=train, val=val, classes=list(classes), collate_fn=audio_collate,
                      evaluator=lambda: ClassificationEvaluator(classes), model_defaults=defaults)


@DATASETS.register(inputs="audio", doctor="audio", ranges={"sample_rate": Range(ge=1), "duration": Range(gt=0),
                                          "val_fraction": Range(gt=0, lt=1), "split_seed": Range(ge=0)})
def audio_folder(root, sample_rate=16000, duration=1.0, split="stratified", val_fraction=0.2, val_speakers=None,
                 split_seed=0, classes=None, preload=False, spec_augment=None,
                 val_list="validation_list.txt", test_list="testing_list.txt", skip_bad_samples=False,
                 follow_symlinks=False):
    """ROOT/<label>/*.wav. split: stratified (val_fraction, split_seed), speaker (files
    <speaker>_<idx>.wav; val_speakers, or round(val_fraction * speakers) drawn with split_seed) or
    lists (Speech Commands' validation_list.txt; testing_list.txt kept out of training).
    Read with soundfile, mixed to mono, resampled to sample_rate, padded / trimmed to duration seconds.
    spec_augment: {freq_mask, time_mask, num_masks} for the model's training mode (None = off).
    skip_bad_samples: leave unreadable files out of their batch (logged, counted per epoch).
    follow_symlinks: enter directory symlinks inside class folders (loops skipped, each file counted
    once); a class folder that is a symlink is entered either way (docs/doctor.md)."""
    require_dir(root, AUDIO_LAYOUT, "audio_folder")
    classes, files, labels = _scan(root, classes, follow_symlinks)
    tr, va = _split(root, files, labels, split, val_fraction, val_speakers, split_seed, val_list, test_list)
    if not tr or not va:
        raise DataError(f"audio_folder {root}: the {split} split left {len(tr)} train / {len(va)} val files")
    train = AudioFiles([files[i] for i in tr], [labels[i] for i in tr], sample_rate, duration, preload,
                       skip_bad_samples)
    val = AudioFiles([files[i] for i in va], [labels[i] for i in va], sample_rate, duration, preload,
                     skip_bad_samples)
    train.root = val.root = root  # the doctor's --write-clean keeps each file's path below it
    log.info("audio_folder %s: %d train / %d val clips, %d classes", root, len(train), len(val), len(classes))
    return _splits(train, val, classes, sample_rate, spec_augment).skip_bad_samples(skip_bad_samples)


class SyntheticChirps(Dataset):
    """Class k: a chirp between two class-specific frequencies (up or down), random onset, length,
    loudness and noise. Deterministic per index."""

    def __init__(self, size, num_classes, sample_rate, duration, seed):
        self.size, self.num_classes, self.sample_rate, self.seed = size, num_classes, sample_rate, seed
        self.num_samples = int(round(duration * sample_rate))

    def __len__(self):
        return self.size

    def _freqs(self, k):
        nyq = self.sample_rate / 2
        base = 0.08 * nyq + 0.55 * nyq * (k // 2) / max(1, (self.num_classes - 1) // 2)
        span = 0.25 * nyq
        return (base, base + span) if k % 2 == 0 else (base + span, base)

    def __getitem__(self, index):
        rng = np.random.default_rng([self.seed, index])
        label = int(rng.integers(self.num_classes))
        n = int(self.num_samples * rng.uniform(0.5, 0.9))
        onset = int(rng.integers(0, self.num_samples - n + 1))
        f0, f1 = self._freqs(label)
        t = np.arange(n) / self.sample_rate
        phase = 2 * math.pi * (f0 * t + (f1 - f0) * t ** 2 / (2 * t[-1] + 1e-9)) + rng.uniform(0, 2 * math.pi)
        wave = np.zeros(self.num_samples, np.float32)
        wave[onset:onset + n] = rng.uniform(0.2, 0.8) * np.sin(phase) * np.hanning(n)
        wave += rng.normal(0, 0.02, self.num_samples).astype(np.float32)
        return (torch.from_numpy(wave), self.num_samples), label


@DATASETS.register(inputs="audio", ranges={"num_classes": Range(ge=2), "train_size": Range(ge=1),
                                          "val_size": Range(ge=1), "sample_rate": Range(ge=1), "duration": Range(gt=0),
                                          "seed": Range(ge=0)})
def synthetic_audio(num_classes=6, train_size=600, val_size=200, sample_rate=8000, duration=0.5, seed=0,
                    spec_augment=None):
    """Built-in, offline: chirps per class (no download)."""
    if num_classes < 2:
        raise ConfigError("synthetic_audio: num_classes must be >= 2")
    train = SyntheticChirps(train_size, num_classes, sample_rate, duration, seed)
    val = SyntheticChirps(val_size, num_classes, sample_rate, duration, seed + 1_000_003)
    classes = [f"chirp{k}{'up' if k % 2 == 0 else 'down'}" for k in range(num_classes)]
    return _splits(train, val, classes, sample_rate, spec_augment)
