"""transformer_classifier: contract, padding invariance (eval, fast path on and off), audio front end."""
import threading

import pytest
import torch

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


def test_fast_path_matches_slow_path_and_uses_nested_tensors(monkeypatch):
    model = _text_model(fast_path=True)
    assert model.encoder.use_nested_tensor
    _, batch = _ragged_batch()
    calls = []
    real = torch._nested_tensor_from_mask
    monkeypatch.setattr(torch, "_nested_tensor_from_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        fast = model(batch)
        model.fast_path = False
        slow = model(batch)
        model.fast_path = "auto"
        auto = model(batch)
    assert len(calls) == 1  # the fast run only (auto is off on CPU)
    assert torch.allclose(fast, slow, atol=1e-5) and torch.equal(auto, slow)


def test_overlapping_forwards_in_threads_leave_the_fast_path_switch_on():
    """engine.evaluation.evaluate runs one batch per thread at once on CPU. The regular path turns off
    torch.backends.mha's switch, one flag for the whole process, during each forward; the hooks order
    two forwards as a race can: the second starts inside the first and ends after it."""
    model = _text_model()  # fast_path auto: the regular path on CPU
    _, batch = _ragged_batch()
    first_inside, second_inside = threading.Event(), threading.Event()
    threads, logits = {}, {}

    def entering_encoder(module, args):
        if threading.current_thread() is threads["first"]:
            first_inside.set()
            assert second_inside.wait(30)
        else:
            second_inside.set()

    def leaving_encoder(module, args, output):
        if threading.current_thread() is threads["second"]:
            threads["first"].join(30)  # the first forward ends first

    def forward(name):
        with torch.no_grad():
            logits[name] = model(batch)

    model.encoder.register_forward_pre_hook(entering_encoder)
    model.encoder.register_forward_hook(leaving_encoder)
    assert torch.backends.mha.get_fastpath_enabled()
    for name in ("first", "second"):
        threads[name] = threading.Thread(target=forward, args=(name,))
    threads["first"].start()
    assert first_inside.wait(30)
    threads["second"].start()
    threads["second"].join(60)
    assert set(logits) == {"first", "second"}
    assert torch.backends.mha.get_fastpath_enabled()  # was left off: later forwards lost the fast path
    # the switch stayed off until both had left: the same kernels (it was back on inside the second)
    assert torch.equal(logits["first"], logits["second"])


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
    grad = model.front_end.conv[0].weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0  # the front end learns
