"""A rerun kept apart from the live iteration, in its site's precision: outer dispatch modes off, buffers and RNG
states restored after, FSDP2's hooks off, autocast and reduced operands as the site says (`enter_site`).

Where this sits: `rerun.py`'s `Rerunner` enters these around each rerun."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch

from oneiter.record.capture.hooks import CallRecord
from oneiter.record.capture.recompute import checkpoint_disabled
from oneiter.record.local.reduced import ReducedOperands
from oneiter.record.local.rerunning.site import AMBIENT, Site
from oneiter.record.modes import trusted
from oneiter.record.modes.casts import KeptCasts
from oneiter.record.modes.roundoff_mode import RoundoffInjection
from oneiter.runtime import host_random, module_state
from oneiter.runtime.compiled import eager
from oneiter.runtime.sharding import is_fsdp_hook

__all__ = ["enter_site"]


def enter_site(stack: ExitStack, rec: CallRecord, site: Site, target_device):
    """Enter what a rerun of `rec` at `site` runs under; returns the site's reduced-operands mode (or None)."""
    stack.enter_context(_isolated(rec.module, rec, site.device, target_device))
    stack.enter_context(checkpoint_disabled())  # the call's math; no recomputation meets forced children
    stack.enter_context(_without_sharding_hooks(rec.module))
    stack.enter_context(trusted.running(site.trusted))
    if not site.live:  # a compiled block's code stands for its eager code here (`runtime/compiled.py`)
        stack.enter_context(eager())
    _high_precision(stack, site)
    stack.enter_context(_autocast(site, target_device))
    return stack.enter_context(_reduced(site))


@contextmanager
def _autocast(site: Site, target_device) -> Iterator[None]:
    if site.autocast == AMBIENT:
        yield
        return
    with ExitStack() as stack:
        for device_type in {site.device.type, torch.device(target_device).type}:
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(torch.autocast(device_type=device_type, enabled=False))
        if site.autocast is not None:
            stack.enter_context(torch.autocast(device_type=site.device.type, dtype=site.autocast))
        yield


@contextmanager
def _reduced(site: Site) -> Iterator[Any]:
    """The site's reduced-precision operands (`reduced.ReducedOperands`) for forward and backward, or nothing."""
    if not site.reduced:
        yield None
        return
    with ReducedOperands(dict(site.reduced)) as mode:
        yield mode


@contextmanager
def _without_sharding_hooks(module) -> Iterator[None]:
    """FSDP2's forward hooks off on `module` and every module under it for a rerun: a rerun on one rank must run no
    collective, and must not reduce gradients into the real iteration's. The parameters it reads are those the live
    call had: a call under an FSDP2 unit runs (and is rerun, when it returns) while its unit's parameters are
    all-gathered; the unit itself returns after its parameters are sharded again, so its rerun forces its children
    (a child that is not forced and reads a sharded parameter fails, and the unit is listed as not probed)."""
    saved = []  # (hook dict, its entries in order): restored as they were, FSDP2's pre-hook first
    for mod in module.modules():
        for name in ("_forward_pre_hooks", "_forward_hooks"):
            hooks = getattr(mod, name, None)
            if hooks and any(is_fsdp_hook(h) for h in hooks.values()):
                saved.append((hooks, list(hooks.items())))
                for key in [k for k, h in hooks.items() if is_fsdp_hook(h)]:
                    del hooks[key]
    try:
        yield
    finally:
        for hooks, items in saved:
            hooks.clear()
            hooks.update(items)


@contextmanager
def _isolated(module, rec: CallRecord, *devices) -> Iterator[None]:
    """Outer dispatch modes off, gradients on; buffers (BatchNorm running stats) and RNG states restored after.
    Python's and numpy's generators, and the tensors the modules keep in plain attributes (RecurrentGemma's
    recurrent state), start where they were when the live call began (`rec.host_random`, `rec.attributes`: the
    model's own draws, SpecAugment's masks, are the live call's again; a rerun never starts from, nor backpropagates
    into, the live call's end state) and are left as they were found."""
    from torch.utils._python_dispatch import _disable_current_modes

    buffers = [(b, b.detach().clone()) for b in module.buffers()]
    found = host_random.state()
    if rec.host_random is not None:
        host_random.set_state(rec.host_random)
    cpu_rng = torch.get_rng_state()
    backends = []
    for device in {torch.device(d).type for d in devices} - {"cpu"}:
        backend = getattr(torch, device, None)
        if backend is not None and hasattr(backend, "get_rng_state"):
            backends.append((backend, backend.get_rng_state()))
    try:
        with _disable_current_modes(), torch.enable_grad(), module_state.started(rec.attributes):
            yield
    finally:
        torch.set_rng_state(cpu_rng)
        host_random.set_state(found)
        for backend, state in backends:
            backend.set_rng_state(state)
        with torch.no_grad():
            for live, saved in buffers:
                # through .data: the real iteration saved these buffers for backward (BatchNorm), and a version
                # bump would make autograd reject them
                live.data.copy_(saved)


def _high_precision(stack: ExitStack, site: Site) -> None:
    """The modes of a high-precision site: a lower precision's rounding injected into every op (`inject`), and the
    casts the model's code makes to narrower floats kept (`modes/casts.py`; float64 sites and the calibration's high
    run)."""
    if site.inject is not None:
        stack.enter_context(RoundoffInjection(*site.inject))
    if site.cast == "float64" or site.name == "high":
        stack.enter_context(KeptCasts(site.inject[0] if site.inject is not None else None))
