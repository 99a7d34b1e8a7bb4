"""One Lightning run for tests/test_distributed.py, launched as a script (Lightning's launcher
starts the other processes by running this file again): ``trainer|fabric STRATEGY DEVICES OUT
[--sharded] [--resume CKPT]``. Writes each rank's losses and final weights to OUT/rank<r>.pt and
a checkpoint (a file, or a directory when sharded): OUT/ckpt.ckpt (the Trainer's ModelCheckpoint),
OUT/ckpt (Fabric); the Trainer also saves OUT/final.ckpt after fit, then predicts (each rank's
predictions written too)."""

import argparse
import os
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import VOCAB, tiny_gpt2  # noqa: E402

import protrain_core as pt  # noqa: E402
from lightning_protrain import ProTrainFabricStrategy, ProTrainStrategy  # noqa: E402

PLAN = pt.Plan(n_persist=1, n_buffer=2, n_checkpoint=1)


def trainer_run(args) -> None:
    import lightning.pytorch as pl

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2(seed=0)
            self.losses = []

        def training_step(self, batch, i):
            loss = self.model(input_ids=batch[0], labels=batch[0]).loss
            self.losses.append(loss.item())
            return loss

        def predict_step(self, batch, i):
            return self.model(input_ids=batch[0]).logits.sum(-1)

        def configure_optimizers(self):
            if args.state_format == "8bit" and args.strategy != "protrain":  # what ProTrain's "8bit" equals
                import bitsandbytes as bnb

                return bnb.optim.AdamW8bit(self.parameters(), lr=1e-2)
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)  # fused: what ProTrain equals bitwise

    pl.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (24, 16), generator=g)), batch_size=4, shuffle=True)
    strategy = args.strategy
    if strategy == "protrain":
        strategy = ProTrainStrategy(config=pt.ProTrainConfig(planning=pt.PlanningConfig(plan=PLAN), checkpoint=pt.CheckpointConfig(state_dict_type="sharded" if args.sharded else "full"),
                                                             optimizer_state_format=args.state_format))
    lit = Lit()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=args.out, filename="ckpt")  # ckpt.ckpt, while training
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                         logger=False, callbacks=[checkpoint], enable_progress_bar=False,
                         enable_model_summary=False, accumulate_grad_batches=2, gradient_clip_val=0.5)
    trainer.fit(lit, data, ckpt_path=args.resume)
    trainer.save_checkpoint(os.path.join(args.out, "final.ckpt"))  # after fit: a file, whatever the type
    # Lightning's predict sampler does not pad: 9 samples are 3 batches on rank 0, 2 on rank 1.
    few = DataLoader(TensorDataset(torch.randint(0, VOCAB, (9, 16), generator=g)), batch_size=2)
    predictions = trainer.predict(lit, few)
    _write(args.out, trainer.global_rank, trainer.world_size, lit.losses, lit.model.state_dict(), predictions)


def fabric_run(args) -> None:
    from lightning.fabric import Fabric

    strategy = args.strategy
    if strategy == "protrain":
        strategy = ProTrainFabricStrategy(config=pt.ProTrainConfig(planning=pt.PlanningConfig(plan=PLAN), checkpoint=pt.CheckpointConfig(state_dict_type="sharded" if args.sharded else "full")))
    fabric = Fabric(accelerator="cpu", devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    model = tiny_gpt2(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (16, 4, 16), generator=g)
    losses = []
    for _ in range(3):
        x = data[(state["step"] * fabric.world_size + fabric.global_rank) % len(data)]
        loss = model(input_ids=x, labels=x).loss
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=0.5)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        state["step"] += 1
    fabric.save(os.path.join(args.out, "ckpt"), state)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()} if args.strategy != "protrain" else None
    _write(args.out, fabric.global_rank, fabric.world_size, losses, weights)


def _write(out, rank, world, losses, weights, predictions=None) -> None:
    torch.save({"losses": losses, "world": world, "weights": weights, "predictions": predictions},
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("api", choices=["trainer", "fabric"])
    parser.add_argument("strategy")
    parser.add_argument("devices", type=int)
    parser.add_argument("out")
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--resume")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--state-format", default="fp32")  # ProTrain's optimizer_state_format ("8bit": DDP runs AdamW8bit)
    a = parser.parse_args()
    trainer_run(a) if a.api == "trainer" else fabric_run(a)
