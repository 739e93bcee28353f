"""`flatshard receive`: hold the Hugging Face model a run fine-tunes and take its weights as
it trains (`flatshard train --sync-to HOST:PORT`): each update is applied whole (a line says
its step, bytes and time), and when the run ends the model is saved for transformers."""

from __future__ import annotations

import flatshard
from flatshard.cli.errors import RunError


def receive(args) -> int:
    try:
        import transformers
    except ImportError:
        raise RunError("flatshard receive holds a transformers model: pip install "
                       "transformers") from None  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(args.hf, dtype="float32")
    group = flatshard.weight_sync_group(
        args.address, trainers=args.trainers, receivers=args.receivers, receiver=args.index,
    )  # fmt: skip
    print(f"flatshard receive: {type(model).__name__} from {args.hf}, waiting on "
          f"{args.address}", flush=True)  # fmt: skip
    updates = 0
    while (stats := flatshard.receive_weights(group, model)) is not None:
        updates += 1
        print(f"step {stats.version}: {stats.tensors_applied} tensors, "
              f"{stats.bytes / 2**20:.1f} MiB in {stats.seconds:.2f} s", flush=True)  # fmt: skip
    if args.out:
        model.save_pretrained(args.out)
    saved = f"; saved to {args.out}" if args.out else ""
    print(f"flatshard receive: the run ended after {updates} update(s){saved}", flush=True)
    return 0
