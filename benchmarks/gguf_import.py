"""`weightstream import` of GGUF files from llama.cpp's own converter and `llama-quantize`, checked against a
reference on the same files in the same run.

    quality    held-out perplexity and greedy tokens of the imported small MoEs (qwen3_moe; --arch deepseek_v3,
               gpt_oss), against `llama-perplexity` and llama-server's greedy tokens on the same file and token ids
    families   every MoE family that needs streaming (DeepSeek-V2/V3, GLM-4.5, gpt-oss) at Q8_0, Q4_K_M, Q3_K_M,
               Q2_K (gpt-oss also MXFP4_MOE): blocks kept, streamed equal to resident, logits against transformers'
               own model of the dequantized weights

    .venv/bin/python benchmarks/gguf_import.py quality --arch deepseek_v3 --types Q8_0,Q4_K_M,Q2_K
    .venv/bin/python benchmarks/gguf_import.py families --work .work/gguf-families

Both need llama.cpp built (`llamacpp.py build`); `quality` the model `quant_bench.py quality [--arch ARCH]` trained.
Each writes its JSON to --out (quality also prints it). The subcommands run parts/gguf_quality.py and
parts/gguf_families.py; `gguf_import.py PART --help`.
"""

from __future__ import annotations

from common import Part, entry

PARTS = {
    "quality": Part("gguf_quality", "perplexity and greedy tokens of the import, against llama.cpp on the same file"),
    "families": Part("gguf_families", "each MoE family's import, against transformers on the dequantized weights"),
}

if __name__ == "__main__":
    entry("gguf_import.py", __doc__, PARTS)
