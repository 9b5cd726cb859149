"""`weightstream import`: a GGUF file (llama.cpp's format) as a model directory every command takes.

Routed experts keep their GGML blocks byte for byte when they are a type weightstream's native kernels run
(`weightstream.native.BLOCK_TYPES`; docs/kernels.md): one blob per expert in the quantized-experts format
(store/quant/manifest.py), gate rows then up rows (gpt-oss: alternating, as its model's gate takes them), then
down, and gpt-oss's expert biases after their projection; a layer whose types differ from the others' (Q4_K_M
stores some down projections as Q6_K) gets its own table in the manifest. Other block types are dequantized and
requantized to Q8_0 or Q4_K, the error measured and said; experts stored as floats make a plain checkpoint (or,
where the architecture's checkpoint stores a layer's experts fused, gpt-oss's, BF16 rows in blobs).
Dense linear weights (attention, output head, shared experts, dense MLPs) of those same types keep their blocks
byte for byte too, listed in the manifest's dense table as `quantize --dense` writes them, and load as
NativeLinear. The other dense weights (token embedding, router, norms, and linear weights of other types, or of
any type when the experts are floats) are stored unquantized in the activation dtype, dequantized where the file
quantized them, the loss said. config.json comes from the file's metadata (our own mapping: the one in
transformers lacks fields these architectures need), the tokenizer from transformers' GGUF tokenizer support.

The package, by job:
- reader.py: open_gguf (a file or every part of a split one, the header checked), positioned reads, decoding;
- families/: one module per GGUF architecture, its config map and tensor-name quirks (llama's q/k permutation,
  DeepSeek's kv_b split into k_b/v_b, GLM's next-token-prediction layers, gpt-oss's split gate/up and sinks);
- config.py: gguf_config, the fields every family shares, then the family's;
- planner.py: the meta model, every dense tensor's source(s), every MoE layer's expert tensors and stored types;
- importer.py: import_gguf, which writes the plan (one dense tensor or one expert at a time, read with pread,
  never through the reader's memory map), built beside `--out` and renamed into place when complete;
- tokenizer.py: the file's tokenizer through transformers.
docs/gguf.md has the rules and the measurements.
"""

from weightstream.store.gguf.config import family_of, gguf_config
from weightstream.store.gguf.families import FAMILIES, SUPPORTED
from weightstream.store.gguf.importer import REQUANTIZE, ImportResult, import_gguf
from weightstream.store.gguf.planner import DIRECT, Plan, plan
from weightstream.store.gguf.reader import GgufFile, GgufTensor, gguf_parts, open_gguf
from weightstream.store.gguf.tokenizer import gguf_tokenizer

__all__ = [
    "DIRECT",
    "FAMILIES",
    "REQUANTIZE",
    "SUPPORTED",
    "GgufFile",
    "GgufTensor",
    "ImportResult",
    "Plan",
    "family_of",
    "gguf_config",
    "gguf_parts",
    "gguf_tokenizer",
    "import_gguf",
    "open_gguf",
    "plan",
]
