"""Transformer encoder classifier for token sequences (text) and waveforms (speech).

    inputs  tokens front end: LongTensor [B, T] of token ids, `pad_id` marks padding
                              (or {"tokens": ..., } with the same tensor)
            audio  front end: FloatTensor [B, N] of waveforms, or {"audio": [B, N], "lengths": [B]}
                              (lengths in samples; frames past a clip's end are masked)
    training  -> {"loss_cls": cross entropy}
    eval      -> logits [B, num_classes]

The encoder is `nn.TransformerEncoder(batch_first=True)`. In eval mode under `torch.no_grad()`
PyTorch's fast path applies (fused encoder layer kernels; with a key padding mask the padded batch
becomes a nested tensor, so padding costs no compute). It needs norm_first=False, an even number
of heads and relu/gelu. `fast_path`: True (always where it applies), False (never), or "auto" (the
default: on for CUDA inputs, off on CPU, where benchmarks/transformer_fastpath.py measured it slower
than the regular path with SDPA attention; figures in docs/performance.md).
"""
import contextlib
import math
import threading
import warnings

import torch
import torch.nn.functional as F
from torch import nn
import torchaudio.transforms as AT

from engine.config import ConfigError
from engine.registry import MODELS, Range
from engine.transfer import Rows

# the nested-tensor fast path warns once per process that the nested tensor API is a prototype
warnings.filterwarnings("ignore", message="The PyTorch API of nested tensors is in prototype stage")


class SinusoidalPositions(nn.Module):
    def __init__(self, dim, max_len):
        super().__init__()
        position = torch.arange(max_len, dtype=torch.float32)[:, None]
        div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
        pe = torch.zeros(max_len, dim)
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)[:, : dim // 2]
        self.register_buffer("pe", pe, persistent=False)

    def forward(self, x):
        if x.shape[1] > self.pe.shape[0]:
            raise ValueError(f"sequence of length {x.shape[1]} is longer than max_len={self.pe.shape[0]}")
        return x + self.pe[: x.shape[1]].to(x.dtype)


class LearnedPositions(nn.Module):
    def __init__(self, dim, max_len):
        super().__init__()
        self.pe = nn.Parameter(torch.zeros(max_len, dim))
        nn.init.trunc_normal_(self.pe, std=0.02)

    def forward(self, x):
        if x.shape[1] > self.pe.shape[0]:
            raise ValueError(f"sequence of length {x.shape[1]} is longer than max_len={self.pe.shape[0]}")
        return x + self.pe[: x.shape[1]]


class TokenFrontEnd(nn.Module):
    """Embedding with a padding index; returns (features [B, T, D], padding mask [B, T] True = pad)."""

    def __init__(self, vocab_size, dim, pad_id):
        super().__init__()
        if not vocab_size:
            raise ConfigError("transformer_classifier: the tokens front end needs vocab_size (the text "
                             "data sets fill it in from their tokenizer)")
        self.pad_id = pad_id
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=pad_id)
        nn.init.normal_(self.embed.weight, std=dim ** -0.5)
        with torch.no_grad():
            self.embed.weight[pad_id].zero_()
        self.scale = math.sqrt(dim)

    def forward(self, inputs):
        tokens = inputs["tokens"] if isinstance(inputs, dict) else inputs
        return self.embed(tokens) * self.scale, tokens.eq(self.pad_id)


class AudioFrontEnd(nn.Module):
    """Log-Mel spectrogram (MelSpectrogram + AmplitudeToDB), per-clip normalisation, SpecAugment in
    training, then a 2-layer stride-2 convolution (time and frequency /4) projected to the width."""

    def __init__(self, dim, sample_rate, n_mels, n_fft, win_length, hop_length, channels, spec_augment):
        super().__init__()
        win_length = win_length or n_fft
        self.hop_length = hop_length
        self.mel = AT.MelSpectrogram(sample_rate=sample_rate, n_fft=n_fft, win_length=win_length,
                                     hop_length=hop_length, n_mels=n_mels, center=True)
        self.to_db = AT.AmplitudeToDB(stype="power", top_db=80.0)
        spec_augment = dict(spec_augment or {})
        unknown = set(spec_augment) - {"freq_mask", "time_mask", "num_masks"}
        if unknown:
            raise ConfigError(f"spec_augment: unknown keys {sorted(unknown)} (freq_mask, time_mask, num_masks)")
        self.num_masks = int(spec_augment.get("num_masks", 2)) if spec_augment else 0
        self.freq_mask = AT.FrequencyMasking(int(spec_augment.get("freq_mask", 0)), iid_masks=True) \
            if spec_augment.get("freq_mask") else None
        self.time_mask = AT.TimeMasking(int(spec_augment.get("time_mask", 0)), iid_masks=True) \
            if spec_augment.get("time_mask") else None
        self.conv = nn.Sequential(nn.Conv2d(1, channels, 3, stride=2), nn.GELU(),
                                  nn.Conv2d(channels, channels, 3, stride=2), nn.GELU())
        freq = ((n_mels - 3) // 2 + 1 - 3) // 2 + 1
        self.proj = nn.Linear(channels * freq, dim)

    @staticmethod
    def _conv_len(n):
        return torch.div(torch.div(n - 3, 2, rounding_mode="floor") + 1 - 3, 2, rounding_mode="floor") + 1

    def forward(self, inputs):
        if isinstance(inputs, dict):
            wave, lengths = inputs["audio"], inputs.get("lengths")
        else:
            wave, lengths = inputs, None
        if wave.dim() == 3:  # [B, 1, N]
            wave = wave[:, 0]
        spec = self.to_db(self.mel(wave.float()).unsqueeze(1))  # [B, 1, F, T]; 4-D: top_db per clip
        frames = spec.shape[-1]
        if lengths is None:
            valid = torch.ones(spec.shape[0], frames, dtype=torch.bool, device=spec.device)
        else:
            n_frames = torch.div(lengths.to(spec.device), self.hop_length, rounding_mode="floor") + 1
            valid = torch.arange(frames, device=spec.device)[None] < n_frames.clamp(max=frames)[:, None]
        # per-clip normalisation over its own frames: independent of the batch and of padding
        w = valid[:, None, None, :].float()
        count = w.sum((2, 3), keepdim=True).clamp(min=1) * spec.shape[2]
        mean = (spec * w).sum((2, 3), keepdim=True) / count
        var = (((spec - mean) * w) ** 2).sum((2, 3), keepdim=True) / count
        spec = (spec - mean) / (var + 1e-5).sqrt() * w
        if self.training:
            for _ in range(self.num_masks):
                if self.freq_mask is not None:
                    spec = self.freq_mask(spec)
                if self.time_mask is not None:
                    spec = self.time_mask(spec)
        x = self.conv(spec.transpose(2, 3))  # [B, C, T', F']
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        out_len = self._conv_len(valid.sum(1)).clamp(min=1)
        padding = torch.arange(t, device=x.device)[None] >= out_len[:, None]
        return x, padding


class TransformerClassifier(nn.Module):
    def __init__(self, front_end, num_classes, dim, depth, heads, ff_dim, dropout, activation, norm_first,
                 positions, max_len, pooling, label_smoothing, fast_path, embed_dropout):
        super().__init__()
        if pooling not in ("mean", "cls"):
            raise ConfigError(f"transformer_classifier: pooling must be 'mean' or 'cls', got {pooling!r}")
        if positions not in ("sinusoidal", "learned", None, "none"):
            raise ConfigError(f"transformer_classifier: positions must be sinusoidal, learned or none, "
                              f"got {positions!r}")
        if dim % heads:
            raise ConfigError(f"transformer_classifier: dim={dim} is not divisible by heads={heads}")
        self.front_end = front_end
        self.pooling = pooling
        self.fast_path = fast_path
        self.label_smoothing = label_smoothing
        if pooling == "cls":
            self.cls = nn.Parameter(torch.zeros(1, 1, dim))
            nn.init.trunc_normal_(self.cls, std=0.02)
            max_len += 1
        if positions == "sinusoidal":
            self.positions = SinusoidalPositions(dim, max_len)
        elif positions == "learned":
            self.positions = LearnedPositions(dim, max_len)
        else:
            self.positions = nn.Identity()
        self.dropout = nn.Dropout(embed_dropout)
        layer = nn.TransformerEncoderLayer(dim, heads, ff_dim or 4 * dim, dropout, activation,
                                           batch_first=True, norm_first=norm_first)
        if fast_path not in (True, False, "auto"):
            raise ConfigError(f"transformer_classifier: fast_path must be true, false or auto, got {fast_path!r}")
        nested = fast_path is not False and not norm_first and heads % 2 == 0
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=nested,
                                             norm=nn.LayerNorm(dim) if norm_first else None)
        self.head = nn.Linear(dim, num_classes)

    def features(self, inputs):
        x, padding = self.front_end(inputs)
        if self.pooling == "cls":
            x = torch.cat([self.cls.expand(x.shape[0], -1, -1).to(x.dtype), x], 1)
            padding = F.pad(padding, (1, 0), value=False)
        x = self.dropout(self.positions(x))
        use = self.fast_path is True or (self.fast_path == "auto" and x.is_cuda)
        context = contextlib.nullcontext() if use else _fastpath_disabled()
        with context:
            x = self.encoder(x, src_key_padding_mask=padding)
        if self.pooling == "cls":
            return x[:, 0]
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return (x * keep).sum(1) / keep.sum(1).clamp(min=1)

    def forward(self, inputs, targets=None):
        logits = self.head(self.features(inputs))
        if self.training and targets is not None:
            return {"loss_cls": F.cross_entropy(logits, targets, label_smoothing=self.label_smoothing)}
        return logits


# torch.backends.mha's switch is one process-wide flag, and engine.evaluation.evaluate runs forwards in
# several threads at once. Saving and restoring it per forward let overlapping forwards leave it off
# for good (A saves True, B saves A's False, A restores True, B restores False): the first one in
# saves it and switches it off, the last one out restores it. While any runs, the flag is off in every
# thread: a fast_path=True forward at the same time takes the regular path (same logits up to rounding).
_fastpath_lock = threading.Lock()
_fastpath_off = {"forwards": 0, "before": True}


@contextlib.contextmanager
def _fastpath_disabled():
    with _fastpath_lock:
        if _fastpath_off["forwards"] == 0:
            _fastpath_off["before"] = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _fastpath_off["forwards"] += 1
    try:
        yield
    finally:
        with _fastpath_lock:
            _fastpath_off["forwards"] -= 1
            if _fastpath_off["forwards"] == 0:
                torch.backends.mha.set_fastpath_enabled(_fastpath_off["before"])


@MODELS.register(task="sequence", quantizable=False, exports=("onnx", "torch_export"), ranges={
    "num_classes": Range(ge=1), "dim": Range(ge=1), "depth": Range(ge=1), "heads": Range(ge=1), "ff_dim": Range(ge=1),
    "dropout": Range(ge=0, lt=1), "embed_dropout": Range(ge=0, lt=1), "max_len": Range(ge=1),
    "label_smoothing": Range(ge=0, lt=1), "vocab_size": Range(ge=1), "pad_id": Range(ge=0), "sample_rate": Range(ge=1),
    "n_mels": Range(ge=1), "n_fft": Range(ge=1), "win_length": Range(ge=1), "hop_length": Range(ge=1),
    "conv_channels": Range(ge=1)}, class_params={"head": Rows()})  # the last layer: a logit per class
def transformer_classifier(num_classes=2, front_end="tokens", dim=128, depth=2, heads=4, ff_dim: int | None = None,
                           dropout=0.1, embed_dropout=0.1, activation="gelu", norm_first=False,
                           positions="sinusoidal", max_len=512, pooling="mean", label_smoothing=0.0,
                           fast_path="auto",
                           # tokens front end
                           vocab_size: int | None = None, pad_id=0,
                           # audio front end
                           sample_rate=16000, n_mels=40, n_fft=400, win_length: int | None = None, hop_length=160,
                           conv_channels=32, spec_augment=None):
    """Transformer encoder classifier; front_end 'tokens' (text) or 'audio' (waveforms).

    Text data sets fill in vocab_size and pad_id, audio data sets sample_rate and spec_augment
    (applied in training mode only) unless the config sets them.
    """
    if activation not in ("relu", "gelu"):
        raise ConfigError(f"transformer_classifier: activation must be relu or gelu, got {activation!r}")
    if front_end == "tokens":
        fe = TokenFrontEnd(vocab_size, dim, pad_id)
    elif front_end == "audio":
        fe = AudioFrontEnd(dim, sample_rate, n_mels, n_fft, win_length, hop_length, conv_channels, spec_augment)
    else:
        raise ConfigError(f"transformer_classifier: front_end must be 'tokens' or 'audio', got {front_end!r}")
    return TransformerClassifier(fe, num_classes, dim, depth, heads, ff_dim, dropout, activation, norm_first,
                                 positions, max_len, pooling, label_smoothing, fast_path, embed_dropout)
