"""Issue 26, faults 6 and 8, in the loaders (training and the data doctor alike): a CSV whose unbalanced
quote swallows most of the file, and COCO images whose decoded size differs from the JSON."""
import json
import logging
import shutil

import pytest

import datasets.coco
from datasets.base import Skipped
from engine.errors import BadSample, DataError
from datasets.shapes import ensure_shapes
from datasets.text import csv_text, read_csv
from engine.registry import DATASETS

SMALL = dict(num_train=12, num_val=4, image_size=48)


def test_unbalanced_quote_that_swallows_the_file_is_an_error_naming_the_line(tmp_path):
    """Fault 6: one open quote at line 58 of 400 made 342 rows one text, and the run exited 0."""
    rows = [f"{1 + k % 4},headline {k},some description of item {k}" for k in range(400)]
    rows[57] = '3,"an opening quote that never closes,and more'
    (tmp_path / "train.csv").write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=r"train\.csv: 58 rows parsed from 400 lines: row 58 runs from line 58 over "
                                        r"343 lines.*fix the quoting of line 58"):
        csv_text(str(tmp_path), val_fraction=0.2, vocab_size=50)


def test_texts_with_line_breaks_and_blank_lines_still_load(tmp_path):
    """Quoted texts over two lines (half as many rows as lines) and blank lines are not the fault."""
    rows = [f'{1 + k % 2},"first line {k}\nsecond line {k}"' for k in range(30)]
    (tmp_path / "train.csv").write_text("\n\n".join(rows) + "\n")
    texts, labels = read_csv(str(tmp_path / "train.csv"))
    assert len(texts) == 30 and texts[0] == "first line 0\nsecond line 0"


@pytest.fixture
def shapes_copy(tmp_path):
    root = tmp_path / "shapes"
    shutil.copytree(ensure_shapes(str(tmp_path / "gen"), **SMALL), root)
    path = root / "annotations" / "instances_train2017.json"
    data = json.loads(path.read_text())
    info = data["images"][3]
    info["width"] += 8  # the boxes, drawn for the real size, are now read against another
    path.write_text(json.dumps(data))
    return str(root), str(root / "train2017" / info["file_name"])


def test_image_whose_size_differs_from_the_json_is_refused_unless_allowed(shapes_copy, caplog):
    """Fault 8: such images trained on misaligned boxes with no warning."""
    root, image = shapes_copy
    with pytest.raises(DataError, match=rf"instances_train2017\.json: 1 of 12 images decode to another size than "
                                        rf"their record says: {image}: image \d+ decodes to \d+x\d+ but .* says .*"
                                        rf"data\.allow_size_mismatch: true"):
        DATASETS.build("shapes", root=root, **SMALL)
    with caplog.at_level(logging.WARNING, logger="datasets.coco"):
        data = DATASETS.build("shapes", root=root, allow_size_mismatch=True, **SMALL)
    assert len(data.train.size_mismatches) == 1 and image in data.train.size_mismatches[0]
    assert "1 of 12 images decode to another size" in caplog.text


def test_in_a_split_too_large_to_check_first_the_image_is_a_bad_sample_when_read(shapes_copy, monkeypatch):
    root, image = shapes_copy
    monkeypatch.setattr(datasets.coco, "SIZE_CHECK_LIMIT", 5)
    data = DATASETS.build("shapes", root=root, cache_images=False, **SMALL)
    index = [data.train.coco.imgs[i]["file_name"] for i in data.train.image_ids].index(image.rsplit("/", 1)[1])
    with pytest.raises(BadSample, match=rf"{image}: image \d+ decodes to .*data\.allow_size_mismatch: true trains on it"):
        data.train[index]
    skipping = DATASETS.build("shapes", root=root, cache_images=False, skip_bad_samples=True, **SMALL)
    assert isinstance(skipping.train[index], Skipped)
    allowed = DATASETS.build("shapes", root=root, cache_images=False, allow_size_mismatch=True, **SMALL)
    assert not isinstance(allowed.train[index], Skipped)
