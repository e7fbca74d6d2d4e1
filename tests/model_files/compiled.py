"""Another model file's model, returned compiled the way training code compiles it.

`build(batch_size, model="functional_cnn", how="wrapper", backend="inductor", blocks="", **kwargs)` calls the
`build` of the model file `model` (a sibling of this file, with `kwargs`) and compiles its model:
- `how="wrapper"`: `torch.compile(model)` (an `OptimizedModule`, parameters named `_orig_mod.*`);
- `how="in_place"`: `model.compile()`;
- `how="forward"`: `model.forward = torch.compile(model.forward)`;
- `how="blocks"`: each outermost module whose path fully matches the regex `blocks` replaced by `torch.compile(it)`;
- `how="eager"`: not compiled (the reference).
`backend` is any registered torch.compile backend; importing `wrong_backend` registers the deliberately wrong ones
(`wrong_gelu`, ...). Faults of the wrapped model file (`faultkit`, env ONEITER_TEST_FAULT) act inside the compiled
code, since they change the model's own code.
"""

import importlib
import re

import torch
import wrong_backend  # noqa: F401  (registers the wrong_<op> backends)


def build(batch_size, model="functional_cnn", how="wrapper", backend="inductor", blocks="", **kwargs):
    built = importlib.import_module(model).build(batch_size, **kwargs)
    net = built[0]
    if how == "wrapper":
        net = torch.compile(net, backend=backend)
    elif how == "in_place":
        net.compile(backend=backend)
    elif how == "forward":
        net.forward = torch.compile(net.forward, backend=backend)
    elif how == "blocks":
        _compile_blocks(net, re.compile(blocks), backend)
    elif how != "eager":
        raise ValueError(f"how must be wrapper, in_place, forward, blocks or eager, got {how!r}")
    return (net, *built[1:])


def _compile_blocks(net, pattern, backend) -> None:
    done = []
    for path, module in list(net.named_modules()):
        if not path or any(path.startswith(d + ".") for d in done) or not pattern.fullmatch(path):
            continue
        parent_path, _, name = path.rpartition(".")
        setattr(net.get_submodule(parent_path), name, torch.compile(module, backend=backend))
        done.append(path)
    if not done:
        raise ValueError(f"blocks={pattern.pattern!r} matches no module")
