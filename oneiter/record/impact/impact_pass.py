"""One run of the iteration fed what the reference's had (`ReferencePass`), and the impact run on it (`ImpactPass`).

Where this sits: `runs.py` calls the loop's iteration (`Recorder.run(fn)`'s `fn`) once per impact run inside an
`ImpactPass`, with the start swapped in (`start.py`); the multi-step twin's pass (`record/steps/twin.py`) is the same
`ReferencePass`. A pass gives the iteration what the recorded one had: the reference's batch (handed out by
`inputs`, or swapped into the model's first call), its random values, the autocast and `--fallback` of the
recording. Its loss is the tensor the first backward runs on (or the one `loss` names). An impact run also fixes
calls (`fixed_call.Fixes`), measures the parameter gradients when that backward returns and the updated weights when
the iteration is over (`gaps.py`). Nothing is written to the recording while a pass runs.

A *perturbed* impact run (`perturb`: a unit roundoff u) runs nothing fixed, its weights multiplied by (1 ± 2u) with
random signs from a fixed seed until the optimizer steps (the multi-step twin's perturbation: the gradients at
perturbed weights, the update on the clean ones): how far one rounding of the run's precision moves each gap,
against which the fixes' shares are read.
"""

from __future__ import annotations

import math
from contextlib import ExitStack

import torch

from oneiter.errors import OneIterError
from oneiter.record.capture.batch import map_call
from oneiter.record.capture.hooks import next_node_number, unscaled
from oneiter.record.capture.microbatches import Microbatches, reference_swaps
from oneiter.record.capture.optimizer_step import before_update
from oneiter.record.impact.fixed_call import Fixes
from oneiter.record.impact.gaps import Gaps, ReferenceGaps
from oneiter.record.local.rerun import scaled_by_signs
from oneiter.record.modes.fallback import OpFallback
from oneiter.record.modes.randomness import RandomReplayer, recorded_random_ops
from oneiter.runtime.precision import autocast_for

__all__ = ["ReferencePass", "ImpactPass"]

PERTURBATION_SEED = 0x1A7C  # the perturbed pass's signs: a generator seeded with this plus the parameter's position


class ReferencePass:
    """The block runs the iteration of reference `view` (an open recording of one iteration) once more: the
    reference's batch of each microbatch (handed out by `inputs`, or swapped into the model's call that begins it, as
    the Recorder begins them: docs/format.md "Microbatches"), its random values, autocast as the recording has it
    (entered again for each microbatch's forward), the op fallback; its loss is the tensor the first backward of each
    microbatch runs on (or the one `loss` names), summed over microbatches."""

    def __init__(self, model, view, options, device):
        self.model, self.view, self.options, self.device = model, view, options, device
        self.replayer = None  # the random values' replayer (None: the reference drew none)
        self._mb = Microbatches()
        self._backward_since = False  # a backward returned since the current microbatch began
        self._autocast = None

    def __enter__(self):
        opts = self.options
        self._swaps = reference_swaps(self.view)
        stack = ExitStack()
        try:
            if recorded_random_ops(self.view):  # every op goes through it: only where there are random ops
                self.replayer = stack.enter_context(RandomReplayer(self.view, self.device,
                                                                   replay=opts.random_replay))
            if opts.fallback:
                stack.enter_context(OpFallback(opts.fallback))
            self._enter(stack)
            stack.callback(self.model.register_forward_pre_hook(self._first_forward, with_kwargs=True,
                                                                prepend=True).remove)
            self._patch_backward(stack)
            self._enter_autocast()
            stack.callback(self._end_autocast)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, *exc) -> None:
        self._end_autocast()
        self._stack.__exit__(*exc)

    def _enter(self, stack: ExitStack) -> None:  # noqa: B027 - a hook: what a kind of pass adds
        """What a kind of pass adds when it starts (its undo on `stack`)."""

    def _after_backward(self) -> None:  # noqa: B027 - a hook: what a kind of pass measures
        """A backward has returned (the last one's call is what the iteration's gradients are)."""

    def _enter_autocast(self) -> None:
        opts = self.options
        if opts.amp and opts.manage_autocast and self._autocast is None:
            self._autocast = autocast_for(self.device, opts.amp)
            self._autocast.__enter__()

    def _end_autocast(self) -> None:
        autocast, self._autocast = self._autocast, None
        if autocast is not None:
            autocast.__exit__(None, None, None)

    def _patch_backward(self, stack: ExitStack) -> None:
        original = torch.Tensor.backward
        owner = self

        def backward(tensor, *args, **kwargs):
            owner._end_autocast()  # the first backward of a microbatch: autocast ends, its tensor is the loss
            owner._mb.note_loss(owner._mb.of_tensor(tensor), tensor.detach())
            result = original(tensor, *args, **kwargs)
            owner._backward_since = True
            owner._after_backward()
            return result

        # patched for the pass, restored below (mypy: a method assigned, with a looser signature)
        torch.Tensor.backward = backward  # type: ignore[method-assign, assignment]
        stack.callback(setattr, torch.Tensor, "backward", original)

    def _begin(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The next microbatch: the reference's batch of it in place of `args`/`kwargs`."""
        micro = self._mb.begin(next_node_number())
        if micro >= len(self._swaps):
            raise OneIterError(f"this run of the iteration began microbatch {micro}, the reference's ran "
                               f"{len(self._swaps)}", param="inputs")
        if micro:
            self._enter_autocast()
        self._backward_since = False
        args, kwargs = map_call(args, kwargs, self._swaps[micro])
        self._swaps[micro].check_complete()
        return args, kwargs

    def _first_forward(self, module, args, kwargs):
        if self._mb.from_inputs:
            self._mb.from_inputs = False
            return None
        if self._mb.count and not self._backward_since:
            return None  # another call in this microbatch
        return self._begin(args, kwargs)

    # -- what the loop calls (through the Recorder or StepRecorder) -------------------------------------------------
    def inputs(self, *args, **kwargs):
        args, kwargs = self._begin(args, kwargs)
        self._mb.from_inputs = True
        if kwargs:
            return args, kwargs
        return args[0] if len(args) == 1 else tuple(args)

    def loss(self, tensor):
        self._mb.note_loss(self._mb.current, tensor.detach(), explicit=True)
        return tensor

    def note(self, **attrs) -> None:
        """Notes are the recorded iteration's; a pass keeps none."""

    def loss_tensor(self, scale: float = 1.0):
        """The iteration's loss: each microbatch's (the tensor its backward ran on divided by `scale`, unless
        `loss` named it), summed; None when no backward ran."""
        if not self._mb.has_loss():
            return None
        return self._mb.total(self._mb.values(lambda t: unscaled(t, scale)))

    def loss_value(self) -> float:
        loss = self.loss_tensor()
        return math.nan if loss is None else float(loss.float())


class ImpactPass(ReferencePass):
    """The block runs the iteration once more (`targets`: (module path, call index) of the calls to fix)."""

    def __init__(self, model, ref, options, device, gaps: ReferenceGaps, targets=(), loss_scale: float = 1.0, *,
                 perturb: float = 0.0, optimizers=(), expected: dict | None = None):
        super().__init__(model, ref, options, device)
        self.reference, self.targets, self.scale = gaps, list(targets), float(loss_scale)
        self.perturb, self.optimizers, self.expected = float(perturb), list(optimizers), expected
        self.fixes: Fixes | None = None
        self._grad_gap = math.nan
        self._clean: list = []

    def _enter(self, stack: ExitStack) -> None:
        if self.targets:
            self.fixes = stack.enter_context(Fixes(self.model, self.targets, self.replayer, self.expected))
        if self.perturb:
            self._perturb_weights(stack)

    def _after_backward(self) -> None:
        # after each backward: the last one's (every microbatch's sum) before anything (clipping) changes them
        self._grad_gap = self.reference.grads(self.scale)

    def gaps(self) -> Gaps:
        """How far this run landed from the reference (call once the block has ended)."""
        total = self.loss_tensor(self.scale)
        if total is None:
            raise OneIterError("an impact run ran no backward: the iteration function must run the whole iteration "
                               "(forward, loss, backward, the optimizer's step)", param="impact")
        loss = float(total.float())
        return Gaps(loss, self.reference.loss_gap(loss), self._grad_gap, self.reference.weights(), self.reference.loss)

    def _perturb_weights(self, stack: ExitStack) -> None:
        """Every floating weight times (1 ± 2u) until the optimizer steps (then the clean ones again)."""
        for index, p in enumerate(self.model.parameters()):
            if p.is_floating_point():
                gen = torch.Generator().manual_seed(PERTURBATION_SEED + index)
                signs = torch.randint(0, 2, p.shape, generator=gen, dtype=torch.int8)
                self._clean.append((p, p.data))
                p.data = scaled_by_signs(p.data, signs, 2.0 * self.perturb)
        for opt in self.optimizers:
            stack.callback(before_update(opt, self._unperturb).remove)
        stack.callback(self._unperturb)

    def _unperturb(self) -> None:
        for p, clean in self._clean:
            p.data = clean
        self._clean = []
