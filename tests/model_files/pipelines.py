"""Pipeline-parallel training code as people write it, for the tests' torchrun scripts: pure torch and transformers,
no oneiter.

- `stages(num_stages, stage_ids)`: the tiny Hugging Face Llama of `hf_llama.py` (4 decoder layers) split into
  `num_stages` stages the torchtitan way: every rank builds the whole model from one seed and keeps, per stage it
  owns, a `LlamaStage` of its part (the token embedding on the first stage, an equal share of the decoder layers
  under their global indices, the final norm and head on the last). A stage's input is token ids (first stage) or
  hidden states; its output hidden states, or logits (last stage).
- `batch(batch_size)`: token ids and next-token labels, the same on every rank; `loss_fn(logits, labels)`.
- `megatron_1f1b(stage, rank, world, microbatches, ...)`: one training step of a 2-or-more-stage pipeline written
  by hand as Megatron-LM's `forward_backward_pipelining_without_interleaving` does it: warm-up forwards, then one
  forward and one backward per step (the forward's send and the next backward's receive posted together with
  `batch_isend_irecv`, as Megatron's `_communicate`), then the cool-down backwards; activations and gradients move
  with `dist.send`/`dist.recv` or `isend`/`irecv` (`p2p="blocking"|"async"`). A stage's backward runs from the
  gradient the next stage sent (`torch.autograd.backward(output, grad_tensors=...)`); each microbatch's loss is
  divided by their number (the gradients accumulate their mean).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

LAYERS = 4
VOCAB = 100


def _full(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
                         attn_implementation="sdpa")
    return LlamaForCausalLM(config)


class LlamaStage(nn.Module):
    """A contiguous part of the Llama: its decoder layers by global index, the embedding first, norm and head last."""

    def __init__(self, full: LlamaForCausalLM, layers: list[int], first: bool, last: bool):
        super().__init__()
        inner = full.model
        self.embed_tokens = copy.deepcopy(inner.embed_tokens) if first else None
        self.layers = nn.ModuleDict({str(i): copy.deepcopy(inner.layers[i]) for i in layers})
        self.rotary_emb = copy.deepcopy(inner.rotary_emb)
        self.norm = copy.deepcopy(inner.norm) if last else None
        self.lm_head = copy.deepcopy(full.lm_head) if last else None

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, positions)
        for layer in self.layers.values():
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
            h = h[0] if isinstance(h, tuple) else h
        if self.lm_head is None:
            return h
        return self.lm_head(self.norm(h))


def stages(num_stages: int, stage_ids: list[int], seed: int = 0) -> list[LlamaStage]:
    """The stages `stage_ids` of a `num_stages`-stage split (module docstring)."""
    if LAYERS % num_stages:
        raise ValueError(f"{LAYERS} decoder layers do not split into {num_stages} equal stages")
    full, per = _full(seed), LAYERS // num_stages
    return [LlamaStage(full, list(range(s * per, (s + 1) * per)), s == 0, s == num_stages - 1) for s in stage_ids]


def batch(batch_size: int, seq_len: int = 8, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq_len + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))


# -- a pipeline written by hand, Megatron-style ---------------------------------------------------------------------
def _recv(buffer: torch.Tensor, src: int) -> None:
    with torch.no_grad():
        dist.recv(buffer, src)


class _P2P:
    """send_forward, recv_forward, send_backward, recv_backward and the combined exchanges of one stage."""

    def __init__(self, rank: int, world: int, shape: tuple, blocking: bool):
        self.rank = rank
        self.prev = rank - 1 if rank > 0 else None
        self.next = rank + 1 if rank < world - 1 else None
        self.shape, self.blocking = shape, blocking

    def _buffer(self):
        return torch.empty(self.shape, requires_grad=True)  # Megatron receives into tensors that require grad

    def _exchange(self, send: torch.Tensor | None, to: int | None, recv: bool, frm: int | None):
        """Send `send` to `to` and/or receive from `frm`, posted together (Megatron's `_communicate`)."""
        got = self._buffer() if recv and frm is not None else None
        if self.blocking:  # even ranks send first, odd ranks receive first: the blocking pairs meet
            steps = [lambda: dist.send(send.detach().contiguous(), to) if send is not None and to is not None
                     else None, lambda: _recv(got, frm) if got is not None else None]
            for step in steps if self.rank % 2 == 0 else steps[::-1]:
                step()
            return got
        ops = []
        if send is not None and to is not None:
            ops.append(dist.P2POp(dist.isend, send.detach().contiguous(), to))
        if got is not None:
            ops.append(dist.P2POp(dist.irecv, got, frm))
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        return got

    def recv_forward(self):
        return self._exchange(None, None, True, self.prev)

    def send_forward(self, out):
        self._exchange(out, self.next, False, None)

    def recv_backward(self):
        return self._exchange(None, None, True, self.next)

    def send_backward(self, grad):
        self._exchange(grad, self.prev, False, None)

    def send_forward_recv_backward(self, out):
        return self._exchange(out, self.next, True, self.next)

    def send_backward_recv_forward(self, grad):
        return self._exchange(grad, self.prev, True, self.prev)


def megatron_1f1b(stage: nn.Module, rank: int, world: int, microbatches: list, take=None, p2p: str = "blocking",
                  hidden_shape: tuple = ()) -> list[torch.Tensor]:
    """One step's forwards and backwards of `stage` (rank `rank` of a `world`-stage pipeline) over `microbatches`:
    the first stage's are token ids, the last stage's labels, the others' unused (their inputs arrive). `take(m)`
    hands microbatch m's data over before it runs (a recorder's `inputs`); `hidden_shape` is the shape of what
    stages exchange. Returns the last stage's losses (each already divided by the number of microbatches)."""
    take = take or (lambda m: m)
    comm = _P2P(rank, world, hidden_shape, p2p == "blocking")
    first, last, num = rank == 0, rank == world - 1, len(microbatches)
    warmup = min(world - rank - 1, num)
    saved, losses, received = [], [], None

    def forward(m: int, inp):
        data = take(microbatches[m])
        out = stage(data if first else inp)
        if last:
            out = loss_fn(out, data) / num
            losses.append(out.detach())
        saved.append((inp, out))
        return out

    def backward(grad):
        inp, out = saved.pop(0)
        torch.autograd.backward(out, grad_tensors=None if last else grad)
        return None if first else inp.grad

    for m in range(warmup):
        comm.send_forward(forward(m, comm.recv_forward()))
    if warmup < num:
        received = comm.recv_forward()
    for m in range(warmup, num):
        out = forward(m, received)
        grad = comm.send_forward_recv_backward(out)
        if m == num - 1:
            comm.send_backward(backward(grad))
        else:
            received = comm.send_backward_recv_forward(backward(grad))
    for _ in range(warmup):
        comm.send_backward(backward(comm.recv_backward()))
    return losses
