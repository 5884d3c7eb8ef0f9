"""engine.paths: names from data stay in their folder; the one file walker and its symlink rules."""
import os

import pytest

from engine.paths import OutsideFolder, inside, join_inside, walk_files


def test_names_that_leave_the_folder_are_refused_naming_where_they_came_from(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.png").write_bytes(b"x")
    os.symlink(tmp_path, tmp_path / "data" / "out")
    assert join_inside(str(tmp_path / "data"), "a.png", "x.json") == str(tmp_path / "data" / "a.png")
    for bad in ("/etc/passwd", "../a.png", "sub/../../a.png", "out/a.png", "", "a\\..\\b", None, 5):
        assert not inside(str(tmp_path / "data"), bad)
        with pytest.raises(OutsideFolder, match=r"x\.json, annotation 7"):
            join_inside(str(tmp_path / "data"), bad, "x.json, annotation 7")


def test_a_directory_symlink_loop_is_not_followed_by_default_and_counted_once_when_followed(tmp_path):
    for c in ("0", "1"):
        (tmp_path / c).mkdir()
        for i in range(2):
            (tmp_path / c / f"{i}.png").write_bytes(b"x")
    os.symlink("..", tmp_path / "1" / "uploop")
    plain = walk_files(str(tmp_path), suffixes=(".png",))
    assert [os.path.relpath(p, tmp_path) for p in plain] == ["0/0.png", "0/1.png", "1/0.png", "1/1.png"]
    assert plain.not_followed == [str(tmp_path / "1" / "uploop")] and plain.loops == []
    followed = walk_files(str(tmp_path), suffixes=(".PNG",), follow_symlinks=True)
    assert len(followed) == 4 and followed.loops == [str(tmp_path / "1" / "uploop")]
    # two links to one folder and a hard link: each file once
    os.symlink(tmp_path / "0", tmp_path / "1" / "again")
    os.link(tmp_path / "0" / "0.png", tmp_path / "1" / "hard.png")
    assert len(walk_files(str(tmp_path), follow_symlinks=True)) == 4
