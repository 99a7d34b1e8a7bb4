"""A 2-process Lightning run that fails, for tests/test_distributed.py (issue 27): ``CASE OUT``.

CASE: ``raise-rank0`` / ``raise-rank1`` (training_step raises on that rank at the third batch),
``unwritable`` (the checkpoint directory cannot be created: a file is in its way),
``full-disk`` (rank 1's shard of a sharded checkpoint finds no space: ENOSPC),
``interrupt`` (runs until interrupted: OUT/running marks that training runs).
Every process must end within seconds of the failure and the user's error must be printed."""

import errno
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import VOCAB, tiny_gpt2  # noqa: E402

import protrain_core as pt  # noqa: E402
from lightning_protrain import ProTrainStrategy  # noqa: E402


def main(case: str, out: str) -> None:
    import atexit

    import lightning.pytorch as pl

    rank = os.environ.get("LOCAL_RANK", "0")
    # ctrl-C in a terminal reaches Python's own handler (Lightning runs this script again for rank
    # 1). A test run started in the background by a shell without job control (``cmd &`` in a
    # script, CI) passes SIGINT on ignored, and Python then leaves it ignored: the interrupt case
    # would train on, uninterrupted, until the harness kills it.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def stamp(what: str) -> None:  # when this process met the failure, and when it ended
        # Written aside and renamed: a process killed mid-write (Lightning's launcher ends the
        # other rank) leaves no stamp rather than an empty one.
        path = os.path.join(out, f"{what}{rank}")
        with open(f"{path}.tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(f"{path}.tmp", path)

    atexit.register(stamp, "ended")

    class Stamps(pl.Callback):
        def on_exception(self, trainer, pl_module, exception):
            stamp("failed")

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_gpt2(seed=0)

        def training_step(self, batch, i):
            if case == f"raise-rank{self.global_rank}" and i == 2:
                raise ValueError(f"the user's own error on rank {self.global_rank}")
            if case == "interrupt" and i == 2:
                open(os.path.join(out, f"running{self.global_rank}"), "w").close()
            if case == "interrupt" and i >= 2:
                time.sleep(0.05)
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    if case == "full-disk" and rank == "1":
        from torch.distributed.checkpoint.filesystem import FileSystem

        create = FileSystem.create_stream

        def full(self, path, mode):
            if "distcp" in str(path):
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return create(self, path, mode)

        FileSystem.create_stream = full
    dirpath = out
    if case == "unwritable":
        open(os.path.join(out, "in-the-way"), "w").close()
        dirpath = os.path.join(out, "in-the-way", "checkpoints")
    pl.seed_everything(0)
    data = DataLoader(TensorDataset(torch.randint(0, VOCAB, (10_000 if case == "interrupt" else 24, 16))), batch_size=4)
    strategy = ProTrainStrategy(config=pt.ProTrainConfig(planning=pt.PlanningConfig(plan=pt.Plan(n_persist=1, n_buffer=2)), checkpoint=pt.CheckpointConfig(state_dict_type="sharded" if case == "full-disk" else "full")))
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=dirpath, filename="ckpt", every_n_train_steps=2)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2, logger=False,
                         callbacks=[checkpoint, Stamps()], enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Lit(), data)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
