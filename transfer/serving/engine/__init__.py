"""What schedules requests inside a prefill or decode instance (a control process): the
instance and its admission, the prefill and decode workers and their batchers, frees,
prefix checkpoints, read planning and layer-wise streaming, and `ServeOptions`. Decode runs
on one engine loop: a `Request` record per request (request.py), a `CacheManager`
(cache_manager.py) and the `DecodeEngine` thread (decode_engine.py), the only sender of
rank commands. Drives `ranks`; imports nothing above it."""
