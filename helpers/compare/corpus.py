"""A real text corpus every machine has offline: the Python standard library's own source.

The pretraining A/B (notebook 03) needs text with a long tail of rare tokens, because the question
is whether Cut Cross-Entropy's gradient filter starves rare tokens. Downloading a corpus is not an
option (Kaggle sessions may be offline; CI is), but every Python installation carries ~12 MB of
source code, comments and docstrings under ``sysconfig.get_paths()["stdlib"]``. Split into words
and punctuation it is ~2.5 M tokens over ~50 k types, a third of which occur once: a Zipf tail like
natural text's, made of identifiers instead of rare words.

Pipeline (each step deterministic, so the same Python version gives the same token ids anywhere):

1. ``corpus_files``: every ``.py`` under the stdlib, sorted by relative path; third-party packages
   (``site-packages``) and the test suites (absent from Debian/Ubuntu/Colab installs) are left out.
2. ``tokenize``: ``\\w+`` words and single punctuation characters; whitespace is dropped.
3. Files are split by position: every ``val_every``-th file is validation, the rest training (a
   whole file on one side, so validation text is unseen text, not shuffled neighbours).
4. ``Vocabulary.build``: the ``vocab_size - 1`` most frequent *training* types, ties broken by the
   string, plus ``<unk>`` at id 0 for the rest. Training counts decide the frequency bins of the
   rare-token diagnostic, so they come from the training split only.

``load_or_build_corpus`` caches the result under a key that covers all of the above.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import sysconfig
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

# Words (letters, digits, underscore) or one punctuation character; whitespace separates tokens and
# is not itself a token. Bump TOKENIZER_VERSION when this changes: it is part of the cache key.
TOKEN_PATTERN = re.compile(r"\w+|[^\w\s]")
TOKENIZER_VERSION = 1
UNK = "<unk>"
UNK_ID = 0

# Directories never read: installed third-party code differs between machines, and the test suites
# are missing from distribution-packaged Pythons (Colab's), so leaving them out keeps the corpus
# the same wherever the Python version is the same.
EXCLUDED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | str | None = None, max_files: int | None = None) -> list[str]:
    """Relative paths (posix) of the corpus's ``.py`` files, sorted.

    ``max_files`` keeps that many, evenly spaced through the sorted list (so a small corpus still
    samples every package instead of the alphabetically first few).
    """
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for directory, subdirectories, names in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in EXCLUDED_DIRECTORIES]
        rel = Path(directory).relative_to(root)
        files += [(rel / n).as_posix() for n in names if n.endswith(".py")]
    files.sort()
    if max_files is not None and max_files < len(files):
        step = len(files) / max_files
        files = [files[int(i * step)] for i in range(max_files)]
    return files


def tokenize(text: str) -> list[str]:
    return TOKEN_PATTERN.findall(text)


@dataclass(frozen=True)
class Vocabulary:
    """Token types by id; id 0 is ``<unk>``, the rest by descending training count."""

    types: tuple[str, ...]

    def __post_init__(self):
        object.__setattr__(self, "_ids", {t: i for i, t in enumerate(self.types)})

    def __len__(self) -> int:
        return len(self.types)

    @classmethod
    def build(cls, counts: Counter, size: int) -> Vocabulary:
        """The ``size - 1`` most frequent types of ``counts`` (ties by string) after ``<unk>``."""
        if size < 2:
            raise ValueError(f"vocabulary size must be at least 2 (<unk> and one type), got {size}")
        ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
        return cls((UNK,) + tuple(t for t, _ in ranked[: size - 1]))

    def encode(self, tokens: Iterable[str]) -> torch.Tensor:
        """(T,) int64 ids; a type outside the vocabulary becomes ``<unk>``."""
        ids = self._ids
        return torch.tensor([ids.get(t, UNK_ID) for t in tokens], dtype=torch.int64)

    def decode(self, ids: torch.Tensor | Iterable[int]) -> list[str]:
        return [self.types[int(i)] for i in ids]


@dataclass
class Corpus:
    """Token ids of the training and validation splits, and what they were built from."""

    vocab: Vocabulary
    train_ids: torch.Tensor  # (T_train,) int64
    val_ids: torch.Tensor  # (T_val,) int64
    fingerprint: str  # sha256 of the files' paths and bytes: equal fingerprints, equal corpora
    n_files: int
    type_counts: torch.Tensor  # (types,) count of every distinct training type, descending, before the cap

    @property
    def train_counts(self) -> torch.Tensor:
        """(V,) how often each vocabulary id occurs in the training split (``<unk>`` included)."""
        return torch.bincount(self.train_ids, minlength=len(self.vocab))

    def describe(self) -> dict:
        counts = self.train_counts[1:]
        return {
            "source": f"Python {sys.version.split()[0]} standard library source",
            "fingerprint": self.fingerprint,
            "files": self.n_files,
            "train_tokens": int(self.train_ids.numel()),
            "val_tokens": int(self.val_ids.numel()),
            "vocab_size": len(self.vocab),
            "types_in_training_split": int(self.type_counts.numel()),
            "unk_fraction_train": float((self.train_ids == UNK_ID).float().mean()),
            "unk_fraction_val": float((self.val_ids == UNK_ID).float().mean()),
            "rarest_kept_count": int(counts.min()) if counts.numel() else 0,
            "types_seen_under_10_times": int((counts < 10).sum()),
        }


def build_corpus(
    vocab_size: int,
    *,
    max_files: int | None = None,
    val_every: int = 20,
    root: Path | str | None = None,
) -> Corpus:
    """Read, tokenize, split and encode the corpus; see the module docstring for each step."""
    root = Path(root) if root is not None else stdlib_root()
    files = corpus_files(root, max_files)
    digest = hashlib.sha256()
    train_tokens: list[str] = []
    val_tokens: list[str] = []
    for i, rel in enumerate(files):
        data = (root / rel).read_bytes()
        digest.update(rel.encode() + b"\0" + data + b"\0")
        tokens = tokenize(data.decode("utf-8", errors="replace"))
        (val_tokens if i % val_every == val_every - 1 else train_tokens).extend(tokens)
    counts = Counter(train_tokens)
    vocab = Vocabulary.build(counts, vocab_size)
    return Corpus(
        vocab=vocab,
        train_ids=vocab.encode(train_tokens),
        val_ids=vocab.encode(val_tokens),
        fingerprint=digest.hexdigest(),
        n_files=len(files),
        type_counts=torch.tensor(sorted(counts.values(), reverse=True), dtype=torch.int64),
    )


def default_cache_dir() -> Path:
    """Where the corpus is cached unless told: ``$XDG_CACHE_HOME/helpers/corpus``, by default
    ``~/.cache/helpers/corpus``. Outside any results folder, so that a run's outputs (what Kaggle
    saves, what the runner lists) hold results only, and every run on the machine shares it."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "helpers" / "corpus"


def summary_lines(summary: dict) -> list[str]:
    """``Corpus.describe()`` for a reader: counts with thousands separators, fractions in percent,
    and the fingerprint left out (it identifies the text for a machine: results.json keeps it)."""
    lines = []
    for key, value in summary.items():
        if key == "fingerprint":
            continue
        if isinstance(value, float):
            value = f"{value:.1%}"
        elif isinstance(value, int):
            value = f"{value:,}"
        lines.append(f"{key.replace('_', ' '):<28} {value}")
    return lines


def load_or_build_corpus(
    cache_dir: Path | str | None,
    vocab_size: int,
    *,
    max_files: int | None = None,
    val_every: int = 20,
) -> Corpus:
    """``build_corpus`` once, then read it back from ``cache_dir`` (None: ``default_cache_dir()``).

    The cache key covers everything that decides the ids: the Python version and stdlib path (the
    text), the tokenizer version, the vocabulary size, the file cap and the split.
    """
    settings = {
        "python": sys.version.split()[0],
        "stdlib": str(stdlib_root()),
        "tokenizer": TOKENIZER_VERSION,
        "vocab_size": vocab_size,
        "max_files": max_files,
        "val_every": val_every,
    }
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = Path(cache_dir if cache_dir is not None else default_cache_dir()) / f"corpus-{key}.pt"
    if path.exists():
        saved = torch.load(path, weights_only=True)
        return Corpus(
            vocab=Vocabulary(tuple(saved["types"])),
            train_ids=saved["train_ids"].long(),
            val_ids=saved["val_ids"].long(),
            fingerprint=saved["fingerprint"],
            n_files=saved["n_files"],
            type_counts=saved["type_counts"],
        )
    corpus = build_corpus(vocab_size, max_files=max_files, val_every=val_every)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written under a name of its own, then renamed: runs share the cache, and one that reads while
    # another writes must find the whole file or none.
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    torch.save(
        {
            "settings": settings,
            "types": list(corpus.vocab.types),
            # int32 halves the file; ids fit (vocabularies here are far below 2^31)
            "train_ids": corpus.train_ids.int(),
            "val_ids": corpus.val_ids.int(),
            "fingerprint": corpus.fingerprint,
            "n_files": corpus.n_files,
            "type_counts": corpus.type_counts,
        },
        partial,
    )
    os.replace(partial, path)
    return corpus


__all__ = [
    "UNK",
    "UNK_ID",
    "Corpus",
    "Vocabulary",
    "build_corpus",
    "corpus_files",
    "default_cache_dir",
    "load_or_build_corpus",
    "stdlib_root",
    "summary_lines",
    "tokenize",
]
