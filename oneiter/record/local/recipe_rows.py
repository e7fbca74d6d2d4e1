"""The rows of calls that run a low-precision recipe: each judged against the recipe's exact emulation.

Where this sits: `probe.py` asks `RecipeRows.recipe(rec)` for every call it probes. For a call whose module runs a
recipe of the table (`recipes.py`), the probe does not calibrate by reruns in float64 (the format's rounding, written
into the module's code, would be in both runs); it hands the call's judged rows here instead. Each row then carries,
besides its error against the reference (rel_l2: the format's cost and any fault together):
- `recipe`: the recipe's name (`torchao.float8 tensorwise`);
- `recipe_rel_l2`: the target's deviation from the recipe's exact emulation on the reference's inputs and weights
  (`emulate.Emulated.deviation`): what the verdict judges, against
- `noise_target`: the accumulation's expected error (`emulate.py`; `noise_reference` 0: the emulation is exact);
- `format_cost`: the emulation against the reference (rel_l2): what the format itself costs, reported, never a fault.
Parameter gradients are judged the same way, summed over the calls that contributed (`param_row`).

The emulation reads the reference's recorded input and output gradient (in the dtypes the target's call held them:
what its recipe quantized) and the reference's recorded weight and bias (`state_before`), never the target's
values, and runs nothing of the target's: a wrong scale, cast or scaled product of the target shows in the deviation
however far below the format's own rounding it is.
"""

from __future__ import annotations

from typing import Callable

import torch

from oneiter.format.schema import BACKWARD, FORWARD, grad_name, tensor_path
from oneiter.record.local.emulate import Emulated, linear
from oneiter.record.local.recipes import Recipe, recipe_of
from oneiter.record.local.rerun import ProbeSkip, rel_l2
from oneiter.record.local.rows import JudgedRow, dtype_name

__all__ = ["RecipeRows", "RECIPE"]

RECIPE = "recipe"  # the `calibration` of a row judged against its recipe's emulation


class RecipeRows:
    """The recipe calls of one probe: their rows filled in, and their parameters' contributions kept for the
    parameter-gradient rows (by canonical name: the emulations summed, and the target's own contributions summed)."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._known: dict[int, Recipe | None] = {}  # id(module) -> its recipe (None: no recipe)
        self.emulated: dict[str, Emulated] = {}
        self.judged: dict[str, torch.Tensor] = {}
        self.names: dict[str, str] = {}  # parameter -> recipe name

    def recipe(self, rec) -> Recipe | None:
        """The recipe `rec`'s module runs, or None; ProbeSkip for a module of the table's kind that it cannot
        emulate (the reason)."""
        key = id(rec.module)
        if key not in self._known:
            try:
                self._known[key] = recipe_of(rec.module)
            except (ValueError, AttributeError) as err:
                raise ProbeSkip(f"it runs a low-precision recipe the recipe table cannot emulate: {err}") from None
        return self._known[key]

    def judge(self, rec, recipe: Recipe, primary, rows: list[JudgedRow], source, rerunner, amp,
              sides: Callable = lambda stored, value: (stored, value)) -> None:
        """Fill `rows` (the call's judged rows) from the recipe's emulation; keep its parameter contributions.
        `sides(stored, rerun)` gives (reference, judged) as the probe pairs them (`--against cpu` judges the stored
        value against the rerun)."""
        if amp is not None:
            raise ProbeSkip(f"it runs {recipe.name} under autocast, whose casts of the recipe's operands and scales "
                            f"the recipe table does not emulate: record with --dtype instead of --amp")
        slots = [s for sk in (rec.args, rec.kwargs) if sk is not None for s in sk.slots if s.dtype.is_floating_point]
        if len(slots) != 1 or "output" not in primary.forward:
            raise ProbeSkip(f"{recipe.name}: a Linear call takes one floating input and returns one output")
        slot, out = slots[0], primary.forward["output"]
        module = rec.module
        weight, w_name = self._param(module, "weight", rerunner)
        bias, b_name = self._param(module, "bias", rerunner) if getattr(module, "bias", None) is not None \
            else (None, None)
        x = source.tensor(tensor_path(rec.key, FORWARD, slot.name)).to(slot.dtype).double()
        grad_path = tensor_path(rec.key, BACKWARD, grad_name("output"))
        grad = source.tensor(grad_path).to(out.dtype).double() if source.has(grad_path) else None
        dtypes = {"output": dtype_name(out.dtype), "grad_input": dtype_name(slot.dtype),
                  "weight": dtype_name(module.weight.dtype),
                  "bias": dtype_name(module.bias.dtype) if bias is not None else "float32"}
        found = linear(recipe, x, weight, bias, grad, dtypes, self.device_type)
        roles = {(FORWARD, "output"): ("output", primary.forward, tensor_path(rec.key, FORWARD, "output")),
                 (BACKWARD, grad_name(slot.name)): ("grad_input", primary.backward,
                                                    tensor_path(rec.key, BACKWARD, grad_name(slot.name)))}
        for row in rows:
            role = roles.get((row.phase, row.tensor))
            if role is not None and role[0] in found:
                reference, value = sides(source.tensor(role[2]), role[1][row.tensor])
                fill(row, recipe.name, found[role[0]], value, reference)
        for part, name in (("weight", w_name), ("bias", b_name)):
            if name is not None and part in found and name in primary.grad_contributions:
                self._keep(name, recipe.name, found[part], primary.grad_contributions[name])

    def _param(self, module, attr: str, rerunner) -> tuple[torch.Tensor, str]:
        """The reference's recorded parameter (state_before) in the live parameter's dtype, and its name."""
        live = getattr(module, attr)
        name = rerunner.names.get(id(live))
        stored = rerunner.reference_state(name) if name is not None else None
        if stored is None or tuple(stored.shape) != tuple(live.shape):
            raise ProbeSkip(f"the reference's {attr} of this recipe's Linear was not recorded whole")
        return stored.to(live.dtype).double(), name

    def _keep(self, name: str, recipe: str, emulated: Emulated, judged) -> None:
        judged = judged.detach().to("cpu", torch.float64)
        self.emulated[name] = emulated if name not in self.emulated else self.emulated[name] + emulated
        self.judged[name] = judged if name not in self.judged else self.judged[name] + judged
        self.names[name] = recipe

    def owns(self, name: str) -> bool:
        """Whether a recipe call contributed to parameter `name`'s gradient."""
        return name in self.emulated

    def param_row(self, name: str, row: JudgedRow, judged, stored,
                  sides: Callable = lambda stored, value: (stored, value)) -> None:
        """A parameter gradient's row: its summed contributions (`judged`) against the recipe calls' summed
        emulations, what other calls contributed taken as they are (their own rows judge them)."""
        summed = judged.detach().to("cpu", torch.float64).reshape(self.judged[name].shape)
        total = self.emulated[name] + Emulated.exact(summed - self.judged[name])
        reference, value = sides(stored, judged)
        fill(row, self.names[name], total, value, reference)


def fill(row: JudgedRow, recipe: str, emulated: Emulated, value, reference) -> None:
    """A row judged against its recipe: the recipe's name, the deviation, the accumulation's noise, the format's
    cost."""
    row.recipe = recipe
    row.recipe_rel_l2 = emulated.deviation(value)
    row.format_cost = rel_l2(reference, emulated.center.reshape(reference.shape))
    row.noise_target, row.noise_reference, row.calibration = emulated.noise(), 0.0, RECIPE
