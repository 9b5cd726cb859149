"""`weightstream serve`: the OpenAI-compatible HTTP front end over the engine's continuous batching
(engine/batching/, which knows nothing of HTTP).

- affinity: a prompt's affinity key, and the experts its prefill chose and the cache holds, for a router;
- metrics: Prometheus metrics;
- logprobs: token logprobs in their OpenAI shapes;
- protocol: OpenAI request and response shapes (a request's choices gathered into one answer) and error objects;
- service: the served model (loaded in the background), the scheduler, and a request turned into Sequences;
- app: the Starlette routes;
- server: loading, uvicorn, graceful shutdown;
- ray/: the same app as Ray Serve replicas (`serve --ray`), an optional extra that imports only this package and
  the engine.
"""
