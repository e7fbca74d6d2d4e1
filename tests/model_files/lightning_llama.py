"""A PyTorch Lightning module around the tiny random Llama of `hf_llama.py`, trained by a real `lightning.Trainer`.

`LitLlama` is what a Lightning user writes: `training_step` unpacks the batch, calls the Hugging Face model (which
computes its own loss from `labels`), returns the loss; `configure_optimizers` gives AdamW. With `manual=True` it
uses manual optimization (`self.optimizers()`, `manual_backward`, `opt.step()`); with `compile=True` its
`configure_model` compiles the Hugging Face decoder (`torch.compile`), as Lightning's docs show. The model is
faultable from inside (`faultkit`, env ONEITER_TEST_FAULT, e.g. `instance:model.model.layers.1.mlp.down_proj:0.001`):
the model and its faults import nothing of oneiter; only `main`, the user's training script, adds the callback.

`fit(callbacks, model_seed=, data_seed=, **trainer_args)` runs `Trainer.fit` on 16 random sequences for
`max_steps` (default 4) steps. Run as a script, it is a DDP job (`strategy="ddp"` on the CPU, gloo): Lightning
launches the other ranks by running this file again, which is why the callback is built here from the command line:

    python tests/model_files/lightning_llama.py --out run/ref.h5 [--replay run/ref.h5] [--devices 2]
"""

import argparse
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_llama  # noqa: E402

DATA = 16  # sequences in the dataset
SEQ_LEN = 8


class LitLlama(pl.LightningModule):
    def __init__(self, manual: bool = False, lr: float = 1e-2, compile: bool = False, dropout: float = 0.0):
        super().__init__()
        self.model, _inputs, _loss = hf_llama.build(2, seq_len=SEQ_LEN, dropout=dropout)
        self.automatic_optimization = not manual
        self.lr = lr
        self.compile_model = compile

    def configure_model(self):
        if self.compile_model:  # where Lightning's docs compile a model: once, before training (inductor); the
            self.model.model = torch.compile(self.model.model)  # decoder, its head and loss left eager

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def build(batch_size, manual=False):
    """The model contract, for `oneiter replay --layer` of a recording of this module: the `LitLlama` (its layers; the
    file's weights are loaded into them), a batch of token ids and its loss."""
    module = LitLlama(manual=manual)
    ids = torch.randint(0, 100, (batch_size, SEQ_LEN))
    return module, (ids,), lambda out: out


def loader(data_seed: int, batch_size: int = 2) -> torch.utils.data.DataLoader:
    ids = torch.randint(0, 100, (DATA, SEQ_LEN), generator=torch.Generator().manual_seed(data_seed))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=batch_size)


def fit(callbacks, *, model_seed: int = 0, data_seed: int = 0, manual: bool = False, max_steps: int = 4,
        root: str = ".", compile: bool = False, dropout: float = 0.0, **trainer_args) -> pl.Trainer:
    """A quiet CPU `Trainer.fit` of `LitLlama` (built with seed `model_seed`, compiled in `configure_model` with
    `compile`, attention dropout `dropout`) on the data of `data_seed`."""
    torch.manual_seed(model_seed)
    module = LitLlama(manual=manual, compile=compile, dropout=dropout)
    settings = dict(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                    enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    settings.update(trainer_args)
    trainer = pl.Trainer(callbacks=list(callbacks), **settings)
    trainer.fit(module, loader(data_seed))
    return trainer


def main() -> None:
    from oneiter.integrations.lightning import OneIterCallback

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--replay")
    parser.add_argument("--step", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--model-seed", type=int, default=0)
    parser.add_argument("--data-seed", type=int, default=0)
    args = parser.parse_args()
    callback = OneIterCallback(step=args.step, out=args.out, replay=args.replay)
    fit([callback], model_seed=args.model_seed, data_seed=args.data_seed, devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto", root=str(Path(args.out).parent))


if __name__ == "__main__":
    main()
