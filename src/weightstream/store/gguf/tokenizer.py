"""The file's tokenizer, built by transformers' GGUF tokenizer support and saved as a plain tokenizer.json."""

from __future__ import annotations

import json

from weightstream.store.gguf.reader import GgufFile

_SPECIALS = ("bos_token", "eos_token", "unk_token", "pad_token")


def gguf_tokenizer(gf: GgufFile):
    """(the tokenizer, None), or (None, why not): the weights import without it."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    try:
        arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(gf.path)
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except Exception as exc:  # said on stderr: the weights import without it
        return None, f"transformers cannot build it from this file's metadata: {type(exc).__name__}: {exc}"
    # transformers' builders add their class's default special tokens (GPT-2's <|endoftext|>) past the end of a
    # vocabulary that lacks them: ids the embedding does not have. Drop what the file did not list.
    n = len(tokenizer_dict["tokens"])
    data = json.loads(backend.to_str())
    data["added_tokens"] = [a for a in data.get("added_tokens", []) if a["id"] < n]
    backend = Tokenizer.from_str(json.dumps(data))
    specials = {k: tokenizer_config[k] for k in _SPECIALS if tokenizer_config.get(k) is not None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
    if tokenizer_config.get("chat_template"):
        tokenizer.chat_template = tokenizer_config["chat_template"]
    return tokenizer, None
