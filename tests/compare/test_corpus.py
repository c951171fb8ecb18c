"""helpers.compare.corpus: the offline corpus and word tokenizer behind the pretraining A/B (notebook 03)."""

from collections import Counter

import pytest
import torch

from helpers.compare.corpus import (
    UNK,
    UNK_ID,
    Vocabulary,
    build_corpus,
    corpus_files,
    default_cache_dir,
    load_or_build_corpus,
    stdlib_root,
    summary_lines,
    tokenize,
)


def test_tokenize_splits_words_and_punctuation_and_drops_whitespace():
    assert tokenize("def f(x):\n    return x+1  # done") == [
        "def", "f", "(", "x", ")", ":", "return", "x", "+", "1", "#", "done"
    ]


def test_vocabulary_ranks_by_count_then_string_with_unk_first():
    vocab = Vocabulary.build(Counter({"b": 3, "a": 3, "c": 5, "d": 1}), size=4)
    assert vocab.types == (UNK, "c", "a", "b")


def test_encode_decode_round_trip_and_unknown_types():
    tokens = tokenize("x = y + x ( z )")
    vocab = Vocabulary.build(Counter(tokens), size=100)
    assert vocab.decode(vocab.encode(tokens)) == tokens
    ids = vocab.encode(["x", "never_seen"])
    assert ids[1] == UNK_ID and vocab.decode(ids) == ["x", UNK]


def test_corpus_files_are_sorted_and_leave_out_tests_and_installed_packages():
    files = corpus_files()
    assert files == sorted(files) and len(files) > 300
    assert not [f for f in files if {"site-packages", "test", "tests", "__pycache__"} & set(f.split("/"))]
    subset = corpus_files(max_files=50)
    assert len(subset) == 50 and set(subset) <= set(files)
    assert subset[-1] > files[len(files) // 2]  # spread over the whole list, not its start


def test_build_is_deterministic():
    a = build_corpus(300, max_files=25)
    b = build_corpus(300, max_files=25)
    assert a.fingerprint == b.fingerprint and a.vocab.types == b.vocab.types
    assert torch.equal(a.train_ids, b.train_ids) and torch.equal(a.val_ids, b.val_ids)
    assert a.train_ids.max() < 300 and a.val_ids.numel() > 0


def test_vocabulary_comes_from_the_training_split_only():
    corpus = build_corpus(10**6, max_files=40, val_every=4)
    assert (corpus.train_counts[1:] >= 1).all()  # every kept type occurs in training
    assert corpus.train_counts[UNK_ID] == 0  # nothing is cut when the cap is above the type count
    assert (corpus.val_ids == UNK_ID).any()  # validation holds types training never saw


def test_the_full_corpus_has_a_long_tail_of_rare_types():
    tokens = []
    for rel in corpus_files():
        tokens += tokenize((stdlib_root() / rel).read_text(encoding="utf-8", errors="replace"))
    counts = torch.tensor(sorted(Counter(tokens).values(), reverse=True))
    assert counts.numel() > 20_000  # tens of thousands of types
    assert (counts <= 2).float().mean() > 0.3  # a third or more seen at most twice
    assert counts[0] > 1000 * counts[counts.numel() // 2]  # Zipf: head far above the median


def test_cache_round_trip(tmp_path):
    built = load_or_build_corpus(tmp_path, 200, max_files=20)
    assert len(list(tmp_path.glob("corpus-*.pt"))) == 1
    loaded = load_or_build_corpus(tmp_path, 200, max_files=20)
    assert loaded.vocab.types == built.vocab.types and loaded.fingerprint == built.fingerprint
    assert torch.equal(loaded.train_ids, built.train_ids) and torch.equal(loaded.type_counts, built.type_counts)
    load_or_build_corpus(tmp_path, 201, max_files=20)
    assert len(list(tmp_path.glob("corpus-*.pt"))) == 2  # a different vocabulary is a different key


def test_vocabulary_size_must_leave_room_for_a_type():
    with pytest.raises(ValueError, match="at least 2"):
        Vocabulary.build(Counter({"a": 1}), size=1)


def test_the_cache_lives_outside_any_results_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "helpers" / "corpus"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "helpers" / "corpus"
    built = load_or_build_corpus(None, 200, max_files=20)  # None: the default folder
    assert len(list(default_cache_dir().glob("corpus-*.pt"))) == 1
    assert load_or_build_corpus(None, 200, max_files=20).fingerprint == built.fingerprint
    assert not list(default_cache_dir().glob("*.partial"))  # written whole, then renamed


def test_the_summary_for_a_reader_hides_the_fingerprint_and_rounds():
    corpus = build_corpus(200, max_files=20)
    summary = corpus.describe()
    lines = summary_lines(summary)
    assert summary["fingerprint"] and not any(summary["fingerprint"] in line for line in lines)
    assert len(lines) == len(summary) - 1
    unk = next(line for line in lines if line.startswith("unk fraction val"))
    assert unk.split()[-1] == f"{summary['unk_fraction_val']:.1%}"
    tokens = next(line for line in lines if line.startswith("train tokens"))
    assert tokens.split()[-1] == f"{summary['train_tokens']:,}" and "," in tokens.split()[-1]
