"""Helpers (no tests): a tiny Hugging Face tokenizer built in the test (byte-level BPE trained
on a few lines, an end-of-text token, optionally a BOS that it adds itself, a ChatML chat
template), saved as transformers saves one, so the trainer meets the real file format."""

from __future__ import annotations

import os

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Python is a programming language; lists, dicts and tuples are its containers.",
    "A function is defined with def, and a class with class.",
    "What is the capital of France? Paris is the capital of France.",
]


def make_tokenizer_dir(path, *, vocab_size: int = 300, bos: bool = False, chat: bool = True):
    """Save a tiny tokenizer into `path` (created); returns the transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(TRAINING_TEXT, trainer)
    if bos:
        bos_id = tokenizer.token_to_id("<s>")
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos_id)]
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>",
        bos_token="<s>" if bos else None, pad_token="<|endoftext|>",
    )  # fmt: skip
    if chat:
        wrapped.chat_template = CHATML
    os.makedirs(path, exist_ok=True)
    wrapped.save_pretrained(path)
    return wrapped


def make_llama_dir(path, **sizes):
    """A tiny random transformers Llama with a tiny tokenizer of its own, saved in `path`
    (created): returns (the model, the tokenizer)."""
    import torch
    import transformers

    tokenizer = make_tokenizer_dir(path)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{
        "vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "eos_token_id": tokenizer.eos_token_id, **sizes,
    })  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).float()
    model.save_pretrained(path)
    return model, tokenizer
