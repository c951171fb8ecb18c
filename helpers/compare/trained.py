"""The "trained" regime: the softmax of a language model trained on real text, at any (V, D).

The generated regimes (``helpers.compare.inputs``) are shaped by hand, and a gradient filter tuned
on one of them may find nothing to skip in a model gradient descent made. This regime is such a
model: notebook 03's context-MLP language model (``ContextMLPLM``), trained from scratch on the
Python standard library's source (``helpers.compare.corpus``) at the V and D asked for, then read
at N consecutive positions.

``RECIPES`` holds the training, one per device kind. On a GPU: 8 tokens of context, 64-wide
embeddings, a 1,024-wide hidden layer, 600 Adam steps of 4,096 tokens (about one epoch of the 2.4 M
training tokens), the loss ours in bf16 (fp16 where bf16 has no matrix units) with no filter, fp32
weights. On a CPU a small recipe with the float32 logits loss, because the Triton interpreter is far
too slow to train with; it makes the same kind of softmax at test sizes.

The vocabulary is the corpus's ``V - 1`` most frequent word types and ``<unk>``. The corpus has
about 51,000 types: a larger V leaves the rest of the vocabulary unseen in training (their logits
are only ever pushed down), as a tokenizer built for other text would; a smaller V folds the rare
types into ``<unk>``. Token ids are then shuffled by a fixed permutation of range(V): a tokenizer's
ids do not follow this corpus's frequencies, so any block a filter skips comes from sorting the
vocabulary (``sort_vocab``), not from the id order.

``trained_inputs`` returns E (the model's hidden states, LayerNorm'd, width D), C (its classifier)
and x (the tokens that follow), in the dtype asked for: positions of the validation split first,
then the training split, starting at an offset the seed picks. A model is trained once per (V, D,
device kind) in a process and kept on the CPU (``describe`` gives its facts: steps, losses,
seconds); each call moves the small body to the device to compute E.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from helpers.compare.corpus import build_corpus


class ContextMLPLM(nn.Module):
    """Bengio-style language model: token t from the ``context`` tokens before it.

    E = LayerNorm(W_out gelu(W_mix [emb(x_{t-k}); ...; emb(x_{t-1})])),  (N, D)
    logits = E C^T,  (N, V).  The classifier C is not tied to the input embeddings, so how far a
    row of C moves is the loss's doing alone.
    """

    def __init__(self, V: int, D: int, context: int, d_embed: int, d_hidden: int):
        super().__init__()
        self.embed = nn.Embedding(V, d_embed)
        self.mix = nn.Linear(context * d_embed, d_hidden)
        self.out = nn.Linear(d_hidden, D)
        self.norm = nn.LayerNorm(D)
        # std 1/sqrt(D) on unit-variance E: initial logits ~N(0, 1), loss starts near log V
        self.C = nn.Parameter(torch.randn(V, D) / math.sqrt(D))

    def hidden(self, contexts: torch.Tensor) -> torch.Tensor:  # (N, k) token ids -> (N, D)
        h = self.embed(contexts).flatten(1)
        return self.norm(self.out(F.gelu(self.mix(h))))


def context_windows(ids: torch.Tensor, positions: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """contexts (N, k) = ids[p-k .. p-1] and targets (N,) = ids[p] for each position p >= k."""
    offsets = torch.arange(-k, 0)
    return ids[positions[:, None] + offsets], ids[positions]


@dataclass(frozen=True)
class Recipe:
    steps: int
    batch: int
    context: int = 8
    d_embed: int = 64
    d_hidden: int = 1024
    lr: float = 2e-3
    max_files: int | None = None  # None: the whole standard library
    seed: int = 0


RECIPES = {
    "cuda": Recipe(steps=600, batch=4096),
    "cpu": Recipe(steps=60, batch=256, d_embed=16, d_hidden=64, max_files=60),
}

_MODELS: dict[tuple, dict] = {}  # (V, D, device kind, recipe) -> body, C, ids, facts


def training_dtype(device: torch.device) -> torch.dtype:
    """The dtype the loss trains in: fp32 on a CPU, bf16 on a GPU with bf16 matrix units, else fp16."""
    if device.type != "cuda":
        return torch.float32
    return torch.bfloat16 if torch.cuda.get_device_capability(device) >= (8, 0) else torch.float16


def _train(V: int, D: int, device: torch.device, recipe: Recipe) -> dict:
    from tqdm.auto import tqdm

    from helpers.cce import linear_cross_entropy

    start = time.time()
    corpus = build_corpus(V, max_files=recipe.max_files)
    # The corpus's ids run by frequency; a fixed permutation spreads them over range(V).
    g = torch.Generator().manual_seed(recipe.seed)
    shuffle = torch.randperm(V, generator=g)
    train_ids, val_ids = shuffle[corpus.train_ids], shuffle[corpus.val_ids]
    torch.manual_seed(recipe.seed)
    model = ContextMLPLM(V, D, recipe.context, recipe.d_embed, recipe.d_hidden).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=recipe.lr)
    dtype = training_dtype(device)
    losses = []
    for _ in tqdm(range(recipe.steps), desc=f"training the trained regime's model (V={V:,}, D={D:,})",
                  leave=False, mininterval=2.0):
        positions = torch.randint(recipe.context, train_ids.numel(), (recipe.batch,), generator=g)
        contexts, y = context_windows(train_ids, positions, recipe.context)
        E = model.hidden(contexts.to(device))
        y = y.to(device)
        if dtype == torch.float32:
            loss = F.cross_entropy(E @ model.C.T, y)
        else:
            loss = linear_cross_entropy(E.to(dtype), model.C.to(dtype), y, filter_eps=None)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    model = model.cpu()
    C = model.C.detach()
    model.C = None  # the body alone moves to the device per call; C is cast there
    tail = torch.stack(losses[-max(1, recipe.steps // 20):]).float().mean()
    facts = dict(V=V, D=D, device=device.type, training_dtype=str(dtype).removeprefix("torch."),
                 corpus_types=len(corpus.vocab), train_tokens=int(train_ids.numel()),
                 val_tokens=int(val_ids.numel()), first_loss=round(float(losses[0]), 3),
                 final_train_loss=round(float(tail), 3), log_V=round(math.log(V), 3),
                 seconds=round(time.time() - start, 1), recipe=asdict(recipe))
    return dict(body=model.eval(), C=C, ids=torch.cat([val_ids, train_ids]), facts=facts)


def trained_model(V: int, D: int, device: torch.device | str = "cpu", recipe: Recipe | None = None) -> dict:
    """The regime's model for (V, D) on this kind of device, trained on first use (see the module doc)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    recipe = recipe or RECIPES["cuda" if device.type == "cuda" else "cpu"]
    for name, value in (("V", V), ("D", D)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise ValueError(f"{name} must be an integer of at least 2 for the trained regime, got {value!r}")
    key = (V, D, device.type, recipe)
    if key not in _MODELS:
        _MODELS[key] = _train(V, D, device, recipe)
    return _MODELS[key]


def describe(V: int, D: int, device: torch.device | str = "cpu", recipe: Recipe | None = None) -> dict:
    """The facts of the regime's model for (V, D) (trained on first use): the corpus, the recipe,
    the first and final training loss (mean of the last 5% of steps) and the seconds it took."""
    return dict(trained_model(V, D, device, recipe)["facts"])


def trained_inputs(
    N: int,
    V: int,
    D: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    recipe: Recipe | None = None,
    rows: int = 16_384,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """E (N, D), C (V, D) in ``dtype`` and targets x (N,) int64 on ``device``: the trained model at N
    consecutive positions (validation split first), starting ``seed`` * 9,973 tokens in (modulo the
    room there is). E is computed ``rows`` positions at a time."""
    device = torch.device(device)
    model = trained_model(V, D, device, recipe)
    ids, k = model["ids"], model["body"].mix.in_features // model["body"].embed.embedding_dim
    room = ids.numel() - k
    if not isinstance(N, int) or isinstance(N, bool) or not 1 <= N <= room:
        raise ValueError(f"N must be an integer from 1 to {room:,} for the trained regime (the corpus's "
                         f"positions), got {N!r}")
    first = k + (seed * 9_973) % (room - N + 1)
    contexts, x = context_windows(ids, torch.arange(first, first + N), k)
    body = model["body"].to(device)
    E = torch.empty(N, D, dtype=dtype, device=device)
    with torch.no_grad():
        for start in range(0, N, rows):
            E[start : start + rows] = body.hidden(contexts[start : start + rows].to(device)).to(dtype)
    model["body"] = body.cpu()
    return E, model["C"].to(device=device, dtype=dtype), x.to(device)
