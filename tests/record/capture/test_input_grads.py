"""A module call's gradient w.r.t. its input is the sum over every consumer inside the call, found by walking the
autograd graph; the walk must find each consumer whatever the Python wrappers of the nodes it visits do."""

from __future__ import annotations

import weakref

import torch

from oneiter.record.capture.input_grads import InputGradTracker, _Pending


class _Node:
    """A stand-in for a C++ autograd node as Python sees it: `next_functions` hands out wrappers made on access,
    which die with their last reference (torch's wrappers do too), unless one is still alive somewhere."""

    _live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def __init__(self, graph: dict, name: str):
        self.graph, self.name = graph, name

    @classmethod
    def of(cls, graph: dict, name: str) -> _Node:
        node = cls._live.get((id(graph), name))
        if node is None:
            node = cls(graph, name)
            cls._live[(id(graph), name)] = node
        return node

    def _sequence_nr(self) -> int:
        return self.graph[self.name][0]

    @property
    def next_functions(self):
        return tuple((_Node.of(self.graph, nxt), 0) for nxt in self.graph[self.name][1])


def test_every_consumer_of_a_residual_blocks_input_is_found_when_node_wrappers_are_freed_and_reallocated():
    # out = x + fc2(relu(fc1(x))): the input x (node "x", made before the call) feeds the add and fc1
    graph = {"x": (1, []), "add": (15, ["x", "fc2"]), "fc2": (14, ["relu"]), "relu": (11, ["fc1"]),
             "fc1": (10, ["x"])}
    target = _Node.of(graph, "x")
    pending = _Pending({(id(target), 0): [("input.0", None)]}, [target], watermark=7)

    class Out(torch.Tensor):  # the call's output: its grad_fn is a fresh wrapper, as a tensor's is
        @property
        def grad_fn(self):
            return _Node.of(graph, "add")

    tracker = InputGradTracker()
    found = tracker._consumers(pending, [torch.empty(0).as_subclass(Out)])
    assert sorted((node.name, slot) for node, slot, _ in found["input.0"]) == [("add", 0), ("fc1", 0)]


def test_a_residual_blocks_recorded_input_gradient_sums_both_paths():
    block_in = torch.randn(4, 8, requires_grad=True)
    fc1, fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)
    x = block_in * 2  # made before the call: its node is the edge the call's input came from
    tracker = InputGradTracker()
    pending = tracker.start([("input.0", x)])
    out = x + fc2(torch.relu(fc1(x)))
    got = {}
    tracker.finish(pending, [out], lambda name, grad: got.setdefault(name, grad.clone()))
    seed = torch.randn_like(out)
    (expected,) = torch.autograd.grad(out, x, seed, retain_graph=True)
    out.backward(seed)
    tracker.remove()
    assert torch.equal(got["input.0"], expected)


def test_a_view_changed_in_place_by_the_next_module_keeps_both_gradients(tmp_path):
    """nn.Linear with a bias returns a view of its 2-d matmul for a 3-d input, and torch never fires a hook
    registered on a view that is then changed in place (the next module is ReLU(inplace=True)): the Linear's
    grad_output and the ReLU's grad_input are still recorded, and are the gradient w.r.t. the value before the
    change, as an out-of-place ReLU gives it."""
    import h5py

    import oneiter

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(inplace=True), torch.nn.Linear(6, 2))
    x = torch.randn(2, 3, 4, requires_grad=True)
    with torch.no_grad():
        assert model[0](x)._is_view()  # the premise
    # the truth: the same math out of place
    h = model[0](x)
    h.retain_grad()
    model[2](torch.relu(h)).square().sum().backward()
    expected = h.grad.clone()
    model.zero_grad()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with oneiter.Recorder(model, tmp_path / "r.h5", optimizer=opt) as rec:
        model(rec.inputs(x.detach().requires_grad_())).square().sum().backward()
        opt.step()
    with h5py.File(tmp_path / "r.h5") as f:
        linear_out = torch.from_numpy(f["calls/0@0/backward/grad_output"][()])
        relu_in = torch.from_numpy(f["calls/1@0/backward/grad_input.0"][()])
    assert torch.equal(linear_out, expected) and torch.equal(relu_in, expected)


class _Pooled(torch.nn.Module):
    """DINOv2's shape: an encoder returning its hidden states and `pooled`, a view of them (`h[:, 0]`) that the
    head never reads; the head reads the hidden states."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 6)

    def forward(self, x):
        h = self.body(x) * 2.0
        return h, h[:, 0]


def test_a_view_nobody_reads_gets_no_gradient_of_its_base(tmp_path):
    """An output that is a view of another output and is never read, and never changed in place, has no gradient:
    nothing of its base's gradient is recorded for it (before, the stand-in for a view changed in place took
    the region of the base's gradient, and a clean replay of DINOv2 was DIVERGED at its pooler_output); a view
    read by the head gets its own gradient (the tensor hook)."""
    import h5py

    import oneiter

    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"enc": _Pooled(), "head": torch.nn.Linear(6, 2)})
    x = torch.randn(2, 3, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)

    def forward(inputs):
        h, pooled = model["enc"](inputs)
        return model["head"](h).square().sum()

    with oneiter.Recorder(model, tmp_path / "r.h5", optimizer=opt) as rec:
        forward(rec.inputs(x.detach().requires_grad_())).backward()
        opt.step()
    with h5py.File(tmp_path / "r.h5") as f:
        names = set(f["calls/enc@0/backward"])
    assert "grad_output.0" in names and "grad_output.1" not in names, names
