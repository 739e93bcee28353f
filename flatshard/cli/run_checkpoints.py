"""A training run's checkpoints: what it saves besides the weights and where, its resume, and
the last good checkpoint a failure points to.

A checkpoint holds the model and optimizer (a LoRA run: the adapters and their state only),
the data position, the run config, and the records a complete export needs (the tokenizer,
the Hugging Face config: `hf_records.py`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass

from flatshard import checkpoint
from flatshard.checkpoint import commit, host_memory
from flatshard.cli import runs
from flatshard.cli.schedule import schedule_change


@dataclass
class Resumed:
    """Where a resumed run stands: its step, the checkpoint it came from, the data position,
    and what the header says of a changed schedule (rank 0; None elsewhere)."""

    step: int
    path: str
    position: int
    schedule_note: str | None


class RunCheckpoints:
    def __init__(self, run_dir: str, config, model, optimizer, records: dict):
        self.root = runs.checkpoint_root(run_dir)
        self.memory = runs.memory_root(run_dir)  # snapshots in host memory
        self.config, self.model, self.optimizer, self.records = config, model, optimizer, records
        self.trainable_only = bool(config.train.lora_rank)  # LoRA: the adapters
        self.last_saved: int | None = None

    def resume(self, step: int, ranks) -> Resumed:
        """Load `step`: from disk, or from the host-memory snapshot where only it has it."""
        on_disk = os.path.isdir(os.path.join(self.root, commit.step_dir_name(step)))
        root = self.root if on_disk else self.memory
        result = runs.resume(root, self.model, self.optimizer, step, ranks,
                             trainable_only=self.trainable_only,
                             host_local=not on_disk)  # fmt: skip
        self.last_saved = result.step
        note = None
        if ranks.is_main:
            saved = runs.saved_extra(result.path, "run_config")
            saved_train = json.loads(saved).get("train", {}) if saved else {}
            note = schedule_change(saved_train, self.config.train, result.step)
        return Resumed(result.step, result.path, result.extra["data_position"], note)

    def snapshot(self, step: int, position: int) -> None:
        """Into host memory, in the background: each host's ranks' files, and a copy of the
        previous host's; only the newest is kept."""
        if self.last_saved != step:
            self._save(self.memory, step, position, async_save=True, keep_last=1,
                       host_local=True)  # fmt: skip

    def drop_newer_snapshots(self, step: int | None) -> None:
        """A run going on from `step` (None: from the start) snapshots the later steps anew."""
        host_memory.drop_after(self.memory, step)

    def forget_snapshots(self) -> None:
        """The run is over: give the host memory back (every host its own)."""
        checkpoint.wait_for_pending_save()
        shutil.rmtree(self.memory, ignore_errors=True)

    def save(self, step: int, position: int, async_save: bool = False) -> None:
        """Save at `step` (once: a second call at the same step does nothing)."""
        if self.last_saved == step:
            return
        keep = self.config.checkpoint.keep_last or None
        self._save(self.root, step, position, async_save=async_save, keep_last=keep)
        self.last_saved = step

    def _save(self, root, step, position, *, async_save, keep_last, host_local=False):
        saving = self.config.checkpoint
        checkpoint.save(
            root,
            model=self.model,
            optimizer=self.optimizer,
            step=step,
            async_save=async_save,
            keep_last=keep_last,
            staging_bytes=saving.staging_mib << 20,
            data_position=position,
            run_config=self.config.to_json(),
            trainable_only=self.trainable_only,
            host_local=host_local,
            **self.records,
        )

    def latest(self) -> str | None:
        """The newest complete checkpoint, once any save in flight has finished."""
        checkpoint.wait_for_pending_save()
        return commit.latest_dir(self.root)
