"""Checkpoints on disk: what is where, read from the files themselves, and writing new ones.

Reading:
- safetensors_index: safetensors headers parsed (file, offset, length, dtype, shape per tensor), malformed refused;
- checkpoint: a model directory (config.json, shards, index) indexed tensor by tensor, and positioned reads of it;
- dtypes: the one table of tensor dtypes (safetensors' names, torch's names, torch dtypes);
- facts: what a model's config says that several layers need (experts per token, tied head, light dense weights);
- layout: each expert's byte ranges in the model's own layout, from transformers' conversion mapping;
- model: the model a checkpoint describes, on the meta device, with every expert's byte ranges mapped;
- model_dir: the model a command names (a local directory or a Hugging Face id), refused before torch loads;
- published: FP8 and MXFP4 checkpoints as they are published, read tensor by tensor and run through a converted copy;
Writing:
- safetensors_writer: .safetensors files written tensor by tensor with aligned data, and sharded checkpoints;
- outdir: output directories that appear only when complete, and what `--force` may replace;
- quant/: quantized experts (its own docstring maps it): the codes (torch's int8/int4, GGML's blocks), the
  manifest, the plan of a blob, the checked options and the `weightstream quantize` pipeline;
- convert: a published FP8 / MXFP4 checkpoint converted once, beside it, as an explicit step;
- gguf/: `weightstream import`, a GGUF file as a model directory (its own docstring maps it);
- gguf_import: the gguf/ package under the importer's older single-module name;
- synth: random-weight checkpoints of real shapes, in the architecture's on-disk form;
- presets: tiny and real model configs;
- tokenizer: the local tokenizer synthetic checkpoints ship with.
"""
