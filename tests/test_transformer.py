"""transformer_classifier: contract, padding invariance (eval, fast path on and off), audio front end."""
import pytest
import torch

from conftest import ROOT

from engine.registry import MODELS


def _text_model(**kw):
    torch.manual_seed(0)
    args = dict(num_classes=3, vocab_size=50, dim=32, depth=2, heads=4, ff_dim=64, dropout=0.1)
    args.update(kw)
    return MODELS.build("transformer_classifier", **args).eval()


def _ragged_batch(lengths=(3, 11, 7, 1, 16), vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    return seqs, torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=0)


@pytest.mark.parametrize("kw", [
    dict(fast_path=True),                                      # fast path, nested tensors, mean pooling
    dict(fast_path=False),                                     # reference math path
    dict(),                                                    # auto: off on CPU
    dict(pooling="cls", positions="learned"),
    dict(norm_first=True, activation="relu"),                  # no nested tensors (norm_first)
])
def test_padding_does_not_change_logits(kw):
    model = _text_model(**kw)
    seqs, batch = _ragged_batch()
    with torch.no_grad():
        padded = model(batch)
        alone = torch.cat([model(s[None]) for s in seqs])
        # extra padding columns beyond the longest sequence change nothing either
        wider = model(torch.nn.functional.pad(batch, (0, 5)))
    assert padded.shape == (len(seqs), 3)
    assert torch.allclose(padded, alone, atol=1e-5, rtol=0), (padded - alone).abs().max()
    assert torch.allclose(wider, alone, atol=1e-5, rtol=0), (wider - alone).abs().max()


def test_padding_would_matter_without_mask():
    """The invariance test can fail: attending to pad embeddings changes the logits."""
    model = _text_model(fast_path=False)
    seqs, batch = _ragged_batch()
    model.front_end.pad_id = -1  # nothing is treated as padding; id 0 is still the (zero) pad embedding
    with torch.no_grad():
        padded = model(batch)
        alone = torch.cat([model(s[None]) for s in seqs])
    assert not torch.allclose(padded, alone, atol=1e-5)


def _fast_path_check():
    model = _text_model(fast_path=True)
    assert model.encoder.use_nested_tensor
    _, batch = _ragged_batch()
    calls = []
    real = torch._nested_tensor_from_mask
    torch._nested_tensor_from_mask = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        with torch.no_grad():
            fast = model(batch)
            model.fast_path = False
            slow = model(batch)
            model.fast_path = "auto"
            auto = model(batch)
    finally:
        torch._nested_tensor_from_mask = real
    assert len(calls) == 1  # the fast run only (auto is off on CPU)
    assert torch.allclose(fast, slow, atol=1e-5) and torch.equal(auto, slow)


def test_fast_path_matches_slow_path_and_uses_nested_tensors():
    """In a fresh process: after other tests' training runs in this one (tests/test_predict.py), the
    encoder stopped taking the nested-tensor path; not diagnosed yet (see the issue 10 closing note)."""
    import subprocess
    import sys
    code = "import sys; sys.path[:0] = ['tests', '.']; import test_transformer as t; t._fast_path_check()"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_training_returns_loss_dict_and_eval_returns_logits():
    model = _text_model(label_smoothing=0.1).train()
    _, batch = _ragged_batch()
    out = model(batch, torch.tensor([0, 1, 2, 0, 1]))
    assert set(out) == {"loss_cls"} and out["loss_cls"].requires_grad
    out["loss_cls"].backward()
    assert model.front_end.embed.weight.grad[0].abs().sum() == 0  # padding index gets no gradient
    model.eval()
    with torch.no_grad():
        assert model(batch).shape == (5, 3)
        assert model({"tokens": batch}).shape == (5, 3)


def test_bad_options():
    with pytest.raises(ValueError, match="front_end"):
        MODELS.build("transformer_classifier", front_end="video")
    with pytest.raises(ValueError, match="vocab_size"):
        MODELS.build("transformer_classifier", front_end="tokens")
    with pytest.raises(ValueError, match="pooling"):
        _text_model(pooling="max")
    with pytest.raises(ValueError, match="divisible"):
        _text_model(dim=30, heads=4)
    with pytest.raises(ValueError, match="fast_path"):
        _text_model(fast_path="yes")
    with pytest.raises(ValueError, match="max_len"):
        _text_model(max_len=8)(torch.ones(1, 9, dtype=torch.long))


def _audio_model(**kw):
    torch.manual_seed(0)
    args = dict(front_end="audio", num_classes=4, sample_rate=8000, n_mels=32, n_fft=256, hop_length=80,
                conv_channels=8, dim=32, depth=1, heads=2, ff_dim=64)
    args.update(kw)
    return MODELS.build("transformer_classifier", **args)


def test_audio_front_end_is_per_clip_and_spec_augment_only_in_training():
    model = _audio_model(spec_augment={"freq_mask": 8, "time_mask": 20, "num_masks": 2}).eval()
    g = torch.Generator().manual_seed(1)
    waves = torch.randn(3, 8000, generator=g) * torch.tensor([[0.01], [1.0], [10.0]])
    lengths = torch.tensor([8000, 5000, 3000])
    waves[1, 5000:] = 0
    waves[2, 3000:] = 0
    batch = {"audio": waves, "lengths": lengths}
    with torch.no_grad():
        together = model(batch)
        alone = torch.cat([model({"audio": waves[i:i + 1], "lengths": lengths[i:i + 1]}) for i in range(3)])
        again = model(batch)
    assert torch.allclose(together, alone, atol=1e-5), (together - alone).abs().max()
    assert torch.equal(together, again)  # eval: no masking noise
    model.train()
    torch.manual_seed(0)
    a = model.front_end(batch)[0]
    torch.manual_seed(1)
    b = model.front_end(batch)[0]
    assert not torch.allclose(a, b)  # training: random SpecAugment masks
    x, padding = model.front_end(batch)
    assert x.shape[:2] == padding.shape and padding[0].sum() == 0 and padding[2].sum() > padding[1].sum() > 0
    loss = model(batch, torch.tensor([0, 1, 2]))["loss_cls"]
    loss.backward()
    assert model.front_end.conv[0].weight.grad is not None
