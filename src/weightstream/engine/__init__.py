"""transformers integration: model loading with streamed experts, generation, routing record/replay."""


def record_trace(*args, **kwargs):
    """See weightstream.engine.routing.record_trace."""
    from weightstream.engine.routing import record_trace as record

    return record(*args, **kwargs)
