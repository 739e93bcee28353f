"""The data of a run: its tokenizer (`data.tokenizer`), the training tokens, the held-out
evaluation tokens (`data.eval`), and the refusal of tokens that cannot be the model's.

A `--hf` model reads text through its own tokenizer; a token file flatshard wrote records
the tokenizer that made it, and one made by another tokenizer (bytes included) is refused
rather than trained on: ids of one tokenizer fit another's vocabulary silently.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from flatshard.cli.errors import DataError
from flatshard.cli.options import eval_fraction
from flatshard.data.tokenizer import BYTES, load_tokenizer
from flatshard.data.tokens import TokenData, load_tokens


@dataclass
class RunData:
    train: TokenData
    eval: TokenData | None  # None: no evaluation
    tokenizer: object  # ByteTokenizer or ModelTokenizer


def open_run_data(config) -> RunData:
    """The tokenizer and data `config` names, checked to be the model's (call on one rank
    first where text is tokenised: the others then map the cached token file)."""
    data = config.data
    tokenizer = load_tokenizer(data.tokenizer, config.model.hf)
    read = lambda path: load_tokens(path, data.format, data.text_field, data.glob, tokenizer)
    train = read(data.path)
    _check_same_tokenizer(train, tokenizer, "data.path", data.path)
    held_out = None
    fraction = eval_fraction(data.eval) if data.eval else None
    if fraction is not None:
        train, held_out = split_off(train, fraction, data.seq_len, data.eval)
    elif data.eval:
        held_out = read(data.eval)
        _check_same_tokenizer(held_out, tokenizer, "data.eval", data.eval)
    if held_out is not None and held_out.starts is None and len(held_out.tokens) <= data.seq_len:
        raise DataError(
            f"data.eval: {len(held_out.tokens)} tokens are too few for one sequence of "
            f"data.seq_len={data.seq_len} (+1 target)"
        )
    return RunData(train, held_out, tokenizer)


def split_off(data: TokenData, fraction: float, seq_len: int, given: str):
    """(training part, held-out part): the last `fraction` of the sequences (whole windows
    of text; whole records of chat data)."""
    if data.starts is not None:  # chat data: records
        count = len(data.starts)
        held = max(1, round(count * fraction))
        if held >= count:
            raise DataError(
                f"data.eval={given} holds out {held} of the data's {count} conversations, "
                "leaving none to train on; use a smaller fraction or more data"
            )
        cut = int(data.starts[count - held])
        head = replace(data, tokens=data.tokens[:cut], loss_mask=data.loss_mask[:cut],
                       starts=data.starts[: count - held])  # fmt: skip
        tail = replace(data, tokens=data.tokens[cut:], loss_mask=data.loss_mask[cut:],
                       starts=np.asarray(data.starts[count - held :]) - cut)  # fmt: skip
        return head, replace(tail, source=f"the last {held} conversations of the data")
    windows = (len(data.tokens) - 1) // seq_len
    held = max(1, round(windows * fraction))
    if held >= windows:
        raise DataError(
            f"data.eval={given} holds out {held} of the data's {windows} sequences of "
            f"{seq_len}, leaving none to train on; use a smaller fraction or more data"
        )
    cut = (windows - held) * seq_len  # the last `held` windows, whole
    mask = data.loss_mask
    head = replace(data, tokens=data.tokens[: cut + 1],
                   loss_mask=None if mask is None else mask[: cut + 1])  # fmt: skip
    tail = replace(data, tokens=data.tokens[cut:], loss_mask=None if mask is None else mask[cut:],
                   source=f"the last {fraction:.0%} of the data ({held} sequences)")  # fmt: skip
    return head, tail


def _check_same_tokenizer(data: TokenData, tokenizer, key: str, path: str) -> None:
    """Token files flatshard wrote say which tokenizer made them: it must be the run's."""
    if data.tokenizer in ("none", tokenizer.name):
        if data.tokenizer == tokenizer.name:
            data.model_tokenizer = tokenizer
        return
    made_by = "bytes (flatshard's byte tokenizer)" if data.tokenizer == BYTES else data.tokenizer
    raise DataError(
        f"{key} {path!r} holds token ids made by {made_by}, but this run tokenises with "
        f"{tokenizer.name}: those ids would mean other tokens to the model. Pass the text "
        f"itself as {key} (it is tokenised with the run's tokenizer), or set data.tokenizer "
        "to the tokenizer that made the file"
    )
