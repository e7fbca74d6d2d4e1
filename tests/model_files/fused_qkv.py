"""An attention block whose query/key/value projection is one fused parameter saved as three, as torchtitan's
`FusedQKVLinear` does: the module holds `qkv.weight` (what its forward, its gradient and the optimizer see) and
its state_dict hooks split it into `wq.weight`, `wk.weight`, `wv.weight` on save and merge them on load. So the
model's `state_dict` names are not its `named_parameters` names. Nothing here knows oneiter.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class FusedQKV(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.register_state_dict_post_hook(self._split_on_save)
        self.register_load_state_dict_pre_hook(self._merge_on_load)

    def forward(self, x):
        return self.qkv(x).chunk(3, dim=-1)

    @staticmethod
    def _split_on_save(module, state_dict, prefix, local_metadata):
        fused = state_dict.pop(f"{prefix}qkv.weight")
        for name, part in zip(("wq", "wk", "wv"), fused.chunk(3, dim=0), strict=True):
            state_dict[f"{prefix}{name}.weight"] = part.contiguous()

    @staticmethod
    def _merge_on_load(module, state_dict, prefix, *args):
        keys = [f"{prefix}{name}.weight" for name in ("wq", "wk", "wv")]
        if all(k in state_dict for k in keys):
            state_dict[f"{prefix}qkv.weight"] = torch.cat([state_dict.pop(k) for k in keys], dim=0)


class Block(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.attention = FusedQKV(dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 5)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.reshape(b, s, self.heads, -1).transpose(1, 2) for t in self.attention(self.norm(x)))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        return self.head(x + self.out(a))


def build(batch_size):
    model = Block()
    x = torch.randn(batch_size, 6, 16)
    y = torch.randint(0, 5, (batch_size, 6))
    return model, (x,), lambda out: F.cross_entropy(out.reshape(-1, 5), y.reshape(-1).to(out.device))
