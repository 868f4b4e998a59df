"""What the fast path's built steps read of the model, to notice the changes they would not see.

Captured CUDA graphs and the merged projections (:mod:`.merged_weights`) hold the addresses the weights had when
they were built. An edit in place (``load_state_dict``, ``param.mul_(...)``) writes to those addresses and is
seen. A new Parameter or buffer (``load_state_dict(..., assign=True)``, ``module.weight = nn.Parameter(...)``),
new storage behind the same Parameter (``param.data = tensor``) or a replaced submodule is not: the engine takes
a snapshot when it builds a step and compares it at each call, dropping its steps and merged projections when it
differs. The snapshot holds weak references only: replaced weights are freed as they would be without it.

Each check reads every parameter's and buffer's storage address (~25 us for a 30-layer model on a CPU of today).
Whether anything was registered anywhere (a Parameter, buffer or submodule assigned to any module) is known from
PyTorch's global registration hooks, which bump a counter; only then is the module tree compared too (~90 us).
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.nn.modules import module as _module

_registrations = itertools.count(1)
_version = 0
_hooks_installed = False


def _bump(*_args) -> None:
    global _version
    _version = next(_registrations)


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        _module.register_module_parameter_registration_hook(_bump)
        _module.register_module_buffer_registration_hook(_bump)
        _module.register_module_module_registration_hook(_bump)
        _hooks_installed = True


class WeightSnapshot:
    """``entries``: (module, kind, name, object, data_ptr) for every parameter and buffer (kind ``"_parameters"``
    / ``"_buffers"``) and submodule (``"_modules"``, data_ptr None) of a model, module and object as weak
    references; ``tensors`` / ``ptrs``: the parameters and buffers (weak references) and their addresses;
    ``version``: the registration counter when the module tree was last found unchanged."""

    __slots__ = ("entries", "tensors", "ptrs", "version")

    def __init__(self, entries: tuple, version: int):
        self.entries = entries
        self.tensors = tuple(ref for _, kind, _, ref, _ in entries if kind != "_modules")
        self.ptrs = tuple(ptr for _, kind, _, _, ptr in entries if kind != "_modules")
        self.version = version


def weight_snapshot(model: torch.nn.Module) -> WeightSnapshot:
    """Every parameter, buffer and submodule of ``model``, with the parameters' and buffers' storage addresses."""
    _install_hooks()
    entries = []
    for module in model.modules():
        owner = weakref.ref(module)
        for kind in ("_parameters", "_buffers"):
            entries.extend((owner, kind, name, weakref.ref(t), t.data_ptr())
                           for name, t in getattr(module, kind).items() if t is not None)
        entries.extend((owner, "_modules", name, weakref.ref(child), None)
                       for name, child in module._modules.items() if child is not None)
    return WeightSnapshot(tuple(entries), _version)


def snapshot_intact(snapshot: WeightSnapshot) -> bool:
    """True while every parameter, buffer and submodule of the snapshot is still in place (the same object, and
    for tensors the same storage address)."""
    try:
        if tuple(ref().data_ptr() for ref in snapshot.tensors) != snapshot.ptrs:
            return False
    except AttributeError:  # a weak reference died: that tensor was replaced and freed
        return False
    if snapshot.version == _version:
        return True
    for owner, kind, name, ref, _ in snapshot.entries:
        module, obj = owner(), ref()
        if module is None or obj is None or getattr(module, kind).get(name) is not obj:
            return False
    snapshot.version = _version
    return True
