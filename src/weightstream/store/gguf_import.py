"""The GGUF importer's former single module, kept importable: the code is the `weightstream.store.gguf` package
(reader, one module per architecture family, config, plan, importer, tokenizer)."""

from weightstream.store.gguf import (  # noqa: F401
    DIRECT,
    FAMILIES,
    REQUANTIZE,
    SUPPORTED,
    GgufFile,
    GgufTensor,
    ImportResult,
    gguf_config,
    gguf_parts,
    import_gguf,
    open_gguf,
)
from weightstream.store.gguf import gguf_tokenizer as _tokenizer  # noqa: F401
from weightstream.store.gguf import plan as _plan  # noqa: F401
