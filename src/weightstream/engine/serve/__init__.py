"""`weightstream serve`: an OpenAI-compatible HTTP server over the streaming engine, with batched decode.

- sampling: per-request logit bias and penalties, greedy / temperature / top-p with its own generator;
- text: generated ids to text with stop strings;
- sequence: one request's state and the events it sends;
- batch: the running sequences' KV caches as one left-padded DynamicCache;
- scheduler: the thread that owns the model (admission and preemption, prefill, one forward per decode step);
- steps: per-step records (distinct experts per layer against batch x top-k) and the step log;
- affinity: a prompt's affinity key, and the experts its prefill chose and the cache holds, for a router;
- replay: a routing trace replayed per prompt (the same prompt reads the same experts on any replica);
- metrics: Prometheus metrics;
- logprobs: token logprobs and their OpenAI shapes;
- protocol: OpenAI request and response shapes (a request's choices gathered into one answer) and error objects;
- service: the served model (loaded in the background), the scheduler, and a request turned into Sequences;
- app: the Starlette routes;
- server: loading, uvicorn, graceful shutdown.

Under Ray Serve (`weightstream/ray/`, `serve --ray`) each replica runs this same app on the requests its ingress
forwards.
"""
