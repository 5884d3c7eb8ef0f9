"""Text data: torchtext-style CSV reading, stratified split, tokenizer save/reload, batching."""
import collections
import json
import os

import pytest
import torch

from conftest import ROOT, shared_data
from datasets import text
from engine.registry import DATASETS
from tokenizers import Tokenizer


def _write(path, content):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", newline="") as f:
        f.write(content)
    return path


def _csv_root(tmp_path, rows_per_class=20, classes=3):
    lines = []
    for i in range(rows_per_class):
        for c in range(1, classes + 1):
            lines.append(f'"{c}","title {c} word{c}{i % 3}","body about class{c} and, commas ""quoted"" {i}"\n')
    _write(str(tmp_path / "data" / "train.csv"), "".join(lines))
    _write(str(tmp_path / "data" / "test.csv"), "".join(lines[: 3 * classes]))
    return str(tmp_path / "data")


def test_read_csv_joins_text_columns_and_makes_labels_zero_based(tmp_path):
    path = _write(str(tmp_path / "a.csv"), '"2","Title","Body, with comma"\n\n"1","Only","x"\n')
    texts, labels = text.read_csv(path)
    assert texts == ["Title Body, with comma", "Only x"]
    assert labels == [1, 0]
    texts, _ = text.read_csv(path, text_columns=[2])
    assert texts == ["Body, with comma", "x"]


def test_empty_csv_names_the_file(tmp_path):
    root = _csv_root(tmp_path)
    _write(os.path.join(root, "test.csv"), "")
    with pytest.raises(ValueError, match=r"test\.csv: the CSV file is empty"):
        DATASETS.build("csv_text", root=root, vocab_size=100)


@pytest.mark.parametrize("row, pattern", [('"five","x","y"\n', "unknown label 'five'"),
                                          ('"0","x","y"\n', "unknown label 0"),
                                          ('"4","x","y"\n', r"unknown label 4 .*expected 1\.\.3")])
def test_unknown_label_row_names_file_and_row(tmp_path, row, pattern):
    root = _csv_root(tmp_path)
    with open(os.path.join(root, "train.csv"), "a") as f:
        f.write(row)
    with pytest.raises(ValueError, match=r"train\.csv, row 61: " + pattern):
        DATASETS.build("csv_text", root=root, classes=["a", "b", "c"], vocab_size=100)


def test_missing_file_and_folder_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        DATASETS.build("csv_text", root=str(tmp_path / "nowhere"))
    root = _csv_root(tmp_path)
    with pytest.raises(FileNotFoundError, match="dev.csv"):
        DATASETS.build("csv_text", root=root, val_file="dev.csv", vocab_size=100)


def test_stratified_split_is_per_class_and_seeded():
    labels = [0] * 50 + [1] * 30 + [2] * 20
    tr, va = text.stratified_split(labels, 0.2, seed=0)
    assert sorted(tr + va) == list(range(100)) and not set(tr) & set(va)
    assert collections.Counter(labels[i] for i in va) == {0: 10, 1: 6, 2: 4}
    assert (tr, va) == text.stratified_split(labels, 0.2, seed=0)
    assert va != text.stratified_split(labels, 0.2, seed=1)[1]


def test_csv_text_with_val_fraction_and_tokenizer_on_train_split_only(tmp_path):
    root = _csv_root(tmp_path)
    out = str(tmp_path / "run")
    data = DATASETS.build("csv_text", root=root, val_fraction=0.25, vocab_size=200, min_frequency=1,
                          max_length=6, output_dir=out)
    assert len(data.train) == 45 and len(data.val) == 15
    assert data.classes == ["1", "2", "3"] and data.model_defaults["num_classes"] == 3
    assert data.model_defaults["vocab_size"] == data.train.tokenizer.get_vocab_size()
    assert max(data.train.lengths) == 6  # truncation
    assert Tokenizer.from_file(os.path.join(out, "tokenizer.json")).get_vocab() == data.train.tokenizer.get_vocab()
    meta = json.load(open(os.path.join(out, "tokenizer_meta.json")))
    assert meta["num_texts"] == 45 and meta["kind"] == "wordpiece"


def test_tokenizer_sees_the_training_split_only(tmp_path):
    root = _csv_root(tmp_path)
    _write(os.path.join(root, "test.csv"), '"1","zebrafish zebrafish zebrafish"\n' * 30)
    data = DATASETS.build("csv_text", root=root, vocab_size=300, min_frequency=1)
    vocab = data.train.tokenizer.get_vocab()
    assert "commas" in vocab and "zebrafish" not in vocab
    # no "z" in the training texts: WordPiece cannot spell the word, each of the three is [UNK]
    tokens = [data.train.tokenizer.id_to_token(i) for i in data.val[0][0].tolist()]
    assert len(data.val) == 30 and tokens == ["[UNK]"] * 3, tokens


def test_bpe_tokenizer_and_class_presets(tmp_path):
    root = _csv_root(tmp_path, classes=4)
    data = DATASETS.build("csv_text", root=root, tokenizer="bpe", vocab_size=150, classes="ag_news")
    assert data.classes == ["World", "Sports", "Business", "Sci/Tech"]
    assert data.train.tokenizer.token_to_id("[PAD]") == 0
    with pytest.raises(ValueError, match="preset"):
        DATASETS.build("csv_text", root=root, classes="imdb")


def test_collate_pads_dynamically():
    batch = [(torch.tensor([5, 6, 7]), 1), (torch.tensor([8]), 0)]
    tokens, labels = text.pad_collate(batch)
    assert tokens.tolist() == [[5, 6, 7], [8, 0, 0]] and labels.tolist() == [1, 0]


def test_length_bucketed_batches_cover_the_data_with_less_padding():
    g = torch.Generator()
    lengths = torch.randint(1, 200, (1000,), generator=torch.Generator().manual_seed(0)).tolist()
    sampler = torch.utils.data.RandomSampler(range(1000), generator=g)
    bucketed = text.LengthBucketBatchSampler(lengths, sampler, 16, bucket_batches=20)
    g.manual_seed(3)
    batches = list(bucketed)
    assert len(batches) == len(bucketed) == 1000 // 16
    assert all(len(b) == 16 for b in batches)
    flat = [i for b in batches for i in b]
    assert len(set(flat)) == len(flat)

    def waste(bs):
        return sum(max(lengths[i] for i in b) * len(b) - sum(lengths[i] for i in b) for b in bs)

    plain = list(torch.utils.data.BatchSampler(range(1000), 16, drop_last=True))
    assert waste(batches) < 0.2 * waste(plain)
    g.manual_seed(3)
    assert list(bucketed) == batches  # same generator state -> same batches (exact resume)
    g.manual_seed(4)
    assert list(bucketed) != batches


def _synthetic_cfg(*overrides):
    from engine.config import load_config
    return load_config(os.path.join(ROOT, "configs", "transformer_text_synthetic.yaml"),
                       ["train.epochs=1", "data.train_size=400", "data.val_size=100", *overrides])


def test_tokenizer_round_trip_after_resume_and_in_evaluate(tmp_path, monkeypatch):
    import evaluate
    from engine.loop import train
    seen = []
    original = text.TokenizedText.__init__

    def record(self, *a, **k):
        original(self, *a, **k)
        seen.append(self)
    monkeypatch.setattr(text.TokenizedText, "__init__", record)
    sample = "topic1word3 kan some unseen Words, topic2word0!"
    out = str(tmp_path / "run")

    run = train(_synthetic_cfg(), out)
    ids = run.data.train.encode(sample).tolist()
    assert ids == run.data.val.encode(sample).tolist() and len(ids) > 3
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))

    def no_training(*a, **k):
        raise AssertionError("the tokenizer was trained again instead of reloaded")
    monkeypatch.setattr(text, "train_tokenizer", no_training)
    seen.clear()
    resumed = train(_synthetic_cfg("train.epochs=2"), out, resume=os.path.join(out, "last.pt"))
    assert resumed.epoch == 1 and seen
    assert all(d.encode(sample).tolist() == ids for d in seen)

    seen.clear()
    try:
        report = evaluate.main(["--checkpoint", os.path.join(out, "last.pt"), "--report-dir", str(tmp_path / "eval")])
    finally:
        torch.set_grad_enabled(True)  # evaluate.main switches autograd off for the process
    assert seen and all(d.encode(sample).tolist() == ids for d in seen)
    assert report["metrics"]["top1"] == pytest.approx(resumed.metrics["val/top1"])
    assert report["per_class_accuracy"].keys() == {"topic0", "topic1", "topic2", "topic3"}
    assert len(report["confusion_matrix"]) == 4


def test_tokenizer_of_another_run_or_missing_is_an_error(tmp_path):
    out = str(tmp_path / "run")
    DATASETS.build("synthetic_text", train_size=200, val_size=50, output_dir=out)
    with pytest.raises(ValueError, match=r"tokenizer\.json was made for other settings.*vocab_size"):
        DATASETS.build("synthetic_text", train_size=200, val_size=50, vocab_size=300, output_dir=out)
    with pytest.raises(ValueError, match="another training split|texts_sha256"):
        DATASETS.build("synthetic_text", train_size=200, val_size=50, seed=5, output_dir=out)
    os.remove(os.path.join(out, "tokenizer.json"))
    open(os.path.join(out, "last.pt"), "wb").close()
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json is missing"):
        DATASETS.build("synthetic_text", train_size=200, val_size=50, output_dir=out)


def test_synthetic_text_is_learnable(tmp_path):
    from engine.loop import train
    run = train(_synthetic_cfg("train.epochs=3", "data.train_size=800"), str(tmp_path / "run"))
    assert run.metrics["val/top1"] > 80  # chance is 25%


def test_ag_news_shared_split():
    root = shared_data("ag_news")
    texts, labels = text.read_csv(os.path.join(root, "test.csv"))
    assert len(texts) == 7600 and collections.Counter(labels) == {0: 1900, 1: 1900, 2: 1900, 3: 1900}
    tr, va = text.stratified_split(labels, 0.2, seed=0)
    assert len(va) == 1520 and collections.Counter(labels[i] for i in va) == {c: 380 for c in range(4)}


def test_seeded_samples_read_tokenized_text_as_it_is():
    """TokenizedText draws nothing random, so the training loader reads its items without seeding."""
    from engine.seeding import SeededSamples
    data = DATASETS.build("synthetic_text", train_size=40, val_size=10, vocab_size=100)
    before = torch.get_rng_state()
    got = SeededSamples(data.train).__getitems__([(3, i) for i in (5, 0, 7)])
    assert torch.equal(before, torch.get_rng_state())
    for (ids, label), i in zip(got, (5, 0, 7)):
        assert torch.equal(ids, data.train[i][0]) and label == data.train[i][1]
