"""Where corpora are found (fedmq.tasks.corpora): one data folder, $FEDMQ_DATA_DIR or ~/.cache/fedmq/data; a
``--data`` path is a path, a bare name is looked up in the data folder; tests/fixtures/corpora is the start of
the real corpora."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedmq.tasks.corpora import corpus_dir, data_home, find, resolve
from fedmq.tasks.errors import TaskError

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "corpora"


def _ptb(folder: Path) -> Path:
    folder.mkdir(parents=True)
    for split in ("train", "valid", "test"):
        (folder / f"ptb.{split}.txt").write_text("a b c\n")
    return folder


def test_the_data_folder_is_fedmq_data_dir_else_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("FEDMQ_DATA_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert data_home() == tmp_path / "home" / ".cache" / "fedmq" / "data"
    monkeypatch.setenv("FEDMQ_DATA_DIR", str(tmp_path / "data"))
    assert data_home() == tmp_path / "data" and corpus_dir("ptb") == tmp_path / "data" / "ptb"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEDMQ_DATA_DIR", "rel")  # relative: taken from the working directory, made absolute
    assert data_home() == tmp_path / "rel"


def test_a_name_is_looked_up_in_the_data_folder_and_a_path_is_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMQ_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    cached = _ptb(tmp_path / "data" / "ptb")
    here = _ptb(tmp_path / "ptb")
    assert resolve("ptb") == str(cached) == str(find("ptb"))  # the name: the data folder's, not ./ptb
    assert resolve("./ptb") == "ptb" and resolve(str(here)) == str(here)  # paths are paths
    _ptb(tmp_path / "mine")
    assert resolve("mine") == "mine"  # a name the data folder lacks but that is a folder here
    assert resolve("builtin") == "builtin"


def test_a_missing_corpus_is_one_line_naming_the_folder_looked_in(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMQ_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.chdir(tmp_path)
    for call in (lambda: find("wikitext-2"), lambda: resolve("wikitext-2")):
        with pytest.raises(TaskError) as info:
            call()
        text = str(info.value)
        assert "\n" not in text and "corpus 'wikitext-2' is not on this machine" in text
        assert f"at {tmp_path / 'data' / 'wikitext-2'} (looked there: no such folder)" in text
        assert "set FEDMQ_DATA_DIR" in text and "pytorch/examples" in text
    (tmp_path / "data" / "ptb").mkdir(parents=True)  # a folder without the corpus's files
    with pytest.raises(TaskError, match=r"looked there: no ptb\.train\.txt in it"):
        find("ptb")
    with pytest.raises(TaskError, match=r"data \(--data\) ./nope: no such folder"):
        resolve("./nope")
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(TaskError, match="is a file"):
        resolve("a-file")


@pytest.mark.parametrize(
    "name,files",
    [
        ("wikitext-2", ["wiki.train.tokens", "wiki.valid.tokens", "wiki.test.tokens"]),
        ("de-en", [f"news_wmt/news-test2008.{x}" for x in ("de", "en")] + ["ted_iwslt14/test.de"]),
        ("de-en", ["ted_iwslt14/test.en"]),
    ],
)
def test_the_fixture_slices_are_the_first_lines_of_the_real_corpora(real_corpus, name, files):
    """The smoke experiments read tests/fixtures/corpora instead of the real corpora: the same numbers only
    while every slice is the start of its real file."""
    real = real_corpus(name)
    for rel in files:
        part = (FIXTURES / name / rel).read_bytes()
        assert part.count(b"\n") >= 40
        with open(real / rel, "rb") as f:
            assert f.read(len(part)) == part, rel
