"""`flatshard train`: the training loop each rank runs.

Every step: the learning rate for the step, `global_batch / (micro_batch x world)`
micro-batches of forward and backward, gradient clipping, one small all-gather that shares
each rank's loss, stop request and peak memory (so every rank takes the same decision), then
the optimizer step unless the loss or gradient norm is not finite. Checkpoints hold the
model, optimizer, per-rank RNG, the data position and the run config, so `--resume`
continues with exactly the losses an uninterrupted run would have had.
"""

from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

import flatshard
from flatshard import comm
from flatshard.checkpoint import host_memory
from flatshard.checkpoint.state import checkpoint_group
from flatshard.cli import attempts, elastic, runs
from flatshard.cli.config import RunConfig
from flatshard.cli.config_rules import check, parallel_dims, with_microbatches
from flatshard.cli.errors import TrainingStopped
from flatshard.cli.evaluation import Evaluation
from flatshard.cli.generate import sample_at_end
from flatshard.cli.hf_records import checkpoint_records
from flatshard.cli.launch import EXIT_STOPPED, Ranks, init_distributed
from flatshard.cli.meters import MemoryMeter, share_step, warm_up_runtime
from flatshard.cli.model import llama_config
from flatshard.cli.pipeline_step import pipeline_gradients
from flatshard.cli.progress import Progress, read_metrics
from flatshard.cli.run_checkpoints import RunCheckpoints
from flatshard.cli.run_data import open_run_data
from flatshard.cli.run_header import run_header
from flatshard.cli.run_model import build_run_model
from flatshard.cli.saved_model import check_hf_vocab
from flatshard.cli.schedule import learning_rate
from flatshard.cli.step_record import seed_random_draws, step_record
from flatshard.cli.stop import StopRequest
from flatshard.cli.weight_push import WeightPush
from flatshard.data.sequences import IGNORE, sequence_order
from flatshard.models.moe import update_score_bias_from_counts
from flatshard.models.registry import training_loss
from flatshard.runtime.offload import offloaded_bytes


def train_worker(values: dict, run_dir: str, resume_step: int | None) -> int:
    """Entry point on every rank. `run_dir` may still hold `{time}` (rank 0 fills it in);
    `resume_step`: the step of the run's checkpoint to continue from (None: a new run).
    Returns the exit status: 0, or EXIT_STOPPED when a signal stopped the run."""
    stop = StopRequest().install()
    config = RunConfig(values)
    restart = elastic.attempt()
    if restart:  # the elastic agent restarted every rank after a failure: wait, then resume
        time.sleep(min(60.0, config.run.restart_backoff * 2 ** (restart - 1)))
    ranks = init_distributed(config.run.device, config.run.threads)
    check(config, ranks.world_size)
    config = with_microbatches(config, ranks.world_size)
    run_dir = _agree_run_dir(run_dir, ranks)
    if restart:
        resume_step = _restart_step(run_dir, restart, ranks)
    attempts.begin(run_dir, restart, ranks.rank)
    try:
        code = Trainer(config, ranks, run_dir, resume_step, stop).run()
    except BaseException as error:
        attempts.end(run_dir, restart, ranks.rank, 1, f"{type(error).__name__}: {error}"[:600])
        raise
    attempts.end(run_dir, restart, ranks.rank, code)
    return code


def _restart_step(run_dir: str, restart: int, ranks: Ranks) -> int | None:
    """The newest complete checkpoint's step (None: none yet, start over), after rank 0 has
    said what failed and which logged steps are lost: the disk's, or a newer snapshot in host
    memory where the hosts still up hold every file of it between them (see
    `checkpoint/host_memory.py`: a lost host's part is on its ring neighbour)."""
    disk = runs.newest_step(runs.checkpoint_root(run_dir))
    memory = host_memory.recoverable_step(runs.memory_root(run_dir), checkpoint_group())
    step = max((s for s in (disk, memory) if s is not None), default=None)
    if ranks.is_main:
        records, _ = read_metrics(os.path.join(run_dir, runs.METRICS))
        last = max((r["step"] for r in records if "step" in r), default=0)
        source = "disk" if step is not None and step == disk else "host memory"
        print(attempts.note_restart(run_dir, restart, step, last, ranks.world_size, source),
              flush=True)  # fmt: skip
    dist.barrier()  # the metrics are read before any rank's progress rewrites them
    return step


def on_main_first(ranks: Ranks, make):
    """`make()` on the main rank, then on the others (which find what it cached)."""
    if ranks.is_main:
        made = make()
    dist.barrier()
    return made if ranks.is_main else make()


def _agree_run_dir(template: str, ranks: Ranks) -> str:
    chosen = [runs.attempt_run_dir(template) if ranks.is_main else None]
    dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


class Trainer:
    def __init__(self, config: RunConfig, ranks: Ranks, run_dir: str, resume_step, stop):
        self.config, self.ranks, self.run_dir, self.stop = config, ranks, run_dir, stop
        train, data = config.train, config.data
        # rank 0 tokenises text (once, into a cached token file) while the others wait
        self.run_data = on_main_first(ranks, lambda: open_run_data(config))
        self.data = self.run_data.train
        self.order = sequence_order(self.data, data.seq_len, train.seed, data.pack)
        self.evaluation = None
        if self.run_data.eval is not None:
            held_out = sequence_order(self.run_data.eval, data.seq_len, train.seed, data.pack)
            self.evaluation = Evaluation(held_out, train.eval_sequences)
        if config.model.hf:  # a Hugging Face model: its config.json says what it is
            check_hf_vocab(config.model.hf, self.data.vocab_size)
            self.model_config = None
        else:
            self.model_config = llama_config(config, self.data.vocab_size)
        # the TP ranks of a group share a batch
        self.dims = parallel_dims(config, ranks.world_size)
        self.dp_world = self.dims.dp
        self.dp_rank = self.dims.build(ranks.device.type).dp_rank
        self.accumulation = train.global_batch // (train.micro_batch * self.dp_world)
        warm_up_runtime(ranks.device)
        self.memory = MemoryMeter(ranks.device)  # from here on: what `flatshard plan` counts
        comm.traffic.take()  # count from here
        # on resume the checkpoint fills the model: no need to read the HF files
        built = build_run_model(
            config, self.model_config, self.dims, ranks.device, resume_step is None
        )
        # pipeline stages (train.pp): this rank's, under the whole model's names
        self.pipe = built if isinstance(built, flatshard.Pipeline) else None
        self.model = built.model if self.pipe is not None else built
        # a Hugging Face model comes in eval mode (as from transformers' from_pretrained):
        # training mode, as transformers' Trainer sets it, runs its dropout, LoRA's dropout
        # and MoE routers' jitter and counting (evaluation switches and restores it)
        self.model.train()
        seed_random_draws(train.seed, self.dims, ranks.device)
        self.optimizer = make_optimizer(train, self.model)
        # what checkpoints keep besides the weights, for sampling and a complete export
        records = checkpoint_records(self.data, config.model.hf)
        self.saves = RunCheckpoints(run_dir, config, self.model, self.optimizer, records)
        if config.checkpoint.memory_interval:
            self.saves.drop_newer_snapshots(resume_step)
        self.step, self.position, self.resumed = 0, 0, None
        if resume_step is not None:
            self.resumed = self.saves.resume(resume_step, ranks)
            self.step, self.position = self.resumed.step, self.resumed.position
        if ranks.is_main:
            runs.write_config(run_dir, config)
            print(run_header(self), flush=True)
        self.progress = None
        self.push = WeightPush(config) if config.sync.address else None

    # --- the loop ------------------------------------------------------------------------------
    def run(self) -> int:
        """Train to the end (0), or until a signal: then save and return EXIT_STOPPED."""
        if self.ranks.is_main:
            self.progress = Progress.of_run(self.config, self.run_dir, self.step)
        try:
            reason = self._loop()
        finally:
            if self.progress is not None:
                self.progress.close()
            self.stop.restore()
        self._finish(reason)
        return EXIT_STOPPED if reason.startswith("interrupted") else 0

    def _loop(self) -> str:
        config, run = self.config, self.config.run
        started = time.perf_counter()
        while self.step < config.train.steps:
            record = self._train_step(started)
            if self.push is not None and self.push.due(self.step):
                record.update(self.push.push(self.model, self.step))
            if self.evaluation is not None and self.evaluation.due(self.step, config.train):
                rows = config.train.micro_batch * (self.pipe.microbatches if self.pipe else 1)
                record.update(self.evaluation.run(
                    self.model, rows, self.dp_rank, self.dp_world, self.ranks.device,
                    self.dims.cp, self.pipe,
                ))  # fmt: skip
            if self.progress is not None:
                self.progress.step(record)
            if record["stop"]:
                return f"interrupted by {self.stop.signal_name or 'a signal on another rank'}"
            if self.step == run.stop_at_step:
                return f"stopped at step {self.step} (run.stop_at_step)"
            saving = config.checkpoint
            last = self.step == config.train.steps  # the final save comes at the end
            if saving.interval and self.step % saving.interval == 0 and not last:
                self.saves.save(self.step, self.position, saving.async_save)
            if saving.memory_interval and self.step % saving.memory_interval == 0 and not last:
                self.saves.snapshot(self.step, self.position)
        return "done"

    def _train_step(self, started: float) -> dict:
        config, ranks = self.config, self.ranks
        train = config.train
        lr = learning_rate(
            self.step, peak=train.lr, minimum=train.min_lr, warmup=train.warmup_steps,
            total=train.steps,
        )  # fmt: skip
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        step_started = time.perf_counter()
        if self.pipe is not None:
            loss_sum, labelled = pipeline_gradients(
                self.pipe, self.order, self.position, train, self.dp_rank, self.dp_world,
                ranks.device,
            )  # fmt: skip
        else:
            loss_sum, labelled = accumulate_gradients(
                self.model, self.order, self.position, train, self.dp_rank, self.dp_world,
                ranks.device, self.dims.cp,
            )  # fmt: skip
        stages = None if self.pipe is None else self.pipe.meshes.pp.get_group()
        grad_norm = _clip(self.model, train.grad_clip, stages)
        shared = share_step(loss_sum, self.stop, self.memory.peak(), self.ranks.world_size)
        shared["grad_norm"] = grad_norm
        loss = shared["loss"]
        if not (math.isfinite(loss) and math.isfinite(shared["grad_norm"])):
            self._non_finite(loss, shared["grad_norm"], lr)
        self.optimizer.step()
        if config.model.bias_update_speed:  # the routers' step counts, summed over the
            # ranks that routed other tokens through them (this stage's dp and cp ranks)
            meshes = self.dims.build(ranks.device.type)
            groups = [mesh.get_group() for mesh in (meshes.dp, meshes.cp) if mesh is not None]
            update_score_bias_from_counts(self.model, config.model.bias_update_speed, groups)
        offloads = train.offload or train.offload_dir  # (a walk over the optimizer state)
        host_bytes, disk_bytes = offloaded_bytes(self.model, self.optimizer) if offloads else (0, 0)
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.position += train.global_batch
        elapsed = time.perf_counter() - step_started
        return step_record(self, shared, lr, labelled, elapsed, time.perf_counter() - started,
                           (host_bytes, disk_bytes))  # fmt: skip

    def _non_finite(self, loss: float, grad_norm: float, lr: float) -> None:
        latest = self.saves.latest()  # every rank gets here: the decision was shared
        kept = f"the last good checkpoint is {latest}" if latest else "no checkpoint was saved"
        what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
        raise TrainingStopped(
            f"step {self.step + 1}: the {what} (lr {lr:.3g}); stopped without applying or "
            f"saving it; {kept}. Lower train.lr, raise train.warmup_steps or set train.grad_clip"
        )

    # --- the end --------------------------------------------------------------------------------
    def _finish(self, reason: str) -> None:
        config = self.config
        if self.push is not None:
            self.push.finish(self.model, self.step)
        if config.checkpoint.memory_interval:
            self.saves.forget_snapshots()
        if reason != "done" or config.checkpoint.at_end:
            self.saves.save(self.step, self.position)
        latest = self.saves.latest()
        say = print if self.ranks.is_main else (lambda *a, **k: None)
        if reason != "done":
            say(f"{reason}; saved {latest}. Continue with: flatshard train --resume {self.run_dir}")
            if reason.startswith("interrupted"):
                say(f"exit status {EXIT_STOPPED}: stopped by a signal, resumable", flush=True)
            return
        saved = f"checkpoint: {latest}" if latest else "no checkpoint (checkpoint.at_end = false)"
        if self.resumed is not None and self.step == self.resumed.step:
            say(
                f"nothing to train: the run is at step {self.step} of train.steps "
                f"{config.train.steps}; raise it to go on (--steps {2 * self.step})"
            )
        say(f"finished {self.step} steps; {saved}", flush=True)
        if config.run.sample_tokens and self.pipe is not None:
            say("no sample: generation runs on a whole model, not pipeline stages (export the "
                "checkpoint and `flatshard sample` it)", flush=True)
        elif config.run.sample_tokens:
            max_seq_len = self.model_config.max_seq_len if self.model_config else None
            chat = self.data.starts is not None  # conversations: answer a user's turn
            sample_at_end(self.model, self.data.model_tokenizer, config, max_seq_len, self.ranks,
                          self.run_dir, chat=chat)  # fmt: skip


def accumulate_gradients(model, order, position: int, train, dp_rank: int, dp_world: int,
                         device, cp: int = 1) -> tuple[torch.Tensor, int | None]:  # fmt: skip
    """Forward and backward of this rank's micro-batches of the step whose global batch
    starts at `position`: (the summed loss, how many targets carry loss: None when all
    do). With chat data every labelled token of the step weighs alike: each micro-batch's
    summed loss is divided by this rank's share of the step's labelled tokens (gradients
    average over the data-parallel ranks, and the `cp` context-parallel ranks that split
    each sequence's tokens)."""
    accumulation = train.global_batch // (train.micro_batch * dp_world)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    step_labels = order.labels(position, train.global_batch)  # every rank's micro-batches
    labelled = None if step_labels is None else int((step_labels != IGNORE).sum())
    for micro in range(accumulation):
        if accumulation > 1 and train.zero_stage == 1:
            # ZeRO-1 keeps unsharded gradients anyway: reduce once, after the last one
            model.set_requires_gradient_sync(micro == accumulation - 1)
        first = position + micro * train.micro_batch * dp_world + dp_rank * train.micro_batch
        batch = order.batch(first, train.micro_batch).to(device)
        positions = order.positions(first, train.micro_batch)  # packed conversations
        positions = None if positions is None else positions.to(device)
        # the model family's loss: an MoE adds its load-balancing loss over every rank
        if labelled is None:
            loss = training_loss(model, batch, position_ids=positions) / accumulation
        else:
            mine = first - position
            labels = step_labels[mine : mine + train.micro_batch].to(device)
            share = max(labelled, 1) / (dp_world * cp)
            # divided as the plain path's: an MoE's load-balancing term, which is per
            # micro-batch, then weighs 1/accumulation there too (the tokens' sum weighs 1/share)
            loss = training_loss(model, batch, labels=labels, divisor=share / accumulation,
                                 position_ids=positions) / accumulation  # fmt: skip
        loss.backward()
        loss_sum += loss.detach().double()
    return loss_sum, labelled


def make_optimizer(train, model) -> torch.optim.Optimizer:
    """`train.optimizer`: flatshard.optim's AdamW (adamw-fused: on torch's fused kernel), SGD
    or Muon (torch's math over flat shards, the same state dict), or torch.optim.AdamW. Muon
    takes the hidden matrices with Moonlight's learning-rate match, so train.lr and
    train.weight_decay serve both parts."""
    if train.optimizer == "muon":
        muon, rest = flatshard.optim.muon_param_groups(model)
        groups = [{**muon, "weight_decay": train.weight_decay}]
        groups += [{**group, "use_muon": False} for group in _decay_groups(rest["params"], train)]
        return flatshard.optim.Muon(groups, lr=train.lr, adjust_lr_fn="match_rms_adamw",
                                    adamw_betas=(train.beta1, train.beta2),
                                    split_fused=train.muon_split_fused)  # fmt: skip
    groups = _decay_groups(model.parameters(), train)
    if train.optimizer == "sgd":
        return flatshard.optim.SGD(groups, lr=train.lr, momentum=train.momentum)
    make = torch.optim.AdamW if train.optimizer == "torch-adamw" else flatshard.optim.AdamW
    # fused only when asked: an explicit fused=False keeps torch from its foreach default
    fused = {"fused": True} if train.optimizer == "adamw-fused" else {}
    return make(groups, lr=train.lr, betas=(train.beta1, train.beta2), **fused)


def _decay_groups(params, train) -> list[dict]:
    """Weight decay on matrices (and embeddings), none on norm weights."""
    decay, no_decay = [], []
    for param in (p for p in params if p.requires_grad):  # LoRA: the adapters only
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def _clip(model, max_norm: float, stages=None) -> float:
    """The global gradient norm (before clipping); clips when max_norm > 0. `stages`: the
    pipeline's group (the norm over every stage)."""
    # flatshard's: expert-parallel experts and dense parameters live on different meshes
    return float(flatshard.clip_grad_norm_(model.parameters(), max_norm or float("inf"),
                                           pp_group=stages))  # fmt: skip
