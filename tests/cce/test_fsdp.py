"""Our loss inside a model sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``), on the CPU.

Two gloo processes, each a data-parallel rank with its own batch, train a small model whose
parameters ``fully_shard`` splits across them (torch >= 2.6 runs FSDP2 on the CPU with gloo; this
torch does). The loss reads ``lm_head.weight`` in the root module's forward, where FSDP2 has
gathered the root group's parameters (the embedding, the final norm and the head: ``fully_shard`` on
the blocks, then on the root), so our loss sees the whole (V, D) weight as a plain tensor and its
gradient goes back through FSDP2's reduce-scatter. Each rank compares its loss, every parameter's
gradient (``full_tensor()``) and the parameters after two SGD steps with the same model unsharded in
one process, fed both batches (FSDP2 averages the ranks' gradients). No (tokens, V) tensor is made
by any torch op (a dispatch mode watches every op's outputs). The same with a tiny Qwen3 through
``helpers.hf.patch``, patched before ``fully_shard`` (afterwards its head is a DTensor, and ``patch``
refuses it), against the unpatched, unsharded model's transformers loss.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from helpers.cce import linear_cross_entropy
from tests.cce.test_parallel import spawn

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU processes under the Triton interpreter")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

V, D, B, T = 160, 32, 2, 24  # B * T * V = 7,680 logits > any parameter (V * D = 5,120)
TOL = 2e-5


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(D)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D))

    def forward(self, h):
        return h + self.mlp(self.norm(h))


class TinyLM(torch.nn.Module):
    """Embedding, two residual MLP blocks, a norm and a biased head; the loss is ours, from the head's weight."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, D)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.LayerNorm(D)
        self.lm_head = torch.nn.Linear(D, V)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return linear_cross_entropy(self.norm(h), self.lm_head.weight, ids, bias=self.lm_head.bias, shift=True)


class NoLogits(TorchDispatchMode):
    """Records any op output shaped like the logits: (..., V) with at least B * T rows."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == V and t.numel() >= B * T * V:
                self.seen.append(f"{func}: {tuple(t.shape)}")
        return out


def batch(rank, seed=0):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed + rank))


def train_and_compare(model, reference, step_loss, reference_loss, rank, world):
    """Two SGD steps of the sharded ``model`` on this rank's batch and of ``reference`` on every rank's;
    the losses, the gradients and the parameters compared after each step."""
    failures = []
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        watch = NoLogits()
        with watch:
            loss = step_loss(model, batch(rank, 10 * step))
            loss.backward()
        if watch.seen:
            failures.append(f"step {step}: logits made: {watch.seen[:3]}")
        ref_losses = [reference_loss(reference, batch(r, 10 * step)) for r in range(world)]
        (sum(ref_losses) / world).backward()
        if abs(loss.item() - ref_losses[rank].item()) > TOL * abs(ref_losses[rank].item()):
            failures.append(f"step {step}: loss {loss.item()} against {ref_losses[rank].item()} unsharded")
        for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
            grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            err = ((grad - ref_p.grad).norm() / ref_p.grad.norm().clamp(min=1e-30)).item()
            if err > TOL:
                failures.append(f"step {step}: {name}'s gradient: relative error {err:.2e}")
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        if not torch.allclose(value.detach(), ref_p.detach(), rtol=1e-5, atol=1e-6):
            failures.append(f"{name} after two steps differs from the unsharded run")
    assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def check_tiny_lm(rank, world):
    torch.manual_seed(0)
    reference = TinyLM()
    model = copy.deepcopy(reference)
    for block in model.blocks:
        fsdp.fully_shard(block)
    fsdp.fully_shard(model)  # the root group: embedding, final norm, head
    assert type(model.lm_head.weight).__name__ == "DTensor"  # sharded between steps

    def step_loss(m, ids):
        return m(ids)

    train_and_compare(model, reference, step_loss, step_loss, rank, world)


def test_fully_shard_tiny_lm():
    spawn(check_tiny_lm, 2)


def check_hf_patch(rank, world):
    from helpers import hf
    from tests.test_hf import make_model

    reference = make_model("qwen3", tied=False)
    model = hf.patch(copy.deepcopy(reference))
    for layer in model.model.layers:
        fsdp.fully_shard(layer)
    fsdp.fully_shard(model)

    def patched(m, ids):
        out = m(input_ids=ids, labels=ids)
        assert out.logits is None
        return out.loss

    def unpatched(m, ids):
        return m(input_ids=ids, labels=ids).loss

    train_and_compare(model, reference, patched, unpatched, rank, world)


def test_fully_shard_through_hf_patch():
    pytest.importorskip("transformers")
    spawn(check_hf_patch, 2)


def test_patch_after_fully_shard_is_refused():
    """The order matters: after ``fully_shard`` the head's weight is a DTensor shard outside the forward."""
    pytest.importorskip("transformers")
    spawn(check_patch_after_shard, 2)


def check_patch_after_shard(rank, world):
    from helpers import hf
    from tests.test_hf import make_model

    model = make_model("qwen3", tied=False)
    fsdp.fully_shard(model)
    with pytest.raises(hf.UnsupportedModelError, match="sharded"):
        hf.patch(model)
    dist.barrier()
