"""Audio data: audio_folder reading (mono, resample, pad/trim), splits, bad files, synthetic_audio."""
import collections
import os

import numpy as np
import pytest
import soundfile as sf
import torch

from conftest import ROOT, shared_data
from datasets import audio
from engine.registry import DATASETS


def _tone(freq, rate, seconds, channels=1):
    t = np.arange(int(rate * seconds)) / rate
    wave = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return np.stack([wave] * channels, 1) if channels > 1 else wave


def _folder(tmp_path, speakers=("ann", "bob", "cat"), per=4, rate=8000):
    root = tmp_path / "speech"
    for k, label in enumerate(("yes", "no")):
        (root / label).mkdir(parents=True)
        for s in speakers:
            for i in range(per):
                sf.write(str(root / label / f"{s}_{i}.wav"), _tone(300 + 500 * k + 20 * i, rate, 0.3), rate)
    (root / "_background_noise_").mkdir()
    return str(root)


def _peak_hz(wave, rate):
    spectrum = np.abs(np.fft.rfft(wave.numpy()))
    return np.argmax(spectrum) * rate / len(wave)


def test_other_sample_rate_is_resampled_and_stereo_mixed(tmp_path):
    path = str(tmp_path / "x_0.wav")
    sf.write(path, _tone(1000, 16000, 0.5, channels=2), 16000)
    wave = audio.read_audio(path, 8000)
    assert wave.dtype == torch.float32 and wave.dim() == 1
    assert len(wave) == 4000
    assert abs(_peak_hz(wave, 8000) - 1000) < 10
    left_only = np.zeros((8000, 2), np.float32)
    left_only[:, 0] = 0.8
    sf.write(path, left_only, 8000)
    assert torch.allclose(audio.read_audio(path, 8000), torch.full((8000,), 0.4), atol=1e-3)  # PCM_16


def test_unreadable_wav_names_the_file(tmp_path):
    root = _folder(tmp_path)
    bad = os.path.join(root, "yes", "ann_9.wav")
    with open(bad, "wb") as f:
        f.write(b"RIFF\x00\x00\x00\x00WAVEgarbage" * 3)
    with pytest.raises(ValueError, match=r"ann_9\.wav: cannot read audio file"):
        DATASETS.build("audio_folder", root=root, sample_rate=8000, preload=True)
    lazy = DATASETS.build("audio_folder", root=root, sample_rate=8000, split="speaker", val_speakers=["bob"])
    index = lazy.train.files.index(bad)
    with pytest.raises(ValueError, match=r"ann_9\.wav: cannot read audio file"):
        lazy.train[index]
    empty = os.path.join(root, "no", "ann_8.wav")
    sf.write(empty, np.zeros(0, np.float32), 8000)
    with pytest.raises(ValueError, match=r"ann_8\.wav"):
        audio.read_audio(empty, 8000)


def test_pad_or_trim_and_collate(tmp_path):
    root = _folder(tmp_path)
    sf.write(os.path.join(root, "yes", "long_0.wav"), _tone(440, 22050, 1.5), 22050)
    data = DATASETS.build("audio_folder", root=root, sample_rate=8000, duration=1.0, split="speaker",
                          val_speakers="long", preload=True)
    (wave, n), label = data.val[0]
    assert wave.shape == (8000,) and n == 8000 and label == data.classes.index("yes")
    (wave, n), _ = data.train[0]
    assert wave.shape == (8000,) and n == 2400 and wave[n:].abs().sum() == 0
    inputs, targets = data.collate_fn([data.train[0], data.train[1]])
    assert inputs["audio"].shape == (2, 8000) and inputs["lengths"].tolist() == [2400, 2400]
    assert data.classes == ["no", "yes"]  # _background_noise_ skipped
    assert data.model_defaults == {"num_classes": 2, "sample_rate": 8000}


def test_stratified_and_speaker_splits(tmp_path):
    root = _folder(tmp_path)
    strat = DATASETS.build("audio_folder", root=root, sample_rate=8000, val_fraction=0.25)
    assert len(strat.train) == 18 and len(strat.val) == 6
    assert collections.Counter(strat.val.labels) == {0: 3, 1: 3}
    spk = DATASETS.build("audio_folder", root=root, sample_rate=8000, split="speaker", val_speakers=["cat"])
    assert {audio.speaker_of(f) for f in spk.val.files} == {"cat"}
    assert {audio.speaker_of(f) for f in spk.train.files} == {"ann", "bob"}
    drawn = DATASETS.build("audio_folder", root=root, sample_rate=8000, split="speaker", val_fraction=0.3)
    assert len({audio.speaker_of(f) for f in drawn.val.files}) == 1
    assert not {audio.speaker_of(f) for f in drawn.val.files} & {audio.speaker_of(f) for f in drawn.train.files}
    with pytest.raises(ValueError, match="zed"):
        DATASETS.build("audio_folder", root=root, sample_rate=8000, split="speaker", val_speakers=["zed"])
    sf.write(os.path.join(root, "yes", "noseparator.wav"), _tone(300, 8000, 0.1), 8000)
    with pytest.raises(ValueError, match=r"noseparator\.wav: split: speaker"):
        DATASETS.build("audio_folder", root=root, sample_rate=8000, split="speaker")


def test_speech_commands_lists_split(tmp_path):
    root = _folder(tmp_path)
    with open(os.path.join(root, "validation_list.txt"), "w") as f:
        f.write("yes/ann_0.wav\nno/bob_1.wav\n")
    with open(os.path.join(root, "testing_list.txt"), "w") as f:
        f.write("yes/cat_3.wav\n")
    data = DATASETS.build("audio_folder", root=root, sample_rate=8000, split="lists")
    assert sorted(os.path.relpath(f, root) for f in data.val.files) == ["no/bob_1.wav", "yes/ann_0.wav"]
    assert len(data.train) == 24 - 3


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        DATASETS.build("audio_folder", root=str(tmp_path / "nowhere"))
    (tmp_path / "empty" / "yes").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no audio files"):
        DATASETS.build("audio_folder", root=str(tmp_path / "empty"))


def test_fsdd_speaker_disjoint_split():
    root = shared_data("fsdd")
    data = DATASETS.build("audio_folder", root=root, sample_rate=8000, split="speaker", val_speakers=["theo"])
    assert len(data.train) == 250 and len(data.val) == 50
    assert {audio.speaker_of(f) for f in data.val.files} == {"theo"}
    assert data.classes == [str(d) for d in range(10)]
    (wave, n), _ = data.val[0]
    assert wave.shape == (8000,) and 0 < n <= 8000


@pytest.mark.slow
def test_synthetic_audio_trains_end_to_end(tmp_path):
    from engine.config import load_config
    from engine.loop import train
    cfg = load_config(os.path.join(ROOT, "configs", "transformer_audio_synthetic.yaml"))
    run = train(cfg, str(tmp_path / "run"))
    assert run.metrics["val/top1"] > 70  # chance is 25%
    front = run.model.front_end  # the config's spec_augment (freq_mask: 4, time_mask: 4) reached the model
    assert (front.freq_mask.mask_param, front.time_mask.mask_param) == (4, 4)
