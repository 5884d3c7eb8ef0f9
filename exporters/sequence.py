"""Sequence classifiers (the Transformer): on token ids for text data, on waveforms for audio data."""
import logging
import os

import torch
from torch import nn
from tokenizers import Tokenizer

from datasets.audio import pad_or_trim, read_audio
from exporters.base import EXPORTERS, ExportError
from exporters.classification import LogitsAdapter

log = logging.getLogger(__name__)


@EXPORTERS.register(task="sequence", inputs="text")
class TextClassifier(LogitsAdapter):
    """tokens [B, T] (padded with pad_id) -> logits [B, K]; the tokenizer JSON is copied beside the artifact."""
    task = "text_classification"
    input_names = ("tokens",)

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        if data is None or not hasattr(data.val, "tokenizer"):
            raise ExportError(f"model {cfg['model']['name']}: the tokenizer and class names come from the data "
                              f"set ({cfg['data']['name']}) and the run folder, which could not be read")
        if not os.path.isfile(os.path.join(folder, "tokenizer.json")):
            raise FileNotFoundError(f"{os.path.join(folder, 'tokenizer.json')}: the run's tokenizer is missing")
        front = model.front_end
        return {"classes": list(data.classes),
                "preprocessing": {"tokenizer": "tokenizer.json", "max_length": data.val.max_length,
                                  "pad_id": front.pad_id, "unk_token": "[UNK]",
                                  "max_positions": _max_positions(model)}}

    def files(self):
        return [self.spec["preprocessing"]["tokenizer"]]

    def dynamic_shapes(self, dynamic_batch):
        dim = torch.export.Dim
        return ({0: dim.DYNAMIC if dynamic_batch else dim.STATIC, 1: dim.DYNAMIC},)

    def load(self, item):
        p = self.spec["preprocessing"]
        if not hasattr(self, "_tokenizer"):
            self._tokenizer = Tokenizer.from_file(os.path.join(self.folder, p["tokenizer"]))
        ids = self._tokenizer.encode(item).ids
        ids = ids[: p["max_length"]] if p["max_length"] else ids[: p["max_positions"]]
        return torch.tensor(ids or [self._tokenizer.token_to_id(p["unk_token"])], dtype=torch.long)

    def collate(self, samples):
        pad = self.spec["preprocessing"]["pad_id"]
        return (torch.nn.utils.rnn.pad_sequence(samples, batch_first=True, padding_value=pad),)


def _max_positions(model):
    pe = getattr(model.positions, "pe", None)
    return None if pe is None else int(pe.shape[0]) - (1 if model.pooling == "cls" else 0)


class AudioInputs(nn.Module):
    """(audio, lengths) tensors -> the model's {"audio", "lengths"} batch; logits as a tuple."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, audio, lengths):
        return (self.model({"audio": audio, "lengths": lengths}),)


@EXPORTERS.register(task="sequence", inputs="audio")
class AudioClassifier(LogitsAdapter):
    """audio [B, N] float32 at sample_rate (padded / trimmed to N) and lengths [B] (samples before
    padding) -> logits [B, K]; the log-Mel front end is inside the model."""
    task = "audio_classification"
    input_names = ("audio", "lengths")

    @classmethod
    def build_spec(cls, cfg, data, model, folder):
        if data is None:
            raise ExportError(f"model {cfg['model']['name']}: the sample rate, clip length and class names come "
                              f"from the data set ({cfg['data']['name']}), which could not be built")
        mel = model.front_end.mel
        return {"classes": list(data.classes),
                "preprocessing": {"sample_rate": data.val.sample_rate, "num_samples": data.val.num_samples,
                                  "mono": "mean of the channels", "resample": "torchaudio.functional.resample",
                                  "pad": "zeros at the end; longer clips are trimmed",
                                  "in_model": {"log_mel": {"n_fft": mel.n_fft, "win_length": mel.win_length,
                                                           "hop_length": mel.hop_length, "n_mels": mel.n_mels,
                                                           "top_db": 80.0}, "normalisation": "per clip"}}}

    def module(self, model):
        return AudioInputs(model).eval()

    def load(self, item):
        p = self.spec["preprocessing"]
        return pad_or_trim(read_audio(item, p["sample_rate"]), p["num_samples"])

    def collate(self, samples):
        waves, lengths = zip(*samples)
        return torch.stack(waves), torch.as_tensor(lengths, dtype=torch.long)
