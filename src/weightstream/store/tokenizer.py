"""A byte-level BPE tokenizer trained locally on a built-in text, so synthetic checkpoints need no download; with a
minimal chat template, so `weightstream serve` answers chat completions on them."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# ChatML's shape with the special tokens the tokenizer already has (<|bos|> opens a turn as <|im_start|> would,
# <|eos|> closes it as <|im_end|> would, and is the model's EOS, so an answer ends with its turn). New special
# tokens would take places the BPE's merges hold now, changing how every synthetic checkpoint tokenizes text.
CHAT_TEMPLATE = (
    "{% for message in messages %}" + BOS + "{{ message['role'] }}\n{{ message['content'] }}" + EOS + "\n"
    "{% endfor %}{% if add_generation_prompt %}" + BOS + "assistant\n{% endif %}"
)

CORPUS = """\
Mixture-of-Experts models route every token to a few experts out of many. Only the chosen experts run, so a
model with billions of parameters computes like a much smaller one, but all of its weights must still be
somewhere: in memory when there is room, on a solid state drive when there is not. Streaming experts from a
drive means deciding what to read, when to read it, and what to keep. A cache that holds the experts used
recently saves reads when the same experts come back, and they often do: tokens of the same sentence, the same
language or the same program tend to prefer the same experts. The page cache of the kernel does not know which
expert comes next; the inference engine does. Reading the gate projection first lets computation start
sooner. Reading with several threads keeps the drive busy. Counting hits and misses tells how large the cache
should be. The quick brown fox jumps over the lazy dog. Once upon a time there was a small computer with a
large model and a fast disk. def add(a, b): return a + b. for i in range(10): print(i * i). What is the
capital of France? Paris is the capital of France. The answer is 42. Hello, world! 1 2 3 4 5 6 7 8 9 10.
"""


def build_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on CORPUS with at most `vocab_size` tokens (special tokens included); its chat template
    is CHAT_TEMPLATE."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=min(vocab_size, 4096),
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
