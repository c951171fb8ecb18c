"""Hugging Face integration: train a ``*ForCausalLM`` without materialising its logits.

    from helpers.hf import patch, unpatch
    patch(model)                          # this instance only; other instances are untouched
    out = model(input_ids, labels=labels) # out.loss as before, out.logits is None
    unpatch(model)                        # the original forward, exactly

``patch(model)`` replaces ``model.forward`` on the instance (an attribute in ``model.__dict__``
shadowing the class's method) by a forward that, *when labels are given*, runs the base model
(``model.model``) exactly as the original forward does and feeds its last hidden state and
``model.lm_head.weight`` to ``helpers.cce.linear_cross_entropy``: the (tokens x vocabulary)
logits are never formed, in the forward or the backward. When ``labels`` is None (inference,
``generate``) the original forward runs unchanged, logits and ``logits_to_keep`` included.

The loss is transformers' ``ForCausalLMLoss`` (``transformers/loss/loss_utils.py``), reproduced:

- labels are shifted inside: the target of position t is ``labels[..., t + 1]`` and the last
  position's target is ``ignore_index`` (transformers pads with ``ignore_index`` on the right and
  drops the first column); a ``shift_labels`` keyword (already shifted, same shape as labels) is
  used as is instead. As in transformers, ``shift_labels`` without ``labels`` computes no loss.
- ``ignore_index`` (default -100, a keyword the caller may pass, as transformers allows);
- without ``num_items_in_batch``: the mean over the targets that are not ``ignore_index``
  (NaN when there are none, with zero gradients, as ``F.cross_entropy`` gives);
  with it (the Trainer passes it under gradient accumulation): the sum over tokens divided by
  ``num_items_in_batch`` (an int or a tensor, moved to the loss's device, as transformers does);
- Gemma 2 / Gemma 3's ``config.final_logit_softcapping`` is applied as the kernel's ``softcap``
  (z = s * tanh(z / s)), exactly where the original forward caps its logits.

Two options transformers' loss does not have are options of ``patch``, fixed for every labelled call:
``class_weight`` (``F.cross_entropy``'s ``weight``) and ``temperature``; ``patch`` refuses any other
loss option by name (``_REFUSED``).

Dtypes: the kernel takes its two matrices in one dtype. Under ``torch.autocast`` both the hidden
states and the weight are given in the autocast dtype (what ``lm_head`` would have computed in);
otherwise in the hidden states' dtype, the weight cast to it if it differs. The loss is fp32.
The hidden states are flattened (B, T, D) -> (B*T, D) as a view (no copy unless autocast casts
them, as ``lm_head`` would), the shifted targets are a new (B*T,) integer tensor.

What the patched forward returns when labels are given: the model's usual output class
(``CausalLMOutputWithPast``) with ``loss`` set, ``logits=None``, and the base model's cache
(``past_key_values`` / ``cache``, whichever this transformers version names it), ``hidden_states``
and ``attentions`` passed through. With ``return_dict=False`` it is ``to_tuple()`` of that, which
skips None values: element 0 is the loss, but element 1 is *not* logits. Code that needs logits
together with labels (e.g. ``Trainer`` evaluation with ``compute_metrics``) must unpatch first.

Supported (checked on the instance by ``patch``): the classes in ``SUPPORTED`` (Qwen2, Qwen3,
Llama, Mistral, Gemma 2, Gemma 3 text), or a subclass that does not override ``forward``; the
instance must have ``model`` (the base model) and an ``nn.Linear`` ``lm_head`` (a bias is supported),
and use transformers' default ``ForCausalLMLoss``. Where the forward's source can be read, ``patch``
also parses it and refuses a forward that does anything it does not reproduce (see
``forward_structure``), so a transformers release that changes the pattern fails at ``patch``
rather than training on a different loss. ``patch(model, allow_unlisted=True)`` also accepts a class
outside the list whose forward passes that structural check.

Patching a patched model raises ``RuntimeError`` (call ``unpatch`` first); so does ``unpatch``
on a model that is not patched.

Refused with the reason (``head_the_patch_cannot_read``): a quantised head (bitsandbytes), a
LoRA-wrapped head (not an ``nn.Linear``), a sharded head (FSDP1/FSDP2 / ZeRO-3 gather
``lm_head.weight`` only inside ``lm_head``'s own forward, which the patched path does not call; with
FSDP2, ``patch`` before ``fully_shard`` with the head in the root's group works: the root's forward
gathers it, ``tests/cce/test_fsdp.py``),
forward hooks on ``lm_head`` or the model (accelerate's), and ``logits_to_keep`` together with
labels. Not handled either: multimodal models, and any other loss than ``ForCausalLMLoss``. LoRA on
the body (attention, MLP) with a plain ``lm_head`` is fine.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import textwrap
import types

import torch

from helpers.cce import linear_cross_entropy
from helpers.cce.class_weights import check_weight
from helpers.cce.options import check_temperature
from helpers.cce.shared import shift_targets as shared_shift
from helpers.cce.schedules import check_memory_budget

# Class name -> (the transformers module that defines it, the config attribute of its final logit
# soft cap or None). Checked by name and module, so neither importing this module nor patching one
# family imports the other families' modeling code. The soft cap is also found by parsing the
# forward (``forward_structure``); the column here is the fallback where there is no source.
SUPPORTED = {
    "Qwen2ForCausalLM": ("transformers.models.qwen2.modeling_qwen2", None),
    "Qwen3ForCausalLM": ("transformers.models.qwen3.modeling_qwen3", None),
    "LlamaForCausalLM": ("transformers.models.llama.modeling_llama", None),
    "MistralForCausalLM": ("transformers.models.mistral.modeling_mistral", None),
    "Gemma2ForCausalLM": ("transformers.models.gemma2.modeling_gemma2", "final_logit_softcapping"),
    "Gemma3ForCausalLM": ("transformers.models.gemma3.modeling_gemma3", "final_logit_softcapping"),
}

_STATE = "_cce_patch"  # the key in model.__dict__ holding the patch's state


class UnsupportedModelError(TypeError):
    """``patch`` cannot reproduce this model's loss without logits."""


@dataclasses.dataclass(frozen=True)
class _PatchState:
    family: str  # the class whose forward is replaced, e.g. "Qwen3ForCausalLM"
    signature: inspect.Signature  # of the original forward, without self
    varkw: str  # the name of its **kwargs
    softcap_attr: str | None  # the config attribute holding the final logit soft cap, if any
    loss: object  # the linear cross-entropy the patched forward calls (None: ours)
    output_class: type
    output_fields: tuple  # output_class's fields but the loss and the logits (read once: torch.compile cannot)
    instance_forward: object  # what model.__dict__["forward"] held before patching, or None
    structure_checked: bool  # whether the forward's source was read and checked (else: trusted by name)
    class_weight: torch.Tensor | None = None  # (V,) class weights of every labelled call (``patch``)
    temperature: float = 1.0  # the logits' divisor in every labelled call's loss (``patch``)


# ---------------------------------------------------------------------------------------------
# The loss
# ---------------------------------------------------------------------------------------------


def shift_targets(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """transformers' causal shift: ``pad(labels, (0, 1), value=ignore_index)[..., 1:]`` (the loss's own,
    ``helpers.cce.shared.shift_targets``)."""
    return shared_shift(labels, True, ignore_index)


def _kernel_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype both matrices go to the kernel in: autocast's if it is on, else the hidden's."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    shift_labels: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_items_in_batch: torch.Tensor | int | None = None,
    softcap: float | None = None,
    bias: torch.Tensor | None = None,
    loss=None,
    class_weight: torch.Tensor | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss(hidden_states @ weight.T + bias, labels, ...)``, without the logits.

    hidden_states (..., D) (typically (B, T, D)); weight (V, D), the head's weight; bias (V,) or
    None, the head's bias; ``loss``: the linear cross-entropy to call, with ``linear_cross_entropy``'s
    signature (None: ours; another kernel for a like-for-like comparison); labels with
    hidden_states' leading shape, shifted here, or ``shift_labels`` (already shifted) instead.
    Returns the fp32 scalar loss: the mean over kept targets, or their sum / num_items_in_batch.

    class_weight: (V,) or None, ``F.cross_entropy``'s ``weight`` (``linear_cross_entropy``'s), moved to
    the head's device: the mean becomes the weighted mean (divided by the kept targets' weights); with
    ``num_items_in_batch`` the weighted sum is divided by num_items_in_batch, the count of items
    (``fixed_cross_entropy``'s formula with ``weight`` given to its ``F.cross_entropy``).
    temperature: the logits are divided by it (softcap(z) / temperature) before the loss.
    Both are passed to ``loss`` only when set (a peer need not accept them).
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss needs labels or shift_labels")
        targets = shift_targets(labels.to(hidden_states.device), ignore_index)
    else:
        targets = shift_labels.to(hidden_states.device)
    D = hidden_states.shape[-1]
    if tuple(targets.shape) != tuple(hidden_states.shape[:-1]):
        raise ValueError(
            f"labels must have the hidden states' leading shape {tuple(hidden_states.shape[:-1])}, "
            f"got {tuple(targets.shape)}"
        )
    # A view when the hidden states are contiguous (they are, straight from the final norm).
    E = hidden_states.view(-1, D) if hidden_states.is_contiguous() else hidden_states.reshape(-1, D)
    x = targets.reshape(-1)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:  # transformers' own loss refuses them
        raise TypeError(f"labels must hold integer class indices, got {x.dtype}")
    if x.dtype not in (torch.int64, torch.int32):
        x = x.long()
    dtype = _kernel_dtype(E)
    C = weight
    if E.device != C.device:  # a model split over devices: the head's device, as lm_head would
        E, x = E.to(C.device), x.to(C.device)
    E, C = E.to(dtype), C.to(dtype)  # no-ops when the dtypes already agree
    b = bias.to(dtype) if bias is not None else None
    reduction = "mean" if num_items_in_batch is None else "sum"
    # The kernel's own torch ops (lse merge, reductions) must not be autocast: its inputs are set.
    options = {}
    if class_weight is not None:
        options["weight"] = class_weight.to(C.device)
    if temperature != 1.0:
        options["temperature"] = temperature
    with torch.autocast(device_type=E.device.type, enabled=False):
        value = (loss or linear_cross_entropy)(E, C, x, bias=b, ignore_index=ignore_index, reduction=reduction,
                                               softcap=softcap, **options)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(value.device)
        value = value / num_items_in_batch
    return value


# ---------------------------------------------------------------------------------------------
# What a forward does: the structural check
# ---------------------------------------------------------------------------------------------

_SELF_ATTRS = {"model", "lm_head", "loss_function", "config", "vocab_size"}
_CONFIG_ATTRS = {"vocab_size", "final_logit_softcapping"}
_FUNCTIONS = {"slice", "isinstance", "slice_logits_to_keep", "torch.tanh"}


def _unwrapped_forward(cls: type):
    return inspect.unwrap(cls.forward)


def _signature(fn) -> tuple[inspect.Signature, str]:
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[0].name != "self":
        raise UnsupportedModelError("its forward's first parameter is not self")
    params = params[1:]
    varkw = [p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
    names = {p.name for p in params}
    if not varkw or "labels" not in names or "logits_to_keep" not in names:
        raise UnsupportedModelError("its forward does not take labels, logits_to_keep and **kwargs")
    return sig.replace(parameters=params), varkw[0]


def forward_structure(cls: type) -> dict:
    """Parse ``cls.forward`` and check it is the causal-LM pattern the patch reproduces.

    The pattern (every supported family, transformers 5.x): one call ``self.model(p=p, ...,
    **kwargs)`` passing each named parameter but ``labels`` and ``logits_to_keep`` under its own
    name, one ``self.lm_head(...)``, one ``self.loss_function(...)``, optionally the soft cap
    read from ``self.config.final_logit_softcapping``, and nothing else touching ``self`` or
    calling anything but slicing helpers, ``torch.tanh`` and the output class. Raises
    ``UnsupportedModelError`` naming what differs; ``OSError``/``TypeError`` when there is no source.
    Returns {"softcap_attr": "final_logit_softcapping" or None, "output_class": name}.
    """
    fn = _unwrapped_forward(cls)
    sig, varkw = _signature(fn)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    fdef = tree.body[0]
    if not isinstance(fdef, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise UnsupportedModelError("its forward is not a plain function")
    body = ast.Module(body=fdef.body, type_ignores=[])  # without the decorators

    def is_self(node, attr=None):
        return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "self" and (attr is None or node.attr == attr))

    self_attrs, config_attrs, functions = set(), set(), set()
    calls = {"model": [], "lm_head": [], "loss_function": []}
    for node in ast.walk(body):
        if is_self(node):
            self_attrs.add(node.attr)
        if isinstance(node, ast.Attribute) and is_self(node.value, "config"):
            config_attrs.add(node.attr)
        if isinstance(node, ast.Call):
            f = node.func
            if is_self(f) and f.attr in calls:
                calls[f.attr].append(node)
            elif isinstance(f, ast.Name):
                functions.add(f.id)
            elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                functions.add(f"{f.value.id}.{f.attr}")
            else:
                functions.add(ast.unparse(f))
    output_class = sig.return_annotation
    output_name = output_class if isinstance(output_class, str) else getattr(output_class, "__name__", "")
    problems = []
    if self_attrs - _SELF_ATTRS:
        problems.append(f"it uses self.{', self.'.join(sorted(self_attrs - _SELF_ATTRS))}")
    if config_attrs - _CONFIG_ATTRS:
        problems.append(f"it reads config.{', config.'.join(sorted(config_attrs - _CONFIG_ATTRS))}")
    unknown = functions - _FUNCTIONS - {output_name}
    if unknown:
        problems.append(f"it calls {', '.join(sorted(unknown))}")
    for name, node_list in calls.items():
        if len(node_list) != 1:
            problems.append(f"it calls self.{name} {len(node_list)} times, not once")
    if len(calls["model"]) == 1:
        call = calls["model"][0]
        expected = {p for p in sig.parameters if p not in ("labels", "logits_to_keep", varkw)}
        passed, ok = set(), not call.args
        for kw in call.keywords:
            if kw.arg is None:
                ok &= isinstance(kw.value, ast.Name) and kw.value.id == varkw
            else:
                ok &= isinstance(kw.value, ast.Name) and kw.value.id == kw.arg
                passed.add(kw.arg)
        if not ok or passed != expected or not any(kw.arg is None for kw in call.keywords):
            problems.append(
                "its self.model(...) call is not 'each parameter but labels and logits_to_keep by "
                f"name, plus **{varkw}' (passes {sorted(passed)})"
            )
    if problems:
        raise UnsupportedModelError("; ".join(problems))
    softcap = "final_logit_softcapping" if "final_logit_softcapping" in config_attrs else None
    return {"softcap_attr": softcap, "output_class": output_name}


# ---------------------------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------------------------


def _forward_owner(model) -> type:
    for cls in type(model).__mro__:
        if "forward" in cls.__dict__:
            return cls
    raise UnsupportedModelError(f"{type(model).__name__} has no forward")


def _output_class(fn) -> type:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    annotation = inspect.signature(fn).return_annotation
    if isinstance(annotation, str):
        annotation = fn.__globals__.get(annotation, annotation)
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return annotation
    return CausalLMOutputWithPast


def _supported_list() -> str:
    return ", ".join(SUPPORTED)


def head_the_patch_cannot_read(model, lm_head) -> str | None:
    """Why the patched forward could not compute from ``lm_head.weight`` as ``lm_head`` would, or
    None. The patched path reads the weight directly, outside ``lm_head``'s forward, so anything
    that changes the weight only inside that forward, or stores it in another form, is refused:

    - a quantised head (bitsandbytes' 8-bit and 4-bit layers are ``nn.Linear`` subclasses whose
      weight is not a floating-point matrix of the head's shape);
    - a sharded head: FSDP2's ``fully_shard`` (the weight is a DTensor shard, gathered only in the
      forward's hooks), FSDP1 (a flat parameter), DeepSpeed ZeRO-3 (a placeholder outside its hooks);
    - forward hooks on the head or the model (accelerate's device-map and offload hooks, for one),
      which the patched path would skip.
    A LoRA-wrapped head is not an ``nn.Linear`` and is refused before this."""
    weight = lm_head.weight
    kind = type(weight).__name__
    if not weight.is_floating_point() or kind in ("Int8Params", "Params4bit") or \
            type(lm_head).__module__.startswith("bitsandbytes"):
        return (f"its lm_head is quantised ({type(lm_head).__name__}, weight {kind} of dtype {weight.dtype}); "
                "the fused loss needs the head's floating-point weight")
    if kind == "DTensor" or type(lm_head).__name__.startswith("FSDP") or hasattr(weight, "ds_id") \
            or "FlatParameter" in kind or hasattr(lm_head, "_fsdp_wrapped_module"):
        return ("its lm_head is sharded (FSDP, DeepSpeed ZeRO-3 or a DTensor): its weight is whole only inside "
                "lm_head's own forward, which the patched path does not call; with FSDP2, patch before fully_shard "
                "and leave lm_head in the root's group (fully_shard the layers, then the model)")
    if tuple(weight.shape) != (lm_head.out_features, lm_head.in_features):
        return (f"its lm_head's weight has shape {tuple(weight.shape)}, not (out_features, in_features) = "
                f"{(lm_head.out_features, lm_head.in_features)}: it is stored in another form")
    if lm_head._forward_hooks or lm_head._forward_pre_hooks or getattr(lm_head, "_hf_hook", None) is not None:
        return "its lm_head has forward hooks (accelerate's device map or offload, say), which the patched path skips"
    if getattr(model, "_hf_hook", None) is not None:
        return "the model has accelerate's hooks on its forward (a device map or offload), which the patch replaces"
    return None


def check_supported(model, *, allow_unlisted: bool = False) -> _PatchState:
    """The patch's state for ``model``, or ``UnsupportedModelError`` saying why it cannot be patched."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    name = type(model).__name__
    refuse = f"helpers.hf.patch cannot patch {name}"
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModelError(f"{refuse}: not a torch.nn.Module; supported: {_supported_list()}")
    owner = _forward_owner(model)
    listed = SUPPORTED.get(owner.__name__, (None,))[0] == owner.__module__
    if not listed and not allow_unlisted:
        why = (f"its forward is {owner.__module__}.{owner.__name__}.forward" if owner is not type(model)
               else "its class is not a supported causal LM")
        raise UnsupportedModelError(
            f"{refuse}: {why}; supported: {_supported_list()} (or a subclass that keeps their "
            "forward; patch(model, allow_unlisted=True) accepts another class whose forward has "
            "the same structure)"
        )
    lm_head = getattr(model, "lm_head", None)
    if not isinstance(lm_head, torch.nn.Linear):
        raise UnsupportedModelError(
            f"{refuse}: it needs an nn.Linear lm_head, found {type(lm_head).__name__}; "
            f"supported: {_supported_list()}"
        )
    if not isinstance(getattr(model, "model", None), torch.nn.Module):
        raise UnsupportedModelError(f"{refuse}: it has no base model at .model; supported: {_supported_list()}")
    if why := head_the_patch_cannot_read(model, lm_head):
        raise UnsupportedModelError(f"{refuse}: {why}")
    fn = _unwrapped_forward(owner)
    try:
        signature, varkw = _signature(fn)
        structure = forward_structure(owner)
        checked = True
    except UnsupportedModelError as err:
        raise UnsupportedModelError(
            f"{refuse}: {owner.__name__}.forward is not the causal-LM pattern the patch reproduces: {err}"
        ) from None
    except (OSError, TypeError) as err:  # no source to read (a .pyc-only install)
        if not listed:
            raise UnsupportedModelError(f"{refuse}: cannot read its forward's source to check it") from err
        signature, varkw = _signature(fn)
        structure = {"softcap_attr": SUPPORTED[owner.__name__][1]}
        checked = False
    loss_function = getattr(model, "loss_function", None)
    if loss_function is not ForCausalLMLoss:
        raise UnsupportedModelError(
            f"{refuse}: its loss_function is {getattr(loss_function, '__name__', loss_function)!r}, "
            "not transformers' ForCausalLMLoss, which is the loss the patch reproduces"
        )
    output_class = _output_class(fn)
    return _PatchState(
        family=owner.__name__,
        signature=signature,
        varkw=varkw,
        softcap_attr=structure["softcap_attr"],
        loss=None,
        output_class=output_class,
        output_fields=tuple(f.name for f in dataclasses.fields(output_class) if f.name not in ("loss", "logits")),
        instance_forward=model.__dict__.get("forward"),
        structure_checked=checked,
    )


def is_patched(model) -> bool:
    return _STATE in getattr(model, "__dict__", {})


# What ``patch`` is asked for that transformers' loss does not have, and why it is refused.
_REFUSED = {
    "reduction": "transformers' loss is the mean over kept targets, or their sum / num_items_in_batch",
    "label_smoothing": "transformers' ForCausalLMLoss has none; call helpers.cce.linear_cross_entropy directly",
    "z_loss": "transformers' ForCausalLMLoss has none; call helpers.cce.linear_cross_entropy directly",
    "softcap": "the soft cap is the config's final_logit_softcapping, read at every call",
    "ignore_index": "pass ignore_index= to the forward, per call, as transformers takes it",
    "weight": "the class weights are class_weight= (weight is the head's matrix in causal_lm_loss)",
}


def patch(model, *, allow_unlisted: bool = False, loss=None, memory_budget="default", class_weight=None,
          temperature: float = 1.0, **refused):
    """Make ``model`` (this instance only) compute its training loss without logits; returns it.

    ``loss``: the linear cross-entropy the patched forward calls, with ``linear_cross_entropy``'s
    signature (E, C, x, *, bias, ignore_index, reduction, softcap); None: ours.
    ``memory_budget``: ``linear_cross_entropy``'s ("default", "min", a number of bytes beyond the inputs,
    dE and dC, or "auto"), passed to every call (to ``loss`` too, when it is neither "default" nor "min").
    ``class_weight``: (V,) class weights for every labelled call, ``F.cross_entropy``'s ``weight``.
    transformers' loss takes none (its ``fixed_cross_entropy`` drops extra keywords), so this is an
    option of the patch, not of the call: a weighted mean over the kept targets, or with the Trainer's
    ``num_items_in_batch`` the weighted sum divided by it (``causal_lm_loss``). Floating point, finite,
    >= 0, of shape (lm_head.out_features,); moved to the head's device at each call.
    ``temperature``: every labelled call's loss is that of softcap(logits) / temperature (> 0); the
    logits of a call without labels (inference, ``generate``) are the model's own, untouched.
    With ``loss`` given, class_weight and temperature need a ``loss`` that takes ``weight=`` and
    ``temperature=``. Anything else (reduction, label_smoothing, z_loss, ...) raises a ``TypeError``
    naming it: transformers' loss has no such option (``_REFUSED`` says why for each).

    After patching, ``model(..., labels=labels)`` returns the usual output with ``loss`` from
    ``helpers.cce.linear_cross_entropy`` and ``logits=None`` (no logits are computed when labels
    are given); without labels the original forward runs. Raises ``UnsupportedModelError`` for a
    model it cannot reproduce (the message names the class and the supported ones) and
    ``RuntimeError`` if ``model`` is already patched.
    """
    if is_patched(model):
        raise RuntimeError(
            f"{type(model).__name__} is already patched by helpers.hf.patch; call unpatch(model) first"
        )
    if refused:
        raise TypeError("helpers.hf.patch does not take " + "; ".join(
            f"{name}= ({_REFUSED.get(name, 'not an option of transformers ForCausalLMLoss')})" for name in refused))
    memory_budget = check_memory_budget(memory_budget)
    temperature = check_temperature(temperature)
    for name, used, keyword in (("class_weight", class_weight is not None, "weight"),
                                ("temperature", temperature != 1.0, "temperature")):
        if loss is not None and used and not _takes(loss, keyword):
            raise ValueError(f"{name} needs a loss that takes {keyword}=; {getattr(loss, '__name__', loss)!r} does not")
    if memory_budget not in ("default", "min"):
        loss = functools.partial(loss or linear_cross_entropy, memory_budget=memory_budget)
    elif memory_budget == "min" and loss is None:
        loss = functools.partial(linear_cross_entropy, memory_budget="min")
    state = check_supported(model, allow_unlisted=allow_unlisted)
    if class_weight is not None:  # on any device (moved at each call): checked against the head's size only
        device = class_weight.device if isinstance(class_weight, torch.Tensor) else None
        try:
            check_weight(class_weight, torch.empty(model.lm_head.out_features, 0, device=device))
        except (TypeError, ValueError) as error:
            raise type(error)(f"class_weight: {error}") from None
    state = dataclasses.replace(state, loss=loss, class_weight=class_weight, temperature=temperature)

    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    # inspect.signature(model.forward) must stay the original's: Trainer keeps only the dataset
    # columns it names (remove_unused_columns) and looks for **kwargs to pass num_items_in_batch.
    shown = inspect.signature(_original_forward(model, state))  # as bound: without self
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    forward.__signature__ = shown.replace(parameters=[self_param, *shown.parameters.values()])
    forward.__doc__ = f"{state.family}.forward, patched by helpers.hf: with labels, logits=None.\n\n" + (
        _unwrapped_forward(type(model)).__doc__ or ""
    )
    model.__dict__[_STATE] = state
    model.__dict__["forward"] = types.MethodType(forward, model)
    return model


def _takes(fn, keyword: str) -> bool:
    """Whether ``fn`` accepts ``keyword`` (by name, or through **kwargs); True when it cannot be inspected."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.name == keyword or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def unpatch(model):
    """Restore the forward ``model`` had before ``patch`` (the class's, or its own attribute); returns it."""
    state = model.__dict__.pop(_STATE, None) if hasattr(model, "__dict__") else None
    if state is None:
        raise RuntimeError(f"{type(model).__name__} is not patched by helpers.hf.patch")
    if state.instance_forward is None:
        del model.__dict__["forward"]
    else:
        model.__dict__["forward"] = state.instance_forward
    return model


def _original_forward(model, state: _PatchState):
    """The forward ``model`` had before ``patch``, bound (for its signature, read at patch time)."""
    if state.instance_forward is None:
        return types.MethodType(type(model).forward, model)
    return state.instance_forward


def _call_original(model, state: _PatchState, *args, **kwargs):
    """The forward ``model`` had before ``patch``: its class's, called unbound (torch.compile traces it
    whole; a bound copy made each call it could not), or its own attribute."""
    if state.instance_forward is None:
        return type(model).forward(model, *args, **kwargs)
    return state.instance_forward(*args, **kwargs)


def _patched_forward(self, *args, **kwargs):
    state: _PatchState = self.__dict__[_STATE]
    # return_dict is consumed by transformers' @can_return_tuple before the forward's body.
    return_dict = kwargs.pop("return_dict", None)
    try:
        bound = state.signature.bind(*args, **kwargs)
    except TypeError:
        bound = None
    if bound is None or bound.arguments.get("labels") is None:
        if return_dict is not None:
            kwargs["return_dict"] = return_dict
        return _call_original(self, state, *args, **kwargs)  # inference: exactly the original (or its own error)

    bound.apply_defaults()
    arguments = dict(bound.arguments)
    extra = dict(arguments.pop(state.varkw, {}))
    labels = arguments.pop("labels")
    logits_to_keep = arguments.pop("logits_to_keep")
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        raise ValueError(
            "helpers.hf: the patched forward computes the loss over every position; "
            f"logits_to_keep={logits_to_keep!r} with labels is not supported (unpatch the model)"
        )
    # Exactly the original's call: every named parameter by name, plus all the extra keywords
    # (the original passes the loss keywords num_items_in_batch / shift_labels down too).
    outputs = self.model(**arguments, **extra)
    hidden = outputs.last_hidden_state if hasattr(outputs, "last_hidden_state") else outputs[0]
    softcap = getattr(self.config, state.softcap_attr, None) if state.softcap_attr else None
    loss = causal_lm_loss(
        hidden,
        self.lm_head.weight,
        labels,
        bias=self.lm_head.bias,
        shift_labels=extra.get("shift_labels"),
        ignore_index=extra.get("ignore_index", -100),
        num_items_in_batch=extra.get("num_items_in_batch"),
        softcap=softcap,
        loss=state.loss,
        class_weight=state.class_weight,
        temperature=state.temperature,
    )
    result = state.output_class(loss=loss, logits=None, **{f: getattr(outputs, f, None) for f in state.output_fields})
    # As @can_return_tuple: return_dict from the call, else the config's.
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return result if return_dict else result.to_tuple()
