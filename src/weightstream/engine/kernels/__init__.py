"""How experts and dense weights are computed.

- eager: the eager expert kernels (transformers' arithmetic op for op, bitwise) and the proof that picks them;
- quantized: experts from packed int8/int4 weights or GGML blocks, and where a product dequantizes instead;
- dense: a Linear on GGML blocks and an embedding kept in its stored dtype, put in the model's place at load;
- choice: the kernel an experts module gets on this machine, a quantized one checked before it is trusted.
"""
