"""One tensor in several places of one call (nn.MultiheadAttention's query = key = value; a Hugging Face encoder
returning its last hidden state also as the last of its hidden states) is one tensor to the rerun too: its slots
after the first name the first (`Slot.alias`), the rerun hands the call the very same tensor there, seeds its
gradient once, and a forced child returns it once."""

from __future__ import annotations

import torch

from oneiter.record.capture.structure import fill, skeleton, skeleton_call


def test_a_tensor_given_in_several_places_is_an_alias_of_its_first_slot():
    h, m = torch.randn(2, 3), torch.randn(2, 3)
    pos, kw = skeleton_call((h, h, m), {"value": m, "mask": None})
    assert [(s.name, s.alias) for s in pos.slots] == [("input.0", None), ("input.1", "input.0"), ("input.2", None)]
    assert [(s.name, s.alias) for s in kw.slots] == [("kwarg.value", "input.2")]
    # equal values in another tensor are no alias
    assert skeleton_call((h, h.clone()), {})[0].slots[1].alias is None


def test_an_output_returned_twice_is_an_alias_too():
    last = torch.randn(2)
    out = skeleton({"last_hidden_state": last, "hidden_states": (torch.randn(2), last)}, "output")
    assert [(s.name, s.alias) for s in out.slots] == [
        ("output.last_hidden_state", None), ("output.hidden_states.0", None),
        ("output.hidden_states.1", "output.last_hidden_state")]
    made = {}
    rebuilt = fill(out, lambda slot: made.setdefault(slot.alias or slot.name, torch.zeros(2)))
    assert rebuilt["hidden_states"][1] is rebuilt["last_hidden_state"]
