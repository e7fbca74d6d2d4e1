"""`record/capture/`: what the hooks see of one iteration, and the names it is stored under.

- `structure.py`   nested call arguments flattened into named tensors, and a skeleton to refill them
- `input_grads.py` gradients w.r.t. a call's inputs, read off the autograd graph without changing it
- `recompute.py`   activation checkpointing: a call run again during backward is a recomputation, not a new call
- `batch.py`       the model's batch as a framework delivers it: named, stored, swapped for a reference's
- `microbatches.py` an iteration of several microbatches: which one runs, whose a backward is, their batches and losses
- `hooks.py`       module hooks: every call's inputs, outputs and gradients, in call order (`CallRecord` tree)
- `sink.py`        where captured tensors go: copied once to the writer, a tensor seen before stored as a link
- `blocks.py`      compiled blocks (torch.compile): what a recording of them refuses, writes and says
- `raised_at.py`   which call, phase and line of the user's model raised an exception
- `optimizer_step.py` the moment right before an optimizer updates the weights, closure steps included
"""
