"""Progress of a run on rank 0: a tqdm bar on a terminal (step, loss, tokens/s, ETA), plain
log lines otherwise, one JSON line of metrics per step, and TensorBoard when installed."""

from __future__ import annotations

import json
import os
import sys
import time

from flatshard.cli.errors import warn
from flatshard.cli.runs import METRICS


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"


def read_metrics(path: str) -> tuple[list[dict], int]:
    """The records of a metrics.jsonl and how many unreadable lines were left out. A power
    loss or a full disk can cut the last line short (or leave NUL bytes); such lines are
    dropped, never raised on (only rank 0 reads the file: an error there would leave the
    other ranks waiting)."""
    if not os.path.exists(path):
        return [], 0
    with open(path, "rb") as handle:
        lines = [line for line in handle.read().split(b"\n") if line.strip(b"\0 \t\r")]
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            continue
        if isinstance(record, dict):
            records.append(record)
    return records, len(lines) - len(records)


class Progress:
    def __init__(
        self,
        *,
        total_steps: int,
        start_step: int,
        log_interval: int,
        metrics_path: str,
        tensorboard_dir: str | None,
        interactive: bool | None = None,
    ):
        self.total, self.start, self.log_interval = total_steps, start_step, log_interval
        self.interactive = _sized_terminal() if interactive is None else interactive
        self._keep_metrics_until(metrics_path, start_step)
        self.metrics = open(metrics_path, "a")
        self.tensorboard = _tensorboard(tensorboard_dir)
        self.bar = None
        if self.interactive:
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=start_step, ncols=110,
                bar_format="step {n_fmt}/{total_fmt} |{bar}| {desc} [{elapsed}<{remaining}]",
            )  # fmt: skip
        self._started = time.perf_counter()

    @classmethod
    def of_run(cls, config, run_dir: str, start_step: int) -> Progress:
        """The progress of a training run in `run_dir` (its metrics.jsonl, TensorBoard)."""
        tensorboard = os.path.join(run_dir, "tensorboard") if config.run.tensorboard else None
        return cls(
            total_steps=config.train.steps,
            start_step=start_step,
            log_interval=config.run.log_interval,
            metrics_path=os.path.join(run_dir, METRICS),
            tensorboard_dir=tensorboard,
        )

    @staticmethod
    def _keep_metrics_until(path: str, step: int) -> None:
        """A resumed run rewrites the steps after its checkpoint: drop their old lines (and
        a torn last line, which would otherwise stay in the middle of the file)."""
        records, torn = read_metrics(path)
        if torn:
            warn(f"{path}: dropped {torn} torn line(s) (cut short by an interrupted write)")
        kept = [r for r in records if r.get("step", 0) <= step]
        with open(path, "w") as handle:
            handle.writelines(json.dumps(r) + "\n" for r in kept)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def step(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()
        step = record["step"]
        if self.tensorboard is not None:
            for name in ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_bytes", "comm_bytes"):
                self.tensorboard.add_scalar(f"train/{name}", record[name], step)
            for name in ("loss", "perplexity"):
                if f"eval_{name}" in record:
                    self.tensorboard.add_scalar(f"eval/{name}", record[f"eval_{name}"], step)
        if self.bar is not None:
            self.bar.set_description_str(
                f"loss {record['loss']:.4f}, {record['tokens_per_s']:,.0f} tok/s", refresh=False
            )
            self.bar.update(1)
            if "eval_loss" in record:
                self.message(f"step {step}: {_eval_text(record)}")
            return
        if step % self.log_interval == 0 or step in (self.start + 1, self.total):
            done = step - self.start
            remaining = (time.perf_counter() - self._started) / done * (self.total - step)
            self.message(
                f"step {step:>{len(str(self.total))}}/{self.total} | loss {record['loss']:.4f} | "
                f"lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | "
                f"{record['tokens_per_s']:,.0f} tok/s | eta {format_duration(remaining)}"
            )
        if "eval_loss" in record:
            self.message(f"step {step:>{len(str(self.total))}}/{self.total} | {_eval_text(record)}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        self.metrics.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _eval_text(record: dict) -> str:
    return (
        f"eval loss {record['eval_loss']:.4f} | perplexity {record['eval_perplexity']:.2f} "
        f"({record['eval_tokens']:,} tokens)"
    )


def _sized_terminal() -> bool:
    """Whether stderr is a terminal a bar can be drawn on: one of no size (a pseudo-terminal
    under `script` from a pipe) gets the plain step lines, as a pipe does."""
    if not sys.stderr.isatty():
        return False
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns > 0
    except OSError:
        return False


def _tensorboard(directory: str | None):
    if directory is None:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        print(
            "TensorBoard is not installed: no events written (pip install tensorboard); "
            "metrics.jsonl has every step",
            flush=True,
        )
        return None
    return SummaryWriter(directory)
