"""Every key of the run configuration: its default, its meaning, its allowed values and
check, and the model size presets (config.py reads and validates values against them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    key: str  # "section.name"
    default: object
    help: str
    choices: tuple = ()
    check: Callable[[object], str | None] | None = None  # returns what is wrong, or None

    @property
    def kind(self) -> type:
        return type(self.default)


def _positive(value) -> str | None:
    return None if value > 0 else "must be > 0"


def _non_negative(value) -> str | None:
    return None if value >= 0 else "must be >= 0"


def _fraction(value) -> str | None:
    return None if 0 <= value < 1 else "must be in [0, 1)"


def _unit_interval(value) -> str | None:
    return None if 0 <= value <= 1 else "must be in [0, 1]"


def eval_fraction(value: str) -> float | None:
    """data.eval as a fraction of the training data's sequences, or None (a path or '')."""
    try:
        fraction = float(value)
    except ValueError:
        return None
    return fraction


def _eval_source(value) -> str | None:
    fraction = eval_fraction(value)
    if fraction is not None and not 0 < fraction < 1:
        return "as a fraction of the data must be in (0, 1)"
    return None


OPTIONS: tuple[Option, ...] = (
    # model: the reference Llama (flatshard.models.Llama)
    Option("model.preset", "small", "model size preset; fills the sizes not set",
           choices=("tiny", "small", "medium", "moe-tiny")),
    Option("model.vocab_size", 0, "0: the tokenizer's (257 for bytes) or max token id + 1",
           check=_non_negative),
    Option("model.dim", 384, "hidden size", check=_positive),
    Option("model.n_layers", 6, "transformer blocks", check=_positive),
    Option("model.n_heads", 6, "attention heads", check=_positive),
    Option("model.n_kv_heads", 0, "key/value heads (0: n_heads)", check=_non_negative),
    Option("model.ffn_dim", 1024, "SwiGLU hidden size", check=_positive),
    Option("model.max_seq_len", 0, "longest sequence (0: data.seq_len)", check=_non_negative),
    Option("model.rope_theta", 10000.0, "RoPE base", check=_positive),
    Option("model.norm_eps", 1e-5, "RMSNorm epsilon", check=_positive),
    Option("model.tie_embeddings", False, "share the embedding with the output layer"),
    # mixture of experts (flatshard.models.MoE) when n_experts > 0
    Option("model.n_experts", 0, "routed experts per MoE layer (0: dense, the Llama)",
           check=_non_negative),
    Option("model.top_k", 2, "MoE: experts each token is routed to", check=_positive),
    Option("model.expert_ffn_dim", 0, "MoE: each expert's SwiGLU hidden size (0: ffn_dim)",
           check=_non_negative),
    Option("model.norm_topk_prob", True, "MoE: renormalise the top-k routing weights to one"),
    Option("model.aux_loss_coef", 0.001, "MoE: weight of the load-balancing loss in the loss",
           check=_non_negative),
    Option("model.bias_update_speed", 0.0, "MoE: DeepSeek-V3's auxiliary-loss-free balancing: "
           "each router's correction bias moves this much a step toward its less-loaded "
           "experts (0: off; DeepSeek-V3 trained with 0.001)", check=_non_negative),
    Option("model.hf", "", "Hugging Face model directory to fine-tune instead (config.json + "
           "safetensors; the other model.* keys but bias_update_speed are then unused)"),
    # data
    Option("data.path", "", "text file or directory, JSONL, or token memmap ('': bundled corpus)"),
    Option("data.format", "auto", "how to read data.path",
           choices=("auto", "text", "jsonl", "uint16", "uint32")),
    Option("data.text_field", "text", "JSONL field holding each document's text"),
    Option("data.glob", "**/*.txt", "files to read when data.path is a directory"),
    Option("data.seq_len", 256, "tokens per training sequence", check=_positive),
    Option("data.tokenizer", "auto", "how text becomes tokens: auto (a --hf model's own "
           "tokenizer, bytes for the reference model), bytes, or a directory with a Hugging "
           "Face tokenizer (tokenizer.json)"),
    Option("data.pack", False, "chat data: pack conversations into windows of data.seq_len "
           "instead of one padded conversation per sequence (each still attends only to "
           "itself: positions restart per conversation)"),
    Option("data.eval", "", "held-out data for evaluation: a file or directory read as "
           "data.path is, or a fraction of data.path's sequences (e.g. 0.05); '': none",
           check=_eval_source),
    # train
    Option("train.steps", 150, "optimizer steps (the schedule's length)", check=_positive),
    Option("train.micro_batch", 4, "sequences per process per forward pass", check=_positive),
    Option("train.global_batch", 8, "sequences per optimizer step, all processes",
           check=_positive),
    Option("train.optimizer", "adamw", "adamw, sgd or muon: flatshard.optim's (torch's math, "
           "stepped over flat shards; muon: the hidden matrices, AdamW the rest); "
           "adamw-fused: the flat AdamW on torch's fused kernel (torch's AdamW(fused=True) "
           "bit for bit, faster); torch-adamw: torch.optim.AdamW",
           choices=("adamw", "adamw-fused", "sgd", "muon", "torch-adamw")),
    Option("train.muon_split_fused", False, "muon: orthogonalise each component of a fused "
           "weight (SwiGLU's [gate; up]) as its own matrix"),
    Option("train.lr", 3e-3, "peak learning rate", check=_positive),
    Option("train.min_lr", 3e-4, "learning rate at the end of the cosine decay",
           check=_non_negative),
    Option("train.warmup_steps", 15, "linear warmup steps", check=_non_negative),
    Option("train.weight_decay", 0.1, "weight decay (matrices only)", check=_non_negative),
    Option("train.beta1", 0.9, "AdamW beta1", check=_fraction),
    Option("train.beta2", 0.95, "AdamW beta2", check=_fraction),
    Option("train.momentum", 0.9, "SGD momentum", check=_fraction),
    Option("train.grad_clip", 1.0, "clip the global gradient norm (0: off)", check=_non_negative),
    Option("train.zero_stage", 3, "ZeRO stage", choices=(1, 2, 3)),
    Option("train.hpz_group", 0, "ZeRO-3: after forward, stay sharded over groups of this "
           "many ranks so backward gathers inside them (hpZ; 0: all ranks)",
           check=_non_negative),
    Option("train.dp_replicate", 1, "HSDP: replicas of the sharded model (processes are "
           "dp_replicate x dp_shard x tp)", check=_positive),
    Option("train.tp", 1, "tensor parallelism: ranks each block's heads and hidden units "
           "are split over (innermost; processes are dp_replicate x dp_shard x tp)",
           check=_positive),
    Option("train.sp", False, "sequence parallelism: TP also splits the norms and the "
           "residual stream by sequence (activations there 1/tp; all-gathers and "
           "reduce-scatters in place of TP's all-reduces; needs train.tp > 1)"),
    Option("train.cp", 1, "context parallelism: ranks each sequence is split over (in "
           "load-balanced chunks; the parameters sharded over dp_shard x cp; processes are "
           "dp_replicate x dp_shard x cp x tp)", check=_positive),
    Option("train.pp", 1, "pipeline parallelism: stages the model's blocks are split into, "
           "a rank each (outermost; processes are pp x dp_replicate x dp_shard x tp); each "
           "step's micro-batches (global_batch / (micro_batch x data-parallel ranks)) flow "
           "through them", check=_positive),
    Option("train.pp_schedule", "1f1b", "pipeline schedule (torch's): gpipe, 1f1b, or with two "
           "stages per rank interleaved-1f1b, looped-bfs and the zero-bubble interleaved-zb, "
           "zbv, dualpipev",
           choices=("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv",
                    "dualpipev")),
    Option("train.microbatches", 0, "micro-batches per step per data-parallel rank (sets "
           "train.micro_batch to what it leaves; 0: global_batch / micro_batch / dp)",
           check=_non_negative),
    Option("train.ep", 1, "expert parallelism: ranks each MoE layer's experts are split "
           "over (borrowed from the data-parallel ranks; experts sharded over the rest)",
           check=_positive),
    Option("train.offload", 0.0, "share of each process's fp32 weights, gradients and "
           "optimizer state kept and stepped on the host (0-1)", check=_unit_interval),
    Option("train.offload_dir", "", "keep the offloaded optimizer state in memory-mapped "
           "files in this directory (the disk tier; alone it offloads everything)"),
    Option("train.precision", "fp32", "compute dtype; weights and optimizer stay fp32",
           choices=("fp32", "bf16")),
    Option("train.quantize_weights", "none", "all-gather the weights in 8 bits with a scale "
           "per 256 (ZeRO++'s qwZ); the fp32 weights and the step stay exact",
           choices=("none", "int8", "fp8")),
    Option("train.quantize_grads", "none", "reduce-scatter the gradients in 8 bits with a "
           "scale per 256, summed in fp32, with error feedback (ZeRO++'s qgZ)",
           choices=("none", "int8", "fp8")),
    Option("train.ac", "none", "activation memory per block: full or selective (per-op) "
           "activation checkpointing, or offload (saved activations on the host)",
           choices=("none", "full", "selective", "offload")),
    Option("train.compile", False, "torch.compile each block (inductor; flatshard's hooks "
           "stay outside the graphs)"),
    Option("train.lora_rank", 0, "LoRA: train adapters of this rank on the model's "
           "projections, every other weight frozen (model.hf runs; 0: off)",
           check=_non_negative),
    Option("train.lora_alpha", 0.0, "LoRA: the adapters' output is scaled by alpha / rank "
           "(0: twice the rank)", check=_non_negative),
    Option("train.lora_dropout", 0.0, "LoRA: dropout on the adapters' input", check=_fraction),
    Option("train.lora_targets", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
           "LoRA: the linear modules adapted, by the last part of their names (Llama and "
           "Qwen names by default)"),
    Option("train.qlora", False, "QLoRA: the frozen bases of the adapted projections in "
           "4-bit NormalFloat (torchao's NF4; needs train.lora_rank); every rank reads the "
           "whole base once to quantize it"),
    Option("train.eval_interval", 0, "evaluate on data.eval every N steps (0: only at the "
           "end)", check=_non_negative),
    Option("train.eval_sequences", 256, "sequences of data.eval each evaluation reads at "
           "most (0: all)", check=_non_negative),
    Option("train.seed", 0, "seed of the initial weights and the data order",
           check=_non_negative),
    # checkpoint
    Option("checkpoint.interval", 50, "save every N steps (0: only at the end)",
           check=_non_negative),
    Option("checkpoint.keep_last", 3, "checkpoints kept (0: all)", check=_non_negative),
    Option("checkpoint.async_save", False, "write periodic checkpoints in the background"),
    Option("checkpoint.staging_mib", 256, "host memory for copies while writing a checkpoint "
           "(waves of half of it)", check=_positive),
    Option("checkpoint.at_end", True, "save when training ends"),
    Option("checkpoint.memory_interval", 0, "every N steps also snapshot the run into host "
           "memory (/dev/shm, in the background; on several nodes each also keeps a copy of "
           "the previous node's): a restart after a failure resumes from the newest of it "
           "and the disk checkpoints (0: off)", check=_non_negative),
    # sync: stream the weights to processes outside the run (an inference engine's)
    Option("sync.address", "", "host:port of a weight-sync group (flatshard.sync_weights): "
           "after every sync.interval steps and at the end, push the weights to its "
           "receivers (`flatshard receive`); '': off"),
    Option("sync.interval", 1, "steps between weight syncs (0: only at the end)",
           check=_non_negative),
    Option("sync.receivers", 1, "receivers that join the weight-sync group", check=_positive),
    Option("sync.wire", "none", "weights on the wire: none (each tensor's own dtype), fp32, "
           "bf16, fp16 or fp8 (e4m3, a scale per row)",
           choices=("none", "fp32", "bf16", "fp16", "fp8")),
    Option("sync.delta", True, "send only the buckets a step wrote (frozen weights once)"),
    Option("sync.names", "hf", "hf: Hugging Face names and layout; model: the state dict's",
           choices=("hf", "model")),
    # run
    Option("run.out_dir", "runs/{time}", "run directory ({time}: the start time)"),
    Option("run.nproc", 2, "local processes when not launched by torchrun", check=_positive),
    Option("run.max_restarts", 0, "local runs: restart every process from the newest "
           "checkpoint after one fails, up to N times (torch's elastic agent; under torchrun "
           "use its --max-restarts)", check=_non_negative),
    Option("run.min_nproc", 0, "with run.max_restarts: once the restarts are spent, go on "
           "with fewer processes (the checkpoint resharded, the global batch kept by more "
           "accumulation), down to this many (0: never fewer)", check=_non_negative),
    Option("run.restart_backoff", 1.0, "seconds before the first restart, doubling with each "
           "(at most 60)", check=_non_negative),
    Option("run.device", "auto", "where to compute", choices=("auto", "cpu", "cuda")),
    Option("run.threads", 0, "CPU threads per process (0: cores / processes)",
           check=_non_negative),
    Option("run.log_interval", 10, "steps between log lines", check=_positive),
    Option("run.stop_at_step", 0, "stop with a checkpoint after this step (0: never)",
           check=_non_negative),
    Option("run.sample_tokens", 120, "tokens generated at the end (0: none)",
           check=_non_negative),
    Option("run.sample_prompt", "The ", "prompt of the sample at the end"),
    Option("run.tensorboard", True, "write TensorBoard events when it is installed"),
)  # fmt: skip

BY_KEY = {option.key: option for option in OPTIONS}

# What a fine-tune of a pretrained model (model.hf) starts from instead of the defaults above
# (those of pretraining from scratch): each applies unless set; warmup_steps and min_lr follow
# the steps and the lr given.
FINE_TUNE_LR = 2e-5
FINE_TUNE_LORA_LR = 2e-4  # adapters that start at zero take a larger step
FINE_TUNE_MIN_LR_SHARE = 0.1  # cosine to 10% of the peak
FINE_TUNE_WARMUP_SHARE = 0.03  # of train.steps, at least one step


def fine_tune_defaults(steps: int, lr: float | None, lora: bool = False) -> dict[str, object]:
    peak = (FINE_TUNE_LORA_LR if lora else FINE_TUNE_LR) if lr is None else lr
    return {
        "train.lr": peak,
        "train.min_lr": float(f"{peak * FINE_TUNE_MIN_LR_SHARE:.6g}"),
        "train.warmup_steps": max(1, round(steps * FINE_TUNE_WARMUP_SHARE)),
        "train.weight_decay": 0.0,
    }


SECTIONS = tuple(dict.fromkeys(key.split(".")[0] for key in BY_KEY))

PRESETS = {
    "tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172),  # ~0.1M params
    "small": dict(dim=384, n_layers=6, n_heads=6, n_kv_heads=0, ffn_dim=1024),  # ~10.8M
    "medium": dict(dim=512, n_layers=8, n_heads=8, n_kv_heads=0, ffn_dim=1376),  # ~25.6M
    # MoE layers (4 experts of ffn 64, top-2) in place of tiny's MLPs: ~0.16M parameters
    "moe-tiny": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, n_experts=4),
}
