"""The schema of a oneiter recording (documented in docs/format.md): its names, paths, tables and stored dtypes.

Everything that says *where* a tensor lives and *how* it is stored, without opening a file: group and table
names, the tensor-name grammar, the columns of `/local`, `/unprobed` and `/stats`, and the torch dtypes HDF5 has
no type for (`RAW_BITS`). The file itself (`file_writer.py` writes, `layout.py` reads), the validation walk
(`validate.py`, `attributes.py`) and every package that names a call or a tensor import it; it imports nothing of
oneiter but `errors`, so each of them can. No pickle anywhere: tensors are plain datasets, metadata plain attributes.

Layout, schema `oneiter.iteration` version 2::

    /                          attrs: schema, schema_version, complete (written last), model, device, ...
    /batch/input.<i>           the model inputs
    /loss                      the loss (0-d)
    /calls/<module>@<call>     one group per module call; attrs module, call, parent, exec_index, class_name, seq_*
        forward/input.<i>[...], forward/kwarg.<name>[...], forward/output[.<i>|.<key>]...
        backward/grad_output..., backward/grad_input.<i>..., backward/grad_kwarg.<name>...
    /local                     one row per locally judged tensor (a table; `record --replay` / `--against cpu`)
    /unprobed                  the calls that could not be rerun, and why (a table)
    /state_before/<name>       every parameter and buffer before the iteration
    /param_grads/<name>        every parameter gradient after backward
    /state_after/<name>        every parameter and buffer after the optimizer step
    /random/<index>            values of each random op, in order (attrs op, index, output)
    /optimizer_state/<param>.<key>   the optimizer's state when the step began (AdamW's exp_avg, step, ...)
    /collectives/<index>       each torch.distributed collective this rank ran, in order (attrs op, group, phase,
        call, site, ...): input.<i> (this rank's contributions), output.<i> (what it received)
    /param_grads_unreduced/<name>  every parameter gradient before a reduction over ranks (DDP), where one ran

A recording of several iterations (`record --steps N`, schema version 4) holds one such tree per iteration
under `/steps/<step>/` (each a statistics-level iteration with its own root attributes, batch and random values;
the first one's `state_before` and `optimizer_state` in full: where a replay starts) and, at the root, the
per-step signature tables `/signature` and (a replay) `/twin_signature` (`format/signature.py`).

Tensor names inside a call: `input.<i>` (positional arguments, nested: `input.1.0`), `kwarg.<name>` (keyword
arguments), `output` / `output.<i>` / `output.<key>`; the gradient w.r.t. a tensor named X is `grad_X`. In the
local table a container's own code is judged on what it hands its children: `<child call>:input.0` (forward)
and `<child call>:grad_output` (backward), e.g. `layer1.0.conv2@0:input.0`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from oneiter.errors import OneIterError

__all__ = [
    "SCHEMA", "SCHEMA_VERSION", "ROOT_MODULE", "BATCH", "LOSS", "CALLS", "MICROBATCHES", "MICROBATCH",
    "MICROBATCH_LOSS", "STATE_BEFORE", "PARAM_GRADS", "STATE_AFTER",
    "STEP_START", "STEP_GRADS", "CLIP_ROW", "OPTIMIZER_MODULE", "OPTIMIZER_CLASS", "STATE_NAMES",
    "RANDOM", "RANDOM_OPS", "RANDOM_OUTPUTS",
    "FORWARD", "BACKWARD", "LOCAL", "UNPROBED", "STATS", "PRECISION_MODES", "COMPILED", "REDUCED_TARGET",
    "REDUCED_CALLS", "REDUCED_REFERENCE", "REDUCED_CALLS_REFERENCE", "FOREIGN_KERNELS", "UNBOUNDED", "LOCAL_OPTIONAL",
    "RAW_BITS",
    "check_name", "call_key",
    "split_call_key", "tensor_path", "grad_name", "child_tensor", "split_child_tensor", "group_path", "call_path",
    "arg_name", "kwarg_name", "is_input", "natural_key", "decode", "to_torch", "tensor_to_numpy", "seq_kind",
    "LOCAL_FIELDS", "LocalRow", "UNPROBED_FIELDS", "STATS_VALUES", "STATS_FIELDS", "plain", "STRIDE", "STORAGE_OFFSET",
    "layout_attrs", "layout_from_attrs", "PLACEMENTS", "GLOBAL_SHAPE", "GLOBAL_OFFSET", "shard_attrs", "GRAD_REDUCTION",
    "OPTIMIZER", "optimizer_entry", "split_optimizer_entry", "STEPS", "SIGNATURE", "TWIN_SIGNATURE",
    "step_group",
    "split_step", "COLLECTIVES", "UNREDUCED_GRADS", "COLLECTIVE_OPS", "REDUCE_OPS", "COLLECTIVE_ATTRS",
    "P2P_OPS", "P2P_ATTRS", "collective_group", "collective_path", "collective_index", "IMPACT", "IMPACT_FIELDS",
    "ImpactRow",
]

SCHEMA = "oneiter.iteration"
# dataset attributes of a call's tensor that was a non-contiguous view in the live call (absent: contiguous from the
# start of its storage): its strides and storage offset, which a rerun gives the tensor back
STRIDE, STORAGE_OFFSET = "stride", "storage_offset"
# a rank's shard of a sharded (FSDP2/DTensor) parameter, gradient or buffer: where it sits in the full tensor
PLACEMENTS, GLOBAL_SHAPE, GLOBAL_OFFSET = "placements", "global_shape", "global_offset"
GRAD_REDUCTION = "grad_reduction"  # root attribute: how parameter gradients were reduced over ranks
SCHEMA_VERSION = 4  # 3: `level` and the `/stats` table (record --level stats); 4: `/optimizer_state`, `/steps`
ROOT_MODULE = "(root)"  # how the model itself (module path "") is named in files and reports

BATCH, LOSS, CALLS = "batch", "loss", "calls"
# an iteration of several microbatches (gradient accumulation; docs/format.md "Microbatches"): the root attribute
# with their number (absent: 1), the attribute of a call group or batch tensor naming its microbatch (absent: 0),
# and the dataset of each microbatch's loss (float [K])
MICROBATCHES, MICROBATCH, MICROBATCH_LOSS = "microbatches", "microbatch", "microbatch_loss"
OPTIMIZER = "optimizer_state"  # group: the optimizer's state when the recorded step began, `<param>.<key>`
STEPS = "steps"  # group of a multi-step recording: one iteration's tree per `/steps/<step>`
# multi-step tables, one row per step (`format/signature.py`): the run's, and its perturbed twin's
SIGNATURE, TWIN_SIGNATURE = "signature", "twin_signature"
STATE_BEFORE, PARAM_GRADS, STATE_AFTER = "state_before", "param_grads", "state_after"
# group: the parameters the model itself wrote during the iteration (in place, outside the optimizer:
# nn.Embedding(max_norm) renormalises the rows it looks up, in forward), as the optimizer step found them; every
# other parameter starts its step as `state_before` holds it
STEP_START = "step_start"
# the gradients as the optimizer step saw them, where code between backward and the step changed them (clipping,
# unscaling); group attributes: coefficient (NaN: no single one), grad_norm, step_norm, spread (`record/local/
# clipping.py`)
STEP_GRADS = "step_grads"
# root attributes: the optimizers' classes (`module.qualname`, comma separated) and, in a replay whose optimizer keeps
# the reference's state under other names, JSON {its key: the reference's key} (`record/start/state_names.py`)
OPTIMIZER_CLASS, STATE_NAMES = "optimizer_class", "optimizer_state_names"
# the /local row of the clipping itself: (optimizer)@0 optimizer clip_coef
OPTIMIZER_MODULE, CLIP_ROW = "(optimizer)", "clip_coef"
RANDOM = "random"  # values of random ops (dropout masks, randn...), recorded on the reference, replayed on targets
FORWARD, BACKWARD, LOCAL, UNPROBED = "forward", "backward", "local", "unprobed"
STATS = "stats"  # `--level stats`: one table row per entry (path, statistics, checksum), no per-entry dataset
# root attribute (JSON): the reduced-precision flags in force (TF32, HF32) and the float32 op families they reduce
PRECISION_MODES = "precision_modes"
# root attribute (JSON): the compiled blocks (torch.compile) of the recorded model and what compiling cost
COMPILED = "compiled"
# /local attributes: the families the calibration's reruns reproduced reduced for each side (JSON), and for how
# many calls they rounded operands
REDUCED_TARGET, REDUCED_CALLS = "reduced_target", "reduced_calls"
REDUCED_REFERENCE, REDUCED_CALLS_REFERENCE = "reduced_reference", "reduced_calls_reference"
# /local attribute (JSON): the ops whose kernels were not torch's own where the calibration ran (`record/modes/
# trusted.py`): {"cpu": [{op, key, registered, route}], "device": {"type", "plugin", "ops": [...]}}
FOREIGN_KERNELS = "foreign_kernels"
# /local attribute (JSON): the noise bounds the calibration had to measure and could not (`record/local/probe.py`
# `_bound`): [{"what": a call key or a parameter name, "reason": the error}]; absent or [] when none failed
UNBOUNDED = "unbounded"

# overload packet names of aten ops whose values come from an RNG (what `/random` holds), and those that record more
# than one tensor: native_dropout keeps its output and its mask
RANDOM_OPS = frozenset({
    "bernoulli", "bernoulli_", "native_dropout", "rand", "rand_like", "randn", "randn_like", "randint",
    "randint_like", "randperm", "normal", "normal_", "uniform", "uniform_", "exponential_", "geometric_",
    "cauchy_", "log_normal_", "multinomial", "random_", "poisson", "binomial", "_standard_gamma",
    "_sample_dirichlet", "rrelu_with_noise", "rrelu_with_noise_",
})
RANDOM_OUTPUTS = {"native_dropout": 2}

# every torch.distributed collective of the iteration, per rank, in the order it ran (`record/modes/collectives.py`):
# /collectives/<index:05d> with its attributes (`COLLECTIVE_ATTRS`), input.<i> and output.<i>
COLLECTIVES = "collectives"
# each parameter's gradient as this rank's own backward left it, before a reduction over ranks (DDP's all-reduce)
UNREDUCED_GRADS = "param_grads_unreduced"
# what a collective does (its `op` attribute); the judge knows the exact result of the first five
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "reduce", "gather",
                  "scatter", "send", "recv", "barrier")
REDUCE_OPS = ("sum", "avg", "product", "min", "max", "band", "bor", "bxor", "premul_sum", "")  # "": none
# a collective's attributes and their types: `op` one of COLLECTIVE_OPS, `kernel` the dispatcher op that ran
# (`c10d.allreduce_.default`), `reduce_op` one of REDUCE_OPS, `group` the process group's name, `group_ranks` its
# global ranks, `group_seq` how many collectives this rank ran on that group before, `root` the global rank a
# broadcast sends from (-1: none), `phase` forward, backward or optimizer (the step's), `call` the module call whose
# code ran it ("" none:
# DDP's gradient buckets, FSDP2's parameter management), `site` where (file:line in function, or `DDP bucket <n>`),
# `via` the torch.distributed package that issued it ("": the model's own code), `bucket` DDP's bucket number (-1),
# `recomputed` whether activation checkpointing ran it again in backward, `seq` its place in the capture order,
# `in_splits`/`out_splits` an all-to-all's split sizes ([]: equal)
COLLECTIVE_ATTRS = {"op": str, "kernel": str, "reduce_op": str, "group": str, "group_ranks": list, "group_seq": int,
                    "root": int, "phase": str, "call": str, "site": str, "via": str, "bucket": int,
                    "recomputed": bool, "seq": int, "in_splits": list, "out_splits": list}
# a point-to-point op (`op` one of P2P_OPS: `record/modes/p2p.py`) is one entry of /collectives too, its `group_seq`
# -1 (its place is on its channel, not on the group), with these attributes more: `peer` the other rank (global),
# `tag`, `p2p_seq` how many ops of the same direction this rank ran with that peer on that group and tag before (the
# n-th send from rank a to rank b is the n-th recv of rank b from rank a), `microbatch` the microbatch it moved
# (docs/format.md "Microbatches"; 0 for an iteration of one); a send holds `input.0`..., a recv `output.0`...
P2P_OPS = ("send", "recv")
P2P_ATTRS = {"peer": int, "tag": int, "p2p_seq": int, "microbatch": int}


def collective_group(index: int) -> str:
    """`collectives/00003`: the group of this rank's collective number 3."""
    return f"{COLLECTIVES}/{index:05d}"


def collective_path(index: int, name: str) -> str:
    """`collectives/00003/output.0`: a tensor of collective 3 (`input.<i>`, `output.<i>`)."""
    return f"{collective_group(index)}/{name}"


def collective_index(name: str) -> int | None:
    """3 for a collective's group name `00003`; None for any other name (five digits at least, no sign)."""
    return int(name) if len(name) >= 5 and name.isdigit() else None

# torch dtypes HDF5 has no type for: stored as raw bits of this numpy type, with the dtype name in attrs
RAW_BITS = {
    "bfloat16": np.uint16,
    "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8, "float8_e4m3fnuz": np.uint8, "float8_e5m2fnuz": np.uint8,
}


def check_name(name: str, what: str) -> None:
    """Refuse, at record time, a module path or tensor name holding '/': HDF5 would read it as nested groups and
    the recording could not be read back (a ModuleDict key or a dict output key such as 'a/b')."""
    if "/" in name:
        raise OneIterError(f"cannot record {what} '{name}': it contains '/', which HDF5 reads as a group separator; "
                           f"rename the ModuleDict or dict key")


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def optimizer_entry(param: str, key: str) -> str:
    """`layer1.weight.exp_avg`: the dataset name of one value of the optimizer's state for a parameter."""
    return f"{param}.{key}"


def split_optimizer_entry(name: str) -> tuple[str, str] | None:
    """(parameter name, state key) of an `optimizer_entry` name; None when it is not one (the key is an identifier,
    so the last dot separates them)."""
    param, dot, key = name.rpartition(".")
    return (param, key) if dot and param and _KEY.fullmatch(key) else None


def step_group(step: int) -> str:
    """`steps/6`: the group of iteration 6 in a multi-step recording."""
    return f"{STEPS}/{step}"


def split_step(path: str) -> tuple[int | None, str]:
    """(step, path inside it) of a path under `/steps/<step>/`, else (None, path)."""
    head, _, rest = path.partition("/")
    if head != STEPS:
        return None, path
    number, _, inner = rest.partition("/")
    return (int(number), inner) if number.isdigit() else (None, path)


def call_key(module: str, call: int) -> str:
    """`layer1.0.conv1@0`: the group name of a module call, and the key reports use."""
    return f"{module or ROOT_MODULE}@{call}"


def split_call_key(key: str) -> tuple[str, int]:
    module, _, call = key.rpartition("@")
    return module, int(call)


def tensor_path(key: str, phase: str, name: str) -> str:
    """`calls/layer1.0.conv1@0/forward/input.0`: where a call's tensor lives."""
    return f"{CALLS}/{key}/{phase}/{name}"


def grad_name(name: str) -> str:
    """The name of the gradient w.r.t. tensor `name`: `output` -> `grad_output`, `kwarg.x` -> `grad_kwarg.x`."""
    return f"grad_{name}"


def child_tensor(child_key: str, name: str) -> str:
    """How the local table names a tensor a container hands its child: `layer1.0.conv2@0:input.0`."""
    return f"{child_key}:{name}"


def split_child_tensor(tensor: str) -> tuple[str, str] | None:
    """(child call key, tensor name) for a `child_tensor` name, None for a call's own tensor."""
    head, sep, name = tensor.rpartition(":")
    return (head, name) if sep and "@" in head else None


def group_path(group: str, name: str) -> str:
    """`state_before/layer1.0.conv1.weight`, `batch/input.0`: a named tensor of a top-level group."""
    return f"{group}/{name}" if group else name


def call_path(key: str, phase: str | None = None) -> str:
    """`calls/<key>` (its attributes) or `calls/<key>/<phase>` (its tensors of one phase)."""
    return f"{CALLS}/{key}" if phase is None else f"{CALLS}/{key}/{phase}"


# -- the tensor-name grammar ----------------------------------------------------------------------------------------
# A call's tensors: positional arguments `input.<i>`, keyword arguments `kwarg.<name>`, outputs `output` (one
# tensor) or `output.<i>`/`output.<key>` (nested containers add `.<index>`/`.<key>`), gradients `grad_<name>`.
def arg_name(index: int) -> str:
    return f"input.{index}"


def kwarg_name(key: str) -> str:
    return f"kwarg.{key}"


def is_input(tensor: str) -> bool:
    """Inputs of a call: forward inputs/kwargs, and in backward the gradients w.r.t. its outputs."""
    return tensor.startswith(("input", "kwarg", "grad_output"))


def natural_key(name: str) -> tuple:
    """Sort key of tensor names: `input.10` after `input.2`, `output.2` before `output.10`."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def decode(array: np.ndarray, dtype_name: str) -> np.ndarray:
    """A stored array as numbers numpy can compute with: bfloat16 bits become float32 (exactly)."""
    if dtype_name == "bfloat16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    if dtype_name in RAW_BITS:  # float8: decoding needs torch's tables
        return to_torch(array, dtype_name).float().numpy()
    return array


def to_torch(array: np.ndarray, dtype_name: str):
    """A stored array as a torch tensor with its original dtype, bit for bit."""
    import torch

    array = np.asarray(array)
    if not array.flags.c_contiguous or not array.flags.writeable:
        array = array.copy()
    tensor = torch.from_numpy(array)
    if dtype_name in RAW_BITS:
        signed = {np.uint16: torch.int16, np.uint8: torch.uint8}[RAW_BITS[dtype_name]]
        tensor = tensor.view(signed).view(getattr(torch, dtype_name))
    return tensor


def tensor_to_numpy(tensor) -> tuple[np.ndarray, str]:
    """A CPU tensor as (numpy array to store, torch dtype name). Shares memory where it can."""
    import torch

    dtype_name = str(tensor.dtype).removeprefix("torch.")
    if dtype_name in RAW_BITS:
        bits = torch.int16 if RAW_BITS[dtype_name] is np.uint16 else torch.uint8
        return tensor.view(bits).numpy().view(RAW_BITS[dtype_name]), dtype_name
    return tensor.numpy(), dtype_name


def seq_kind(tensor_name: str) -> str:
    """Which capture moment a tensor name belongs to: input, output, grad_output or grad_input.

    Capture order is kept per call group (attrs `seq_input`, `seq_output`, `seq_grad_output`, `seq_grad_input`),
    not per dataset, because a dataset hard-linked from two calls has one set of attributes.
    """
    head = tensor_name.split(".", 1)[0]
    return {"kwarg": "input", "grad_kwarg": "grad_input"}.get(head, head)


# -- the local table ------------------------------------------------------------------------------------------------
LOCAL_FIELDS = (
    ("module", "str"), ("call", "i8"), ("phase", "str"), ("tensor", "str"), ("seq", "i8"), ("dtype", "str"),
    ("numel", "i8"), ("rel_l2", "f8"), ("max_abs", "f8"), ("cosine", "f8"),
    ("nan_ref", "i8"), ("inf_ref", "i8"), ("nan", "i8"), ("inf", "i8"), ("mismatch", "i8"),
    ("noise_target", "f8"), ("noise_reference", "f8"), ("calibration", "str"), ("noise_bound", "f8"),
    ("recipe", "str"), ("recipe_rel_l2", "f8"), ("format_cost", "f8"),
)
"""Columns of `/local`. A row judges one tensor a call's own code produced, rerun on trustworthy inputs:
rel_l2/max_abs/cosine/NaN/Inf counts of the judged value against its reference (`_ref` columns: the reference
side), `mismatch` the positions where NaN/Inf differ (position and sign), `noise_target`/`noise_reference` the
calibrated expected rel-L2 error of the target's and the reference's precision (NaN: not calibrated, because
the error was already within one unit roundoff), `calibration` where that was measured (`cpu`, `device`,
with `:float32` or `:monte_carlo` when the float64 run failed: docs/blame.md), `noise_bound` what the precision
can produce for the call as measured on the trusted path, the check of that noise (NaN: not needed, the noise was
within `precision.NOISE_BOUND_FACTOR` unit roundoffs; docs/blame.md "A noise estimate is itself checked").
A call that runs a low-precision recipe (torchao's float8 Linears, MX: `record/local/recipes.py`) names it in `recipe`
("" for none); `recipe_rel_l2` is the target's deviation from the recipe's exact emulation on the reference's inputs
(what its noise, the accumulation's, judges; `calibration` `recipe`) and `format_cost` that emulation against the
reference: the format's own cost (NaN without a recipe; docs/blame.md "Low-precision formats")."""
LOCAL_OPTIONAL = {"noise_bound": float("nan"), "recipe": "", "recipe_rel_l2": float("nan"),
                  "format_cost": float("nan")}
"""Columns of `/local` a file written before them lacks, and the value they read as there."""


@dataclass(frozen=True)
class LocalRow:
    module: str
    call: int
    phase: str
    tensor: str
    seq: int
    dtype: str
    numel: int
    rel_l2: float
    max_abs: float
    cosine: float
    nan_ref: int
    inf_ref: int
    nan: int
    inf: int
    mismatch: int
    noise_target: float
    noise_reference: float
    calibration: str
    noise_bound: float = float("nan")
    recipe: str = ""
    recipe_rel_l2: float = float("nan")
    format_cost: float = float("nan")

    @property
    def key(self) -> tuple[str, int, str, str]:
        return (self.module, self.call, self.phase, self.tensor)


STATS_VALUES = ("numel", "min", "max", "mean", "l2", "abs_sum", "nan", "inf")
"""The float64 statistics of a stats-level entry, in the order `format.stats.Stats.values` holds them."""

STATS_FIELDS = (("path", "str"), *((n, "f8") for n in STATS_VALUES), ("checksum0", "i8"), ("checksum1", "i8"),
                ("checksum_kind", "str"), ("dtype", "str"), ("shape", "str"))
"""Columns of `/stats`: the entry's path, its `STATS_VALUES`, the checksum (two ints), its kind, dtype and shape."""

UNPROBED_FIELDS = (("module", "str"), ("call", "i8"), ("reason", "str"))
"""Columns of `/unprobed`: the calls the local probe could not rerun, and why."""

# -- the impact table -----------------------------------------------------------------------------------------------
IMPACT = "impact"
IMPACT_FIELDS = (
    ("kind", "str"), ("module", "str"), ("call", "i8"), ("phase", "str"), ("tensor", "str"), ("rel_l2", "f8"),
    ("ratio", "f8"), ("loss", "f8"), ("loss_gap", "f8"), ("grad_gap", "f8"), ("weight_gap", "f8"), ("note", "str"),
)
"""Columns of `/impact` (`record --impact`, `record/impact/runs.py`): one row per run of the iteration from its start —
`kind` `plain` (nothing fixed), `call` (the call `module`/`call` fixed: its flagged row `phase`/`tensor`, own error
`rel_l2` and its ratio to its expected noise) or `all` (every candidate fixed) — with the run's `loss`, and its gaps to
the reference: `loss_gap` |loss - loss_ref|, `grad_gap` the parameter gradients' rel_l2 over all of them, `weight_gap`
the updated weights' distance relative to the reference's update (NaN: not measured); `note` says why a call was not
fixed, or why nothing was measured. Attributes: `num_flagged`, `top` (-1: no bound), `recorded_loss`,
`reference_loss`, `check` (the plain run's loss against the recorded one, relative: 0 bit for bit), `seconds`."""


@dataclass(frozen=True)
class ImpactRow:
    kind: str
    module: str
    call: int
    phase: str
    tensor: str
    rel_l2: float
    ratio: float
    loss: float
    loss_gap: float
    grad_gap: float
    weight_gap: float
    note: str


def plain(value: Any) -> Any:
    """An HDF5 value as a plain Python value: bytes decoded, numpy scalars and arrays as Python ones."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    return value


def layout_attrs(layout: tuple | None) -> dict | None:
    """The dataset attributes (`STRIDE`, `STORAGE_OFFSET`) of a tensor's layout
    (`record.capture.structure.layout_of`)."""
    if layout is None:
        return None
    return {STRIDE: [int(x) for x in layout[0]], STORAGE_OFFSET: int(layout[1])}


def layout_from_attrs(attrs: dict) -> tuple | None:
    """The (strides, storage offset) a dataset's `STRIDE` and `STORAGE_OFFSET` attributes hold (`layout_attrs`), or
    None: the live tensor was contiguous from offset 0."""
    if attrs.get(STRIDE) is None:
        return None
    return tuple(int(s) for s in attrs[STRIDE]), int(attrs.get(STORAGE_OFFSET) or 0)


def shard_attrs(placement: tuple | None) -> dict | None:
    """The dataset attributes (`PLACEMENTS`, `GLOBAL_SHAPE`, `GLOBAL_OFFSET`) of a rank's shard
    (`runtime.sharding.placement_of`), else None."""
    if placement is None:
        return None
    placements, shape, offset = placement
    attrs = {PLACEMENTS: placements, GLOBAL_SHAPE: [int(x) for x in shape]}
    if offset is not None:
        attrs[GLOBAL_OFFSET] = [int(x) for x in offset]
    return attrs
