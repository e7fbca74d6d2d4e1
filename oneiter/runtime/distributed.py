"""Multi-rank runs under torchrun: which rank this is, the process group, per-rank file names, the DDP wrapper.

Where this sits: `record/run.py` asks `rank_info()` first. With one process nothing here touches
torch.distributed. With several (`torchrun --nproc-per-node N -m oneiter record ... -o run.h5`) each rank

- writes `run.rank<R>.h5` instead of `run.h5` (`rank_path`) and, with `--replay ref.h5`, replays its own
  `ref.rank<R>.h5` (`replay_path`);
- joins the default process group with the backend of its device type (the `backend` of its row in
  `devices.DEVICE_TYPES`: gloo on the CPU);
- builds the model and batch with seed `seed + R`, then runs the iteration through `DistributedDataParallel`
  (`wrap_ddp`): DDP broadcasts rank 0's parameters and buffers when it wraps the model, so every rank starts
  from the same weights while its batch and labels are its own; in backward DDP averages the gradients across
  ranks (allreduce), so the recorded `param_grads` are the averaged ones, equal on every rank.

The recorder hooks the *inner* model, so module paths stay the user's (`layer1.0.conv1`, not
`module.layer1.0.conv1`); only the call goes through the wrapper. `judge/iteration/ranks.py` pairs the files again.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Mapping

from oneiter.errors import OneIterError
from oneiter.runtime.devices import DEVICE_TYPES, device_type
from oneiter.runtime.meshes import keep_parameters

__all__ = [
    "RANK_FILE", "LOOKS_RANKED", "RankInfo", "rank_info", "current_rank", "rank_path", "replay_path",
    "init_process_group", "process_group", "local_device", "wrap_ddp", "backend_for", "cpu_device",
    "broadcast_object", "all_gather_objects", "gather_objects", "dist_timeout", "TIMEOUT_ENV", "destroy_at_exit",
]

TIMEOUT_ENV = "ONEITER_DIST_TIMEOUT"  # seconds oneiter waits for another rank (its own collectives, a transfer)
DEFAULT_TIMEOUT = 300.0

# `run.rank3.h5` -> stem `run`, rank 3
# a rank file's name: `<stem>.rank<R>.h5`, R written as torchrun numbers ranks (no leading zeros, at most 9 digits);
# LOOKS_RANKED catches the names that look like one and are not (rank00, rank99999999999999999999)
RANK_FILE = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>0|[1-9]\d{0,8})\.h5$")
LOOKS_RANKED = re.compile(r"^(?P<stem>.+)\.rank(?P<rank>\d+)\.h5$")


@dataclass(frozen=True)
class RankInfo:
    """This process's place in the job, from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def distributed(self) -> bool:
        """More than one rank: per-rank files, a process group and DDP."""
        return self.world_size > 1


def dist_timeout(env: Mapping[str, str] | None = None) -> float:
    """How long oneiter waits for other ranks, in seconds: for its own collectives (`compare` under torchrun) and for
    a point-to-point op it records (`record/modes/p2p.py`), whose wait cannot be interrupted otherwise; a rank that
    waits longer stops with one line naming what it waited for. `ONEITER_DIST_TIMEOUT` (default 300)."""
    env = os.environ if env is None else env
    text = env.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise OneIterError(f"environment variable {TIMEOUT_ENV} must be a number of seconds > 0, got '{text}'")
    return value


def rank_info(env: Mapping[str, str] | None = None) -> RankInfo:
    """Read torchrun's variables; absent -> a single process (rank 0 of 1)."""
    env = os.environ if env is None else env
    values = {}
    for key, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
        text = env.get(key, "").strip()
        try:
            values[key] = int(text) if text else default
        except ValueError:
            raise OneIterError(f"environment variable {key} must be an integer, got '{text}'") from None
    info = RankInfo(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
    if info.world_size < 1 or not 0 <= info.rank < info.world_size:
        raise OneIterError(f"expected 0 <= RANK < WORLD_SIZE, got RANK={info.rank} WORLD_SIZE={info.world_size}")
    return info


def current_rank() -> RankInfo:
    """This process's rank: from an initialized default process group (any launcher), else torchrun's variables."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return RankInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK") or 0))
    except ImportError:
        pass
    return rank_info()


def rank_path(out: Path, rank: int, world_size: int) -> Path:
    """`run.h5` on a single process; `run.rank<R>.h5` when several ranks would otherwise write the same file."""
    out = Path(out)
    return out if world_size <= 1 else out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def replay_path(path: Path, info: RankInfo) -> Path:
    """The reference this rank replays: `ref.h5` itself if it is a file, else `ref.rank<R>.h5` beside it, or the
    one `*.rank<R>.h5` in a directory."""
    path = Path(path)
    if not info.distributed or path.is_file():
        return path
    if path.is_dir():
        found = sorted(p for p in path.glob(f"*.rank{info.rank}.h5") if RANK_FILE.match(p.name))
        if len(found) != 1:
            what = "none" if not found else ", ".join(p.name for p in found)
            raise OneIterError(
                f"replay {path}: expected one *.rank{info.rank}.h5 in the directory, got {what}", param="replay")
        return found[0]
    ranked = rank_path(path, info.rank, info.world_size)
    if not ranked.is_file():
        raise OneIterError(f"replay {path}: neither it nor this rank's file '{ranked}' exists", param="replay")
    return ranked


def backend_for(type_name: str) -> str:
    """The torch.distributed backend of a device type, from the device table. Vendor backends (hccl, cncl) come
    with the plugin that `devices.resolve_device` imports for that device, never before."""
    found = device_type(type_name).backend
    if found is None:
        raise OneIterError(
            f"multi-rank recording on device type '{type_name}' is not supported: expected one of "
            f"{', '.join(t.name for t in DEVICE_TYPES.values() if t.backend)}"
        )
    return found


def init_process_group(device, info: RankInfo | None = None, timeout: float | None = None) -> bool:
    """Join torchrun's default process group with the backend for `device` (a torch.device); `timeout` (seconds):
    how long each of its collectives may wait for the other processes (None: the backend's default).

    Returns True if this call created the group (the caller destroys it), False with one rank or when the
    group already exists (a launcher owns it).
    """
    info = info or rank_info()
    if not info.distributed:
        return False
    import torch.distributed as dist

    if not dist.is_available():
        raise OneIterError("this torch build has no torch.distributed: multi-rank recording needs it")
    if dist.is_initialized():
        return False
    if timeout is not None:
        from datetime import timedelta

        dist.init_process_group(backend_for(device.type), rank=info.rank, world_size=info.world_size,
                                timeout=timedelta(seconds=timeout))
    else:
        dist.init_process_group(backend_for(device.type), rank=info.rank, world_size=info.world_size)
    return True


@contextmanager
def process_group(device, info: RankInfo, timeout: float | None = None) -> Iterator[None]:
    """`init_process_group` for the duration of a block; destroyed at exit if this block created it."""
    created = init_process_group(device, info, timeout)
    try:
        yield
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


_DESTROY_AT_EXIT: list[bool] = []  # the exit handler is registered (once per process)


def destroy_at_exit() -> None:
    """At interpreter exit, before Python finalizes, destroy the default process group if it is still there: what a
    framework that never destroys the group it made (the Hugging Face Trainer: accelerate's `end_training` is never
    called) leaves to chance. Its last collective (the Trainer's `store_flos` all-gather) returns while gloo's worker
    thread still holds its tensors, whose Python objects the caller has already let go; freeing them then needs the
    GIL, and when the main thread has begun finalizing by then, CPython ends that thread (`pthread_exit`) and its
    unwinding through the noexcept `ProcessGroupGloo::runLoop` aborts the process: `terminate called without an
    active exception`, exit -6 after a run that succeeded (1 run in 5 of a plain Trainer, oneiter or not:
    `bench/trainer_torchrun_loop.py`). Destroying the group at exit joins those threads while they can still take
    the GIL. A group destroyed before exit is left alone."""
    if _DESTROY_AT_EXIT:
        return
    import atexit

    _DESTROY_AT_EXIT.append(True)
    atexit.register(_destroy_default_group)


def _destroy_default_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def local_device(device, info: RankInfo):
    """On an accelerator without an index, rank R of a multi-rank job uses device LOCAL_RANK (and makes it
    current, as nccl/hccl expect). CPU and explicit indices are returned unchanged."""
    import torch

    if not info.distributed or device.type == "cpu" or device.index is not None:
        return device
    device = torch.device(device.type, info.local_rank)
    backend: Any = getattr(torch, device.type, None)
    if hasattr(backend, "set_device"):
        backend.set_device(device)
    return device


def wrap_ddp(setup, device_mesh=None):
    """A `TrainSetup` whose model is `DistributedDataParallel(setup.bundle.model)`: same inputs and optimizer.

    The caller keeps hooking `setup.bundle.model` (the inner module). Wrapping broadcasts rank 0's parameters
    and buffers to every rank of its group (the default group, or `device_mesh`'s: a data-parallel dimension of the
    model's mesh, `runtime/meshes.py`); CPU modules take `device_ids=None`.
    """
    from torch.nn.parallel import DistributedDataParallel

    device_ids = None if setup.device.type == "cpu" else [setup.device]
    inner = setup.bundle.model
    before = dict(inner.named_parameters())
    ddp = DistributedDataParallel(inner, device_ids=device_ids, device_mesh=device_mesh)
    if device_mesh is not None:  # DDP over a sub-mesh of tensor-parallel parameters: they become local Parameters
        after = keep_parameters(inner)
        swap = {id(before[n]): p for n, p in after.items() if n in before}
        for group in setup.optimizer.param_groups if setup.optimizer is not None else ():
            group["params"] = [swap.get(id(p), p) for p in group["params"]]
    return replace(setup, bundle=replace(setup.bundle, model=ddp))


def cpu_device():
    """The CPU as a torch.device: what `process_group` joins with for work that runs on the CPU (compare)."""
    import torch

    return torch.device("cpu")


def _own(what: str, run):
    """One of oneiter's own collectives: a process that stopped, or one that did not come within the group's timeout
    (`dist_timeout`, given to `process_group`), ends this one with one line naming it (exit 2), not a traceback."""
    try:
        return run()
    except Exception as exc:  # noqa: BLE001 - the backend's: a peer gone, a timeout
        text = " ".join(str(exc).split())[:300]
        raise OneIterError(f"oneiter's {what} over the job's processes failed on this process: {type(exc).__name__}: "
                           f"{text} (another process stopped, or took longer than {TIMEOUT_ENV}={dist_timeout():g} "
                           f"seconds)") from exc


def broadcast_object(obj):
    """Process 0's `obj` on every process of the default group (pickled)."""
    import torch.distributed as dist

    box = [obj]
    _own("broadcast", lambda: dist.broadcast_object_list(box, src=0))
    return box[0]


def all_gather_objects(obj) -> list:
    """Every process's `obj`, in process order, on every process."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    _own("all-gather", lambda: dist.all_gather_object(out, obj))
    return out


def gather_objects(obj) -> list | None:
    """Every process's `obj`, in process order, on process 0; None on the others."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    _own("gather", lambda: dist.gather_object(obj, out, dst=0))
    return out
