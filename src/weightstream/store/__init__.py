"""Checkpoints on disk: what is where, read from the files themselves, and writing new ones.

safetensors_index: parses headers (file, offset, length, dtype, shape per tensor), refusing malformed files;
checkpoint: a model directory (config.json, shards, index) indexed tensor by tensor; layout: each expert's byte
ranges in the model's own layout, from transformers' conversion mapping; safetensors_writer: writes files tensor
by tensor with aligned data; synth: random-weight checkpoints of real shapes; presets: tiny and real model
configs; tokenizer: the local tokenizer synthetic checkpoints ship with.
"""
