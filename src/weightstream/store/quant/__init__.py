"""Quantized experts: the codes, the format that holds them, and the pipeline that writes them.

- torch_codes: round-to-nearest int8 and int4 of expert weights, and the int4 layouts torch's CPU kernel takes;
- ggml_blocks: round-to-nearest encoders for GGML's block formats, the ones the native kernels run;
- manifest: the quantized-experts format (one packed blob per expert, and the manifest that lists it);
- plan: what a blob holds for experts of given shapes, which dense linears are quantized, one expert into its blob;
- options: `QuantizeOptions`, what `weightstream quantize` is asked to do, checked before any file is opened;
- pipeline: `weightstream quantize`, a checkpoint's experts (and with `--dense` its dense linears) rewritten.

Each imports only those above it in this list (and store/ modules outside quant/); nothing here opens the
engine.
"""
