"""`--float8 tensorwise|rowwise` (`Recorder(float8=...)`): the model's Linears converted to torchao's float8 training
for the recording, and converted back after it.

Where this sits: a recording mode (`record/recorder.py` enters it before anything else of the block, so hooks,
compilation and the reference's weights see the converted model; `oneiter replay` converts the layer's model the
same way). It asks "what would FP8 do to this model" on any machine, the way `--amp bf16` asks it for bf16: the
replay's calls that run the recipe are then judged against its exact emulation (`record/local/recipes.py`), and the
report states what the format costs per call.

Which Linears: every `nn.Linear` whose input and output features are both divisible by 16 (torch's scaled matrix
product needs that), except a model's output projection, named `lm_head` (Hugging Face) or `output` (torchtitan),
which FP8 recipes leave in high precision. The swap is torchao's `convert_to_float8_training` with
`Float8LinearConfig.from_recipe_name(recipe)`; a `Float8Linear` keeps the very parameter objects of the Linear it
replaces, so the optimizer, the parameter names and the reference's weights are unchanged, and converting back puts
the original modules in place. torchao is an optional extra: `pip install -c constraints.txt 'oneiter[float8]'`.
"""

from __future__ import annotations

from typing import Callable

from oneiter.errors import OneIterError

__all__ = ["RECIPES", "KEPT", "convert", "eligible"]

RECIPES = ("tensorwise", "rowwise")
KEPT = ("lm_head", "output")  # the output projection's names: left in high precision
INSTALL = "pip install -c constraints.txt 'oneiter[float8]'"


def eligible(name: str, module) -> bool:
    """Whether the Linear at `name` is converted: both dimensions divisible by 16, not the output projection."""
    return (name.rpartition(".")[2] not in KEPT and module.in_features % 16 == 0
            and module.out_features % 16 == 0)


def convert(model, recipe: str) -> Callable[[], None]:
    """Swap `model`'s eligible Linears for torchao's `Float8Linear` of `recipe`, in place; returns the undo. Raises
    OneIterError when torchao is missing or no Linear of the model is eligible."""
    if recipe not in RECIPES:
        raise OneIterError(f"float8 takes one of {', '.join(RECIPES)}, got {recipe!r}", param="float8")
    try:
        import torch.nn as nn
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
    except ImportError as err:
        raise OneIterError(f"float8 needs torchao ({err}): {INSTALL}", param="float8") from None
    config = Float8LinearConfig.from_recipe_name(recipe)
    swapped = []
    for name, module in list(model.named_modules()):
        if name and type(module) is nn.Linear and eligible(name, module):
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, Float8Linear.from_float(module, config=config))
            swapped.append((parent, attr, module))
    if not swapped and any(isinstance(m, Float8Linear) for m in model.modules()):
        raise OneIterError("float8: the model's Linears are torchao's Float8Linear already (converted by its own "
                           "code): drop float8, its recipe calls are judged as they are", param="float8")
    if not swapped:
        raise OneIterError("float8: no Linear of the model has both dimensions divisible by 16 (torch's scaled matrix "
                           "product needs that; the output projection is left in high precision)", param="float8")

    def undo() -> None:
        for parent, attr, module in reversed(swapped):
            setattr(parent, attr, module)

    return undo
