"""What the fast path's built steps read of the model, to notice the changes they would not see.

Captured CUDA graphs and the merged projections (:mod:`.merged_weights`) hold the addresses the weights had when
they were built. An edit in place (``load_state_dict``, ``param.mul_(...)``) writes to those addresses and is
seen. A new Parameter or buffer (``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(...)``),
new storage behind the same Parameter (``param.data = tensor``), a replaced submodule, or a forward hook or
forward method added to a module (which the fast path, running the layers itself, would skip), and a new value of
a number the steps read when they are built or captured (an attention's ``scaling``, a norm's ``variance_epsilon``;
:data:`STEP_SCALARS`) or a buffer folded into a table of the steps (the rotary ``inv_freq``, also edited in place;
:data:`FOLDED_BUFFERS`) are not: the engine
takes a snapshot when it builds a step and compares it at each call, before the prompt's prefill (0.1-0.6 ms for
a 30-layer model on a CPU of today, more with cold caches), dropping its steps and merged projections and checking
the model again when it differs. (Comparing after a captured prefill graph's replay was queued made calls slower on
an H100.) The snapshot refers to tensors and submodules weakly, but holds each module's dicts (parameters, buffers,
submodules, hooks, attributes): a module replaced by another keeps its weights in memory until the next call finds
the change.
"""

from __future__ import annotations

import weakref

import torch


#: Numbers (and the rotary embedding's ``rope_type`` name) of a module that the fast path's steps read when they are
#: built or captured (a CUDA graph holds them).
STEP_SCALARS = ("scaling", "variance_epsilon", "attention_scaling", "head_dim", "rope_type")
#: Buffers whose values the steps fold into tables of their own (the fused step's rotary cos/sin table is computed
#: once from the rotary embedding's ``inv_freq``): compared by value, so an edit in place is seen too.
FOLDED_BUFFERS = ("inv_freq",)
#: A peft tuner layer's adapter state (attributes of its own): which adapters are merged and active, and whether they
#: are disabled. The fused step runs a LoRA layer whose adapters are merged as its base ``nn.Linear``
#: (:func:`~hf_accel.engine.fused_support.plain_linear`), decided when the step is built; a layer's
#: ``enable_adapters(False)``, ``set_adapter`` or ``unmerge()`` changes only these. Lists are kept as copies.
ADAPTER_STATE = ("merged_adapters", "_active_adapter", "_disable_adapters")


class WeightSnapshot:
    """``tensors``: (dict, name, tensor, data_ptr) of every parameter and buffer (``dict`` its module's
    ``_parameters`` / ``_buffers``; tensor and data_ptr None for an entry that is None); ``children``: (dict, name,
    submodule, its class) of every submodule (``dict`` its parent's ``_modules``); ``hooks``: (forward hooks, their
    count, forward pre-hooks, their count, ``__dict__``, whether it holds a ``forward``, ``_parameters``,
    ``_buffers``, ``_modules``, their number of entries together) of every module; ``scalars``: (``__dict__``, name,
    value) of each module's :data:`STEP_SCALARS` and of a peft layer's :data:`ADAPTER_STATE` (lists copied);
    ``folded``: (``_buffers``, name, host copy) of each buffer of :data:`FOLDED_BUFFERS`. Tensors and submodules as weak
    references (the modules' dicts are held)."""

    __slots__ = ("tensors", "children", "hooks", "scalars", "folded")

    def __init__(self, tensors: tuple, children: tuple, hooks: tuple, scalars: tuple = (), folded: tuple = ()):
        self.tensors, self.children, self.hooks, self.scalars = tensors, children, hooks, scalars
        self.folded = folded


def weight_snapshot(model: torch.nn.Module) -> WeightSnapshot:
    """Every parameter, buffer and submodule of ``model``, the parameters' and buffers' storage addresses, and each
    module's forward hooks, whether its forward is replaced, the numbers of :data:`STEP_SCALARS` it holds, a peft
    layer's :data:`ADAPTER_STATE` and copies of its :data:`FOLDED_BUFFERS`."""
    tensors, children, hooks, scalars, folded = [], [], [], [], []
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            # an entry that is None (a Linear without bias) is kept as None: a tensor set there later is a change
            tensors.extend((store, name, None, None) if t is None else (store, name, weakref.ref(t), t.data_ptr())
                           for name, t in store.items())
        children.extend((module._modules, name, weakref.ref(c), type(c)) for name, c in module._modules.items()
                        if c is not None)
        hooks.append((module._forward_hooks, len(module._forward_hooks), module._forward_pre_hooks,
                      len(module._forward_pre_hooks), module.__dict__, "forward" in module.__dict__,
                      module._parameters, module._buffers, module._modules,
                      len(module._parameters) + len(module._buffers) + len(module._modules)))
        attrs = module.__dict__
        scalars.extend((attrs, name, attrs[name]) for name in STEP_SCALARS
                       if isinstance(attrs.get(name), (int, float, str)))
        if "merged_adapters" in attrs:
            scalars.extend((attrs, name, list(attrs[name]) if isinstance(attrs[name], list) else attrs[name])
                           for name in ADAPTER_STATE if name in attrs)
        # a host copy: each call compares it with one device-to-host copy (no comparison kernels to launch)
        folded.extend((module._buffers, name, module._buffers[name].detach().to("cpu", copy=True))
                      for name in FOLDED_BUFFERS if isinstance(module._buffers.get(name), torch.Tensor))
    return WeightSnapshot(tuple(tensors), tuple(children), tuple(hooks), tuple(scalars), tuple(folded))


def snapshot_intact(snapshot: WeightSnapshot) -> bool:
    """True while every parameter, buffer and submodule of the snapshot is still in place (the same object, for
    tensors at the same storage address, for submodules of the same class; an entry that was None still None), no
    module gained or lost a forward hook, a replaced forward, a parameter, buffer or submodule entry (a LoRA layer's
    new adapter), and the values of :data:`STEP_SCALARS`, the peft layers' :data:`ADAPTER_STATE` and
    :data:`FOLDED_BUFFERS` are unchanged. (Not noticed: a weight given other strides at the same address, such as
    an in-place ``t_()`` of a square matrix.)"""
    for attrs, name, value in snapshot.scalars:
        if attrs.get(name) != value:
            return False
    for store, name, copy in snapshot.folded:  # one small device-to-host read each
        t = store.get(name)
        if t is None or t.shape != copy.shape or t.dtype != copy.dtype or not torch.equal(t.detach().cpu(), copy):
            return False
    for store, name, ref, ptr in snapshot.tensors:
        t = store.get(name)
        if ref is None:
            if t is not None:
                return False
        elif t is None or t is not ref() or t.data_ptr() != ptr:
            return False
    for store, name, ref, cls in snapshot.children:
        child = store.get(name)
        if child is not ref() or type(child) is not cls:
            return False
    for fwd, n_fwd, pre, n_pre, attrs, replaced, params, buffers, modules, entries in snapshot.hooks:
        if (len(fwd) != n_fwd or len(pre) != n_pre or ("forward" in attrs) != replaced
                or len(params) + len(buffers) + len(modules) != entries):
            return False
    return True
