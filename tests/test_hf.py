"""Tests of helpers.hf: the patched forward gives the unpatched model's loss and gradients.

CPU only, tiny random models built offline (the kernels run under the Triton interpreter, which
``import helpers`` switches on where there is no CUDA). Each test compares one model instance
unpatched (transformers' own logits + ForCausalLMLoss) against the same instance patched.
"""

import copy
import os

import pytest
import torch

from helpers import hf

transformers = pytest.importorskip("transformers")

V, D, B, T = 160, 32, 2, 16
FAMILIES = ["qwen2", "qwen3", "llama", "mistral", "gemma2", "gemma3"]
SOFTCAP = 2.0  # small enough to bend the logits of the gemma models below (initializer_range 0.5)


def make_model(family, tied=True, dtype=torch.float32, seed=0, **overrides):
    common = dict(
        vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    T_ = transformers
    if family == "qwen2":
        cfg_cls, model_cls, extra = T_.Qwen2Config, T_.Qwen2ForCausalLM, {}
    elif family == "qwen3":
        cfg_cls, model_cls, extra = T_.Qwen3Config, T_.Qwen3ForCausalLM, dict(head_dim=8)
    elif family == "llama":
        cfg_cls, model_cls, extra = T_.LlamaConfig, T_.LlamaForCausalLM, dict(head_dim=8)
    elif family == "mistral":
        cfg_cls, model_cls, extra = T_.MistralConfig, T_.MistralForCausalLM, dict(head_dim=8)
    elif family == "gemma2":
        cfg_cls, model_cls = T_.Gemma2Config, T_.Gemma2ForCausalLM
        extra = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
                     final_logit_softcapping=SOFTCAP, initializer_range=0.5)
    elif family == "gemma3":
        cfg_cls, model_cls = T_.Gemma3TextConfig, T_.Gemma3ForCausalLM
        extra = dict(head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
                     final_logit_softcapping=SOFTCAP, initializer_range=0.5)
    elif family == "olmo2":  # not listed; its forward has the listed families' structure
        cfg_cls, model_cls, extra = T_.Olmo2Config, T_.Olmo2ForCausalLM, {}
    elif family == "gpt2":
        cfg = T_.GPT2Config(vocab_size=V, n_embd=D, n_layer=1, n_head=4, n_positions=64)
        torch.manual_seed(seed)
        return T_.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(family)
    cfg = cfg_cls(**{**common, **extra, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype)
    model.eval()  # no dropout; training-only paths are switched on where a test wants them
    return model


def make_batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a masked prompt
    labels[1, 9] = -100
    return ids, labels


def step(model, ids, labels, scale=None, **kwargs):
    """(output, {name: grad or None}) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, **kwargs)
    (out.loss if scale is None else out.loss * scale).backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()}
    return out, grads


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def assert_same(ref, got, grads_ref, grads_got, tol=1e-5, loss_tol=None):
    out_ref, out_got = ref, got
    assert torch.isfinite(out_got.loss)
    assert abs(out_got.loss.item() - out_ref.loss.item()) <= (loss_tol or tol) * abs(out_ref.loss.item())
    assert out_got.logits is None
    assert grads_ref.keys() == grads_got.keys()
    for name in grads_ref:
        if grads_ref[name] is None:
            assert grads_got[name] is None, name
            continue
        assert grads_got[name] is not None, name
        assert rel(grads_got[name], grads_ref[name]) <= tol, (name, rel(grads_got[name], grads_ref[name]))


def compare(model, ids, labels, tol=1e-5, loss_tol=None, **kwargs):
    ref, g_ref = step(model, ids, labels, **kwargs)
    hf.patch(model)
    try:
        got, g_got = step(model, ids, labels, **kwargs)
    finally:
        hf.unpatch(model)
    assert type(got) is type(ref)
    assert_same(ref, got, g_ref, g_got, tol, loss_tol)
    return ref, got, g_ref, g_got


# ------------------------------------------------------------------------------------------------
# Loss and gradients per family
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_fp32(family, tied):
    model = make_model(family, tied=tied)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    compare(model, *make_batch())


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_softcap_is_applied_and_bites(family):
    model = make_model(family)
    ids, labels = make_batch()
    _, got, _, _ = compare(model, ids, labels)
    model.config.final_logit_softcapping = None  # the cap must matter at these logits...
    uncapped, _ = step(model, ids, labels)
    assert abs(uncapped.loss.item() - got.loss.item()) > 1e-2
    hf.patch(model)  # ...and the patched model must read it from the config at call time
    capless, _ = step(model, ids, labels)
    hf.unpatch(model)
    assert capless.loss.item() == pytest.approx(uncapped.loss.item(), rel=1e-5)


@pytest.mark.parametrize("as_tensor", [False, True], ids=["int", "tensor"])
def test_num_items_in_batch(as_tensor):
    model = make_model("qwen3", tied=False)
    ids, labels = make_batch()
    n = 37  # e.g. the kept tokens of the whole accumulated batch, more than this micro-batch's
    ref, _, _, _ = compare(model, ids, labels, num_items_in_batch=torch.tensor(n) if as_tensor else n)
    kept = (labels[:, 1:] != -100).sum().item()
    mean, _ = step(model, ids, labels)
    assert ref.loss.item() == pytest.approx(mean.loss.item() * kept / n, rel=1e-5)


def test_shift_labels():
    model = make_model("llama")
    ids, labels = make_batch()
    shifted = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(5))
    shifted[:, -3:] = -100
    ref, _, _, _ = compare(model, ids, labels, shift_labels=shifted)
    plain, _ = step(model, ids, labels)  # shift_labels is really used, not the labels
    assert abs(plain.loss.item() - ref.loss.item()) > 1e-3


def test_ignore_index_keyword():
    model = make_model("qwen2")
    ids, labels = make_batch()
    labels = torch.where(labels == -100, -1, labels)
    compare(model, ids, labels, ignore_index=-1)


def test_every_target_ignored_gives_nan_and_zero_grads():
    model = make_model("qwen3", tied=False)
    ids, _ = make_batch()
    labels = torch.full_like(ids, -100)
    ref, _ = step(model, ids, labels)
    hf.patch(model)
    got, g_got = step(model, ids, labels)
    assert torch.isnan(ref.loss) and torch.isnan(got.loss)
    for name, g in g_got.items():
        assert g is not None and torch.count_nonzero(g) == 0, name


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_gradient_checkpointing(family):
    model = make_model(family)
    # newer 5.x (5.24 here) name it activation_checkpointing_enable; the old name warns there
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    model.train()  # checkpointing runs only in training mode; these configs have no dropout
    assert model.model.gradient_checkpointing
    compare(model, *make_batch())


def test_frozen_lm_head():
    model = make_model("mistral", tied=False)
    model.lm_head.weight.requires_grad_(False)
    *_, g_got = compare(model, *make_batch())
    assert g_got["lm_head.weight"] is None
    assert g_got["model.embed_tokens.weight"] is not None


def test_frozen_body():
    model = make_model("llama", tied=False)
    for name, p in model.named_parameters():
        p.requires_grad_(name == "lm_head.weight")
    *_, g_got = compare(model, *make_batch())
    assert [n for n, g in g_got.items() if g is not None] == ["lm_head.weight"]


# ------------------------------------------------------------------------------------------------
# Half precision
# ------------------------------------------------------------------------------------------------


def test_fp16_model():
    model = make_model("qwen3", dtype=torch.float16)
    *_, g_got = compare(model, *make_batch(), tol=1e-2, loss_tol=1e-4)  # measured: 1.4e-3, 1.7e-6
    assert g_got["model.embed_tokens.weight"].dtype == torch.float16  # tied: the head's weight


def test_fp16_autocast_with_grad_scaler():
    """fp32 master weights, fp16 autocast, GradScaler: scaled gradients, unscaled to the reference's."""
    model = make_model("qwen2", tied=False)
    ids, labels = make_batch()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)

    def scaled_step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(ids, labels=labels)
        scaler.scale(out.loss).backward()
        return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    def plain_step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(ids, labels=labels)
        out.loss.backward()
        return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    ref, g_ref = scaled_step()
    hf.patch(model)
    got, g_got = scaled_step()
    _, g_plain = plain_step()
    hf.unpatch(model)
    assert got.loss.dtype == torch.float32
    assert got.loss.item() == pytest.approx(ref.loss.item(), rel=2e-3)
    for name in g_ref:
        assert rel(g_got[name], g_ref[name]) < 2e-2, name
        # fp16 rounds the unscaled backward's small gradients more coarsely: hence not tighter
        assert rel(g_got[name] / scaler.get_scale(), g_plain[name]) < 1e-2, name


class Spy:
    """Stands in for linear_cross_entropy: records what the kernel would get, computes it in torch."""

    def __init__(self):
        self.calls = []

    def __call__(self, E, C, x, *, bias=None, ignore_index=-100, reduction="mean", softcap=None):
        self.calls.append(dict(E=E, C=C, x=x, autocast=torch.is_autocast_enabled("cpu")))
        z = (E.float() @ C.float().T)
        if bias is not None:
            z = z + bias.float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        return torch.nn.functional.cross_entropy(z, x, ignore_index=ignore_index, reduction=reduction)


def test_kernel_inputs_bf16_autocast(monkeypatch):
    """Under autocast both matrices reach the kernel in autocast's dtype (bf16 runs only on a GPU:
    the interpreter computes bf16 wrongly, so the kernel is stood in for here)."""
    spy = Spy()
    monkeypatch.setattr(hf, "linear_cross_entropy", spy)
    model = make_model("qwen3", tied=False)
    ids, labels = make_batch()
    hf.patch(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=labels)
    out.loss.backward()
    (call,) = spy.calls
    assert call["E"].dtype == call["C"].dtype == torch.bfloat16
    assert not call["autocast"]  # the kernel's own torch ops run outside autocast
    assert model.lm_head.weight.grad.dtype == torch.float32  # the fp32 master weight's gradient


def test_hidden_states_are_not_copied(monkeypatch):
    spy = Spy()
    monkeypatch.setattr(hf, "linear_cross_entropy", spy)
    model = make_model("llama", tied=False)
    ids, labels = make_batch()
    seen = []
    model.model.register_forward_hook(lambda mod, args, out: seen.append(out.last_hidden_state))
    hf.patch(model)
    model(ids, labels=labels)
    (call,) = spy.calls
    assert call["E"].shape == (B * T, D)
    assert call["E"].data_ptr() == seen[0].data_ptr() and call["E"]._base is seen[0]
    assert call["C"] is model.lm_head.weight
    assert torch.equal(call["x"], hf.shift_targets(labels).view(-1))


def test_weight_is_cast_to_hidden_dtype(monkeypatch):
    spy = Spy()
    monkeypatch.setattr(hf, "linear_cross_entropy", spy)
    hidden = torch.randn(B, T, D, dtype=torch.float16)
    weight = torch.randn(V, D, requires_grad=True)
    hf.causal_lm_loss(hidden, weight, make_batch()[1]).backward()
    assert spy.calls[0]["E"].dtype == spy.calls[0]["C"].dtype == torch.float16
    assert weight.grad.dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# Forward semantics
# ------------------------------------------------------------------------------------------------


def test_without_labels_is_the_original_forward():
    model = make_model("gemma2")
    ids, _ = make_batch()
    with torch.no_grad():
        full, last = model(ids), model(ids, logits_to_keep=1)
        hf.patch(model)
        p_full, p_last = model(ids), model(ids, logits_to_keep=1)
    assert torch.equal(full.logits, p_full.logits) and p_full.loss is None
    assert p_last.logits.shape == (B, 1, V) and torch.equal(last.logits, p_last.logits)
    with torch.no_grad():
        as_tuple = model(ids, return_dict=False)
        # transformers computes no loss from shift_labels alone; neither does the patch
        shifted_only = model(ids, shift_labels=hf.shift_targets(ids))
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], full.logits)
    assert shifted_only.loss is None and torch.equal(shifted_only.logits, full.logits)


def test_outputs_pass_through():
    model = make_model("qwen3")
    ids, labels = make_batch()
    kwargs = dict(output_hidden_states=True, use_cache=True)
    ref = model(ids, labels=labels, **kwargs)
    hf.patch(model)
    got = model(ids, labels=labels, **kwargs)
    assert got.logits is None
    assert len(got.hidden_states) == len(ref.hidden_states) == 3
    for a, b in zip(got.hidden_states, ref.hidden_states, strict=True):
        assert torch.equal(a, b)
    cache_field = [f for f in ("past_key_values", "cache") if f in got.keys()]  # by version; "in got" maps BC names
    assert len(cache_field) == 1 and got[cache_field[0]] is not None
    as_tuple = model(ids, labels=labels, return_dict=False)
    assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], got.loss)


def test_logits_to_keep_with_labels_is_refused():
    model = hf.patch(make_model("qwen3"))
    ids, labels = make_batch()
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, labels=labels, logits_to_keep=1)


def test_a_patched_model_compiles_with_fullgraph():
    """The patched forward traces whole: it bound the original forward (types.MethodType) and read the
    output's dataclass fields on every call, neither of which torch.compile can trace."""
    torch._dynamo.reset()  # a trace cached by an earlier compile would hide a break
    model = hf.patch(make_model("qwen3"))
    ids, labels = make_batch()
    want = model(ids, labels=labels).loss
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(ids, labels=labels).loss, want, rtol=1e-6, atol=1e-7)
    # Without labels (evaluation, generation): the original forward, traced whole too.
    torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-6, atol=1e-6)


def test_float_labels_are_refused_as_transformers_refuses_them():
    """The patch cast them with .long() (2.7 scored as class 2) where transformers' own loss raises."""
    model = hf.patch(make_model("qwen3"))
    ids, labels = make_batch()
    with pytest.raises(TypeError, match="labels must hold integer class indices, got torch.float32"):
        model(ids, labels=labels.float() + 0.7)


def test_labels_passed_positionally():
    model = make_model("mistral")
    ids, labels = make_batch()
    ref = model(ids, None, None, None, None, labels)
    hf.patch(model)
    got = model(ids, None, None, None, None, labels)
    assert got.logits is None and got.loss.item() == pytest.approx(ref.loss.item(), rel=1e-5)


# ------------------------------------------------------------------------------------------------
# patch / unpatch
# ------------------------------------------------------------------------------------------------


def test_unpatch_restores_bit_identical_behaviour():
    model = make_model("qwen3", tied=False)
    ids, labels = make_batch()
    before, g_before = step(model, ids, labels)
    hf.patch(model)
    assert hf.is_patched(model) and "forward" in model.__dict__
    step(model, ids, labels)
    assert hf.unpatch(model) is model
    assert not hf.is_patched(model) and "forward" not in model.__dict__
    assert model.forward.__func__ is type(model).forward
    after, g_after = step(model, ids, labels)
    assert torch.equal(before.loss, after.loss) and torch.equal(before.logits, after.logits)
    for name in g_before:
        assert torch.equal(g_before[name], g_after[name]), name


def test_patched_forward_keeps_the_signature():
    """Trainer reads inspect.signature(model.forward) to keep dataset columns and pass loss kwargs."""
    import inspect

    model = make_model("gemma3")
    before = inspect.signature(model.forward)
    hf.patch(model)
    assert inspect.signature(model.forward) == before
    assert "labels" in inspect.signature(model.forward).parameters


def test_unpatch_restores_an_instance_forward():
    """A forward already set on the instance (as accelerate's hooks do) comes back as it was."""
    model = make_model("llama")
    inner = model.forward
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    model.forward = wrapper
    hf.patch(model)
    model(make_batch()[0])  # no labels: the previous forward runs
    assert calls == [1]
    hf.unpatch(model)
    assert model.__dict__["forward"] is wrapper


def test_patching_twice_is_an_error():
    model = hf.patch(make_model("qwen2"))
    with pytest.raises(RuntimeError, match="already patched"):
        hf.patch(model)
    hf.unpatch(model)
    with pytest.raises(RuntimeError, match="not patched"):
        hf.unpatch(model)
    hf.patch(model)  # patchable again after unpatch
    assert hf.is_patched(model)


def test_patch_is_per_instance():
    a, b = make_model("qwen3"), make_model("qwen3")
    ids, labels = make_batch()
    hf.patch(a)
    assert "forward" not in type(a).__dict__ or type(a).forward is transformers.Qwen3ForCausalLM.forward
    assert a(ids, labels=labels).logits is None
    out_b = b(ids, labels=labels)
    assert out_b.logits is not None and out_b.logits.shape == (B, T, V)


def test_deepcopy_of_a_patched_model_is_patched_on_its_own():
    model = hf.patch(make_model("qwen3"))
    clone = copy.deepcopy(model)
    assert hf.is_patched(clone) and clone.forward.__self__ is clone
    hf.unpatch(clone)
    assert "forward" not in clone.__dict__ and hf.is_patched(model)


# ------------------------------------------------------------------------------------------------
# Refusals
# ------------------------------------------------------------------------------------------------


def test_gpt2_is_refused():
    with pytest.raises(hf.UnsupportedModelError, match="GPT2LMHeadModel") as err:
        hf.patch(make_model("gpt2"))
    for name in hf.SUPPORTED:
        assert name in str(err.value)


def test_heads_the_patch_cannot_read_are_refused():
    """A head whose weight is not the plain matrix the patched path reads: quantised, sharded, or
    with hooks that the patched path would skip."""
    model = make_model("qwen3")
    head = model.lm_head
    handle = head.register_forward_pre_hook(lambda module, args: None)
    with pytest.raises(hf.UnsupportedModelError, match="forward hooks"):
        hf.patch(model)
    handle.remove()
    model._hf_hook = object()  # accelerate's marker of a device-map or offload hook
    with pytest.raises(hf.UnsupportedModelError, match="accelerate's hooks"):
        hf.patch(model)
    del model._hf_hook
    head.weight.ds_id = 7  # what DeepSpeed ZeRO-3 sets on a partitioned parameter
    with pytest.raises(hf.UnsupportedModelError, match="sharded"):
        hf.patch(model)
    del head.weight.ds_id
    sharded = type("FSDPLinear", (torch.nn.Linear,), {})  # what fully_shard makes of the head's class
    head.__class__ = sharded
    with pytest.raises(hf.UnsupportedModelError, match="sharded"):
        hf.patch(model)
    head.__class__ = torch.nn.Linear
    weight = head.weight
    head.weight = torch.nn.Parameter(torch.zeros_like(weight, dtype=torch.int8), requires_grad=False)
    with pytest.raises(hf.UnsupportedModelError, match="quantised"):
        hf.patch(model)
    head.weight = weight
    hf.patch(model)  # all of it undone: the plain head patches
    hf.unpatch(model)


def test_fake_module_is_refused():
    class FakeLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Identity()
            self.lm_head = torch.nn.Linear(D, V, bias=False)

        def forward(self, input_ids, labels=None):
            return self.lm_head(self.model(input_ids))

    with pytest.raises(hf.UnsupportedModelError, match="FakeLM.*Qwen3ForCausalLM"):
        hf.patch(FakeLM())
    with pytest.raises(hf.UnsupportedModelError, match="FakeLM"):
        hf.patch(FakeLM(), allow_unlisted=True)  # its forward is not the causal-LM pattern
    with pytest.raises(hf.UnsupportedModelError, match="not a torch.nn.Module"):
        hf.patch(object())


def test_an_lm_head_with_a_bias_trains_the_bias_too():
    model = make_model("qwen3", tied=False)
    model.lm_head = torch.nn.Linear(D, V, bias=True)
    torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    _, _, g_ref, g_got = compare(model, *make_batch())
    assert g_ref["lm_head.bias"] is not None and g_got["lm_head.bias"] is not None


def test_subclasses():
    class Keeps(transformers.Qwen3ForCausalLM):
        pass

    class Overrides(transformers.Qwen3ForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            return out

    cfg = make_model("qwen3").config
    hf.unpatch(hf.patch(Keeps(cfg)))
    with pytest.raises(hf.UnsupportedModelError, match="Overrides"):
        hf.patch(Overrides(cfg))


def test_custom_loss_function_is_refused():
    model = make_model("qwen3")
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.sum()
    with pytest.raises(hf.UnsupportedModelError, match="ForCausalLMLoss"):
        hf.patch(model)


def test_forward_structure_of_the_supported_families():
    for family in FAMILIES:
        cls = type(make_model(family))
        structure = hf.forward_structure(cls)
        assert structure["softcap_attr"] == ("final_logit_softcapping" if "gemma" in family else None)


def test_unlisted_family_with_the_same_structure():
    model = make_model("olmo2")
    with pytest.raises(hf.UnsupportedModelError, match="Olmo2ForCausalLM"):
        hf.patch(model)
    ids, labels = make_batch()
    ref, g_ref = step(model, ids, labels)
    hf.patch(model, allow_unlisted=True)
    got, g_got = step(model, ids, labels)
    assert_same(ref, got, g_ref, g_got)


def test_unlisted_family_with_another_structure_is_refused():
    # Cohere multiplies its logits by logit_scale: not reproduced, so refused even when allowed.
    with pytest.raises(hf.UnsupportedModelError, match="logit_scale"):
        hf.forward_structure(transformers.CohereForCausalLM)


# ------------------------------------------------------------------------------------------------
# End to end: transformers' Trainer with gradient accumulation (it passes num_items_in_batch)
# ------------------------------------------------------------------------------------------------


def test_trainer_with_gradient_accumulation(tmp_path, monkeypatch):
    pytest.importorskip("accelerate")  # transformers' Trainer needs it
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(8):
        ids = torch.randint(0, V, (T,), generator=g)
        labels = ids.clone()
        labels[: 2 + i] = -100  # a different number of kept tokens per sample
        rows.append({"input_ids": ids, "labels": labels, "unused_column": torch.tensor(i)})

    seen, base_kwargs = [], []
    real_loss = hf.causal_lm_loss
    monkeypatch.setattr(hf, "causal_lm_loss", lambda *a, **k: seen.append(k) or real_loss(*a, **k))

    def train(patched):
        model = make_model("qwen3", tied=False)
        model.model.register_forward_pre_hook(lambda m, a, kw: base_kwargs.append(set(kw)), with_kwargs=True)
        if patched:
            hf.patch(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(patched)), per_device_train_batch_size=2,
            gradient_accumulation_steps=2, max_steps=2, learning_rate=0.5, optim="sgd",
            lr_scheduler_type="constant", max_grad_norm=0.0,  # no clipping: it would hide a scale error
            report_to=[], save_strategy="no", use_cpu=True,
            logging_strategy="no", dataloader_num_workers=0, seed=0, disable_tqdm=True,
        )
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=rows, data_collator=transformers.default_data_collator
        )
        result = trainer.train()
        return result.training_loss, {n: p.detach().clone() for n, p in model.named_parameters()}

    ref_loss, ref = train(False)
    got_loss, got = train(True)
    assert got_loss == pytest.approx(ref_loss, rel=1e-5)
    assert len(seen) == 4 and all(torch.is_tensor(k["num_items_in_batch"]) for k in seen)
    # Trainer kept input_ids and labels and dropped the column forward does not name: it read the
    # original signature through the patch
    assert len(base_kwargs) == 8 and all("input_ids" in k and "unused_column" not in k for k in base_kwargs)
    init = dict(make_model("qwen3", tied=False).named_parameters())
    for name in ref:  # the two SGD updates agree, not merely the weights
        update_ref, update_got = ref[name] - init[name], got[name] - init[name]
        assert update_ref.norm() > 0, name
        assert rel(update_got, update_ref) < 1e-4, (name, rel(update_got, update_ref))


def test_gpu_check_script_tiny(tmp_path):
    """scripts/gpu/hf_check.py --tiny: the GPU script's whole path on the CPU, so it does not rot."""
    import importlib.util
    import json

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "gpu", "hf_check.py")
    spec = importlib.util.spec_from_file_location("hf_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "tiny.jsonl"
    assert script.main(["--tiny", "--n", "24", "--warmup", "0", "--repeats", "1", "--output", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["env", "check", "step", "step"]
    assert rows[1]["ok"] and {r["method"] for r in rows[2:]} == {"hf", "cce"}
    assert rows[2]["loss_first"] == pytest.approx(rows[3]["loss_first"], rel=1e-5)


def test_without_source_a_listed_family_is_trusted_by_name(monkeypatch):
    def no_source(obj):
        raise OSError("could not get source code")

    model, olmo2 = make_model("gemma2", tied=False), make_model("olmo2")  # transformers reads sources too
    monkeypatch.setattr(hf.inspect, "getsource", no_source)
    hf.patch(model)
    assert not model.__dict__["_cce_patch"].structure_checked
    hf.unpatch(model)
    compare(model, *make_batch())  # the soft cap comes from the table, and still matches
    with pytest.raises(hf.UnsupportedModelError, match="source"):
        hf.patch(olmo2, allow_unlisted=True)


def test_patch_takes_a_memory_budget_and_names_a_bad_one():
    from helpers.hf import patch

    with pytest.raises(ValueError, match="memory_budget"):
        patch(object(), memory_budget="lots")


# ------------------------------------------------------------------------------------------------
# Options of the patch that transformers' loss does not have: class weights and a temperature
def weighted_reference(model, ids, labels, class_weight=None, temperature=1.0, num_items_in_batch=None):
    """(loss, grads) of the unpatched model's logits through F.cross_entropy(weight=), shifted as
    transformers shifts, divided by num_items_in_batch when given (``fixed_cross_entropy``'s formula)."""
    model.zero_grad(set_to_none=True)
    logits = model(ids).logits.float() / temperature
    targets = hf.shift_targets(labels).view(-1)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = torch.nn.functional.cross_entropy(logits.view(-1, V), targets, weight=class_weight, reduction=reduction)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("options", [
    dict(class_weight=True),
    dict(class_weight=True, num_items_in_batch=37),
    dict(temperature=0.7),
    dict(class_weight=True, temperature=1.3, num_items_in_batch=torch.tensor(41)),
], ids=["weight", "weight-num_items", "temperature", "all"])
def test_class_weight_and_temperature(options):
    model = make_model("qwen3", tied=False)
    ids, labels = make_batch()
    options = dict(options)
    if options.pop("class_weight", False):
        options["class_weight"] = torch.rand(V, generator=torch.Generator().manual_seed(3)) + 0.25
    num_items = options.pop("num_items_in_batch", None)
    want, grads_want = weighted_reference(model, ids, labels, num_items_in_batch=num_items, **options)
    hf.patch(model, **options)
    try:
        got, grads_got = step(model, ids, labels, num_items_in_batch=num_items)
    finally:
        hf.unpatch(model)
    assert got.loss.item() == pytest.approx(want.item(), rel=1e-5)
    for name, grad in grads_want.items():
        assert rel(grads_got[name], grad) <= 1e-5, name
    unweighted, _ = step(model, ids, labels, num_items_in_batch=num_items)  # the options bite
    assert abs(unweighted.loss.item() - want.item()) > 1e-3


def test_patch_names_what_it_does_not_support():
    model = make_model("qwen3")
    for options, word in ((dict(label_smoothing=0.1), "label_smoothing"), (dict(reduction="sum"), "reduction"),
                          (dict(weight=torch.ones(V)), "class_weight"), (dict(z_loss=1e-4), "z_loss")):
        with pytest.raises(TypeError, match=word):
            hf.patch(model, **options)
    with pytest.raises(ValueError, match="class_weight.*shape"):
        hf.patch(model, class_weight=torch.ones(V + 1))
    with pytest.raises(ValueError, match=r"class_weight.*finite weights \(no NaN or inf\)"):
        hf.patch(model, class_weight=torch.full((V,), float("nan")))
    with pytest.raises(ValueError, match="temperature"):
        hf.patch(model, temperature=0.0)

    def peer(E, C, x, *, bias=None, ignore_index=-100, reduction="mean", softcap=None):
        raise AssertionError("not called")

    with pytest.raises(ValueError, match="class_weight needs a loss that takes weight="):
        hf.patch(model, loss=peer, class_weight=torch.ones(V))
    assert not hf.is_patched(model)
