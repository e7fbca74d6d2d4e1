"""The recorded iteration's events as they arrive, in the order `phases.py` writes down: each microbatch's batch
(the model's call), its backward, the kept gradients, and the optimizer's step.

Where this sits: `oneiter.Recorder` holds one `IterationFlow`, made with the block's settings and bound to its
session and modes when the block starts (`bind`). The flow owns where the iteration is (`phase`), its microbatches
and their losses (`mb`, `capture/microbatches.py`), the gradients' versions as the last backward left them, and the
managed autocast; it patches `Tensor.backward` for the block and locates an exception raised inside it.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Any, Callable

from oneiter.errors import OneIterError
from oneiter.record.capture import raised_at
from oneiter.record.capture.hooks import next_node_number
from oneiter.record.capture.microbatches import Microbatches, refuse_accumulated
from oneiter.record.loop.phases import MOVES, Phase, never_called
from oneiter.record.modes.active import ActiveModes
from oneiter.record.options import RecordOptions
from oneiter.runtime.precision import AMP_DTYPES, active_autocast, autocast_for

if TYPE_CHECKING:
    import torch

__all__ = ["IterationFlow"]


class IterationFlow:
    """One Recorder block's iteration: its phase, microbatches, gradients' versions and managed autocast.

    `take_batch(args, kwargs)`: the Recorder stores a microbatch's batch (on replay: the reference's in its place);
    `on_first_backward()`: the block's first backward begins (forward is done: the Recorder's size estimate)."""

    def __init__(self, model, options: RecordOptions, accumulation, stepped: bool):
        self.model, self.options, self._accumulation, self._stepped = model, options, accumulation, stepped
        self.phase = Phase.IDLE
        self.mb = Microbatches()  # the microbatches begun, and each one's loss
        self.settled = False  # the gradients are stored (the step began, or the block ends): no microbatch follows
        self._backwards = 0  # backwards run in the block
        self._grad_versions: dict[str, int] = {}
        self.first_call: tuple | None = None  # the model's call of this microbatch: (args, kwargs, first node)
        self.failed_backward: tuple | None = None  # (the exception backward raised, the tensor it ran on)
        self._autocast: torch.autocast | None = None
        # the block's, once it starts (`bind`): its RecordingSession (record/session.py, a part of loop's own rank
        # that loop may not import), modes and device
        self.session: Any = None
        self._modes: ActiveModes | None = None
        self._device: torch.device | None = None
        self._swapped = False
        self.take_batch: Callable | None = None
        self.on_first_backward: Callable[[], None] = lambda: None

    def bind(self, session, modes, device, take_batch: Callable, on_first_backward: Callable[[], None], *,
             swapped: bool) -> None:
        """The block started: its session, modes and device, and what the Recorder does at the batch and at the
        first backward; `swapped`: a replay hands the reference's batch to the model's call in its place."""
        self.session, self._modes, self._device, self._swapped = session, modes, device, swapped
        self.take_batch, self.on_first_backward = take_batch, on_first_backward

    @property
    def modes(self) -> ActiveModes:
        """The block's modes (`bind`)."""
        assert self._modes is not None, "the iteration's events come while its block runs"
        return self._modes

    @property
    def device(self) -> torch.device:
        """The block's device (`bind`)."""
        assert self._device is not None, "the iteration's events come while its block runs"
        return self._device

    def release(self) -> None:
        """The block ended: what it held goes (a loop that records again must not hold the previous recording's)."""
        self.session = self._modes = self.take_batch = None
        self.first_call = self.failed_backward = None
        self.on_first_backward = lambda: None

    def advance(self, to: Phase) -> bool:
        """Enter phase `to` if the iteration may go there from where it is (`MOVES`); whether it did. A backward
        or a step before the model ran has no batch to go with: refused, as the block's end would refuse it."""
        if self.settled and to in (Phase.FORWARD, Phase.BACKWARD):
            return False
        if self.phase in MOVES[to]:
            self.phase = to
            return True
        if self.phase is Phase.OPEN and to in (Phase.BACKWARD, Phase.GRADS, Phase.STEPPED):
            raise never_called()
        return False

    # -- the batch ---------------------------------------------------------------------------------------------------
    def first_forward(self, module, args, kwargs):
        """The model's outermost call: it takes a microbatch's batch when it begins one (the first call, or the first
        after a backward returned), unless `rec.inputs` began the microbatch and handed the batch already."""
        if self.session.module_capture.is_suspended():  # a pipeline schedule's shape inference: no call of it
            return None
        if self.first_call is None:
            self.check_autocast()
        if self.mb.from_inputs:  # after rec.inputs(): the arguments are the batch already
            self.mb.from_inputs = False
            self.first_call = (args, kwargs, next_node_number())
            return None
        if not self._call_begins_microbatch() or not self.begin_microbatch():
            return None  # another call in this microbatch (two views of one batch), or after the step
        assert self.take_batch is not None  # bound, as the session is
        new_args, new_kwargs = self.take_batch(args, kwargs)
        self.first_call = (new_args, new_kwargs, next_node_number())
        return (new_args, new_kwargs) if self._swapped else None

    def _call_begins_microbatch(self) -> bool:
        """Whether a call of the model (without `rec.inputs` before it) begins a microbatch: the first call, or the
        first after a backward returned; a model called twice before its backward runs both calls in one."""
        return self.phase in (Phase.OPEN, Phase.GRADS)

    def begin_microbatch(self) -> bool:
        """The next microbatch begins (its forward comes): numbered, its calls marked with it, and after a backward
        the random/fallback modes and the managed autocast on again. False after the step (none may begin)."""
        first = self.phase is Phase.OPEN
        if not self.advance(Phase.FORWARD):
            return False
        micro = self.mb.begin(next_node_number())
        self.session.module_capture.microbatch = micro
        if first:
            return True
        self.modes.resume()
        self.enter_autocast()
        self.session.enter_phase("forward")
        return True

    def on_chunk(self, phase: str, chunk: int) -> None:
        """A pipeline schedule runs the forward or backward of its microbatch `chunk` on one of this rank's stages
        (`record/modes/pipeline.py`): the stage's calls belong to that microbatch, which begins here unless it
        did already (on another stage of this rank, or at `rec.inputs`)."""
        if self.settled:
            return
        if phase == "backward":
            self.mb.scheduled = chunk
            return
        self.mb.scheduled = -1
        while self.mb.count <= chunk:
            if not self.begin_microbatch():
                return
            self.mb.from_inputs = self.mb.count == 1 and self.first_call is None  # no batch in a stage call
        if self.phase is Phase.GRADS:  # a microbatch begun before: its forward on another of this rank's stages
            self.advance(Phase.FORWARD)
            self.modes.resume()
        self.session.module_capture.microbatch = chunk

    # -- autocast ----------------------------------------------------------------------------------------------------
    def enter_autocast(self) -> None:
        """The managed autocast (`amp` with `manage_autocast`) on, unless it is already."""
        opts = self.options
        if opts.amp and opts.manage_autocast and self._autocast is None:
            self._autocast = autocast_for(self.device, opts.amp)
            self._autocast.__enter__()

    def end_autocast(self) -> None:
        autocast, self._autocast = self._autocast, None
        if autocast is not None:
            autocast.__exit__(None, None, None)

    def check_autocast(self) -> None:
        """The autocast around the model's first call is the one `amp` says: each call's expected noise is measured
        in that precision, and a bf16 run judged as a float32 one would be all divergence."""
        on = active_autocast(self.device.type)
        if on is None or on == self.options.amp:
            return
        raise OneIterError(f"autocast ({AMP_DTYPES[on]}) is on around the model's forward, but this recording was "
                           f"given amp={self.options.amp!r}: give amp={on!r} (with manage_autocast=False when your "
                           f"code enters autocast itself)", param="amp")

    # -- backward ----------------------------------------------------------------------------------------------------
    def patch_backward(self, stack: ExitStack) -> None:
        """`Tensor.backward` and `torch.autograd.backward` (what pipeline schedules call) begin a backward: the
        tensor it runs on is its microbatch's loss, unless gradients are handed to it (a pipeline stage before the
        last runs its backward from the gradients the next stage sent: no loss of its own)."""
        import torch

        originals = (torch.Tensor.backward, torch.autograd.backward)
        flow = self
        running: list[bool] = []  # not empty while a backward of the block runs

        def patched(original, fed):
            def backward(tensor, *args, **kwargs):
                if running or not flow.advance(Phase.BACKWARD):  # Tensor.backward calls autograd.backward
                    return flow._backward(original, tensor, args, kwargs)
                running.append(True)
                try:
                    return flow._run_backward(original, tensor, args, kwargs, fed(args, kwargs))
                finally:
                    running.clear()
            return backward

        torch.Tensor.backward = patched(  # type: ignore[method-assign]  # for the block: `stack` puts it back
            originals[0], lambda a, k: k.get("gradient", a[0] if a else None))
        torch.autograd.backward = patched(originals[1], lambda a, k: k.get("grad_tensors", a[0] if a else None))
        stack.callback(setattr, torch.Tensor, "backward", originals[0])
        stack.callback(setattr, torch.autograd, "backward", originals[1])

    def _run_backward(self, original, tensor, args: tuple, kwargs: dict, grads):
        """One backward of the block (`patch_backward`); `grads` the gradients handed to it, or None."""
        if not self._backwards:  # the block's first backward
            refuse_accumulated(self.model, self._accumulation)
            self.on_first_backward()
        self._backwards += 1
        self.end_autocast()
        self.modes.resume()  # a second backward of a microbatch, after the first paused them
        self.session.enter_phase("backward")
        roots = list(tensor) if isinstance(tensor, (list, tuple)) else [tensor]
        micro = self.mb.of_tensor(roots[0])
        given = [g for g in (grads if isinstance(grads, (list, tuple)) else [grads]) if g is not None]
        if given and any(getattr(r, "numel", lambda: 1)() > 1 for r in roots):  # not a loss (one times a scale)
            self.mb.backwards.add(micro)
            self.modes.backward_from(given, micro)
        else:
            self.mb.note_loss(micro, roots[0].detach())
        result = self._backward(original, tensor, args, kwargs)
        self._after_backward()  # before anything (clipping, unscaling) changes the gradients
        return result

    def _backward(self, original, tensor, args: tuple, kwargs: dict):
        """Run backward; if it raises, keep the tensor it ran on: `locate` walks its graph for the failing node."""
        try:
            return original(tensor, *args, **kwargs)
        except Exception as exc:
            self.failed_backward = (exc, tensor)
            raise

    def _after_backward(self) -> None:
        """A backward returned: the gradients as accumulated so far kept (the next microbatch's backward adds to
        them; clipping or unscaling may change them before the step), the random/fallback modes paused until the
        next microbatch's forward."""
        self.advance(Phase.GRADS)
        self.modes.pause()
        self.session.keep_grads()
        self._grad_versions = self._versions()

    def _versions(self) -> dict[str, int]:
        return {n: p.grad._version for n, p in self.model.named_parameters() if p.grad is not None}

    def on_scaled(self, params: list, factor: float) -> None:
        """A pipeline schedule divided these parameters' gradients by `factor` after its last backward (before the
        step): the stored gradients stay as the last backward left them, and the step's are known exactly."""
        names = {id(p): n for n, p in self.model.named_parameters()}
        divided = {}
        for param in params:
            name = names.get(id(param))
            if name is not None and param.grad is not None and name in self._grad_versions:
                divided[name] = factor
                self._grad_versions[name] = param.grad._version
        self.session.gradients_divided(divided)

    # -- the step ----------------------------------------------------------------------------------------------------
    def before_step(self) -> None:
        """Right before the optimizer updates the weights (after the closure of a closure step: `before_update`)."""
        self.settle_grads()
        if self.advance(Phase.STEPPED):
            self.session.enter_phase("step")
            changed = any(p.grad is not None and p.grad._version != self._grad_versions.get(n)
                          for n, p in self.model.named_parameters())
            self.session.before_step(changed)

    def settle_grads(self) -> None:
        """The step begins (or the block ends): the last microbatch is done. End the random/fallback modes, run the
        probes, store the parameter gradients as the last backward left them (once). The optimizer's update is
        judged right before it steps (`before_step`), when there is an optimizer."""
        if self.settled:
            return
        self.advance(Phase.GRADS)  # from FORWARD when no backward ran
        self.settled = True
        self.modes.close()
        if self.session.probe is not None:
            self.session.enter_phase("probes")
        self.session.step_start()  # before the probes: the optimizer rows of a replay read the reference's
        self.session.after_backward(step_later=self._stepped)
        self.session.param_grads(unreduced=self.modes.own_grads_kept())
        if not self._grad_versions:  # no backward ran: the gradients as the step finds them
            self._grad_versions = self._versions()

    # -- errors ------------------------------------------------------------------------------------------------------
    def locate(self, exc: BaseException, frame: tuple[str, int, str] | None) -> tuple[str, str] | None:
        """Where in the model an exception of the block was raised (`Recorder.locate`), or None."""
        capture = self.session.module_capture
        if self.phase in (Phase.OPEN, Phase.FORWARD):
            return raised_at.forward_place(capture, exc.__traceback__, frame)
        if self.phase is not Phase.BACKWARD:
            return None
        node = raised_at.function_node(exc.__traceback__) if frame is not None else None
        if node is not None:
            return raised_at.backward_place(capture, node, frame)
        failed = self.failed_backward
        node = raised_at.changed_saved_node(failed[1], exc) if failed is not None and failed[0] is exc else None
        if node is None or self.first_call is None:
            return None
        opts = self.options
        autocast = autocast_for(self.device, opts.amp) if opts.amp and opts.manage_autocast else None
        created, note = raised_at.creation_frame(self.model, self.first_call, capture, node, autocast)
        return raised_at.backward_place(capture, node, created, note)
