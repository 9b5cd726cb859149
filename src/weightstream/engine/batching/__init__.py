"""Continuous batching: many sequences through one streaming model, one forward per decode step. No HTTP here:
`weightstream serve` (weightstream/serve/) puts OpenAI's API in front of it.

- sampling: per-request logit bias and penalties, greedy / temperature / top-p with its own generator;
- text: generated ids to text with stop strings;
- logprobs: a token's logprob and the row's most likely tokens, as a request asks for them;
- sequence: one request's state and the events it sends;
- batch: the running sequences' KV caches as one left-padded DynamicCache;
- scheduler: the thread that owns the model (admission and preemption, prefill, one forward per decode step);
- steps: per-step records (distinct experts per layer against batch x top-k) and the step log;
- replay: a routing trace replayed per prompt (the same prompt reads the same experts on any replica).
"""
