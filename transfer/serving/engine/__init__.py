"""One engine loop per instance: a `Request` record per request, a `CacheManager` that owns
the pools, and the `DecodeEngine` thread that alone commands the ranks (docs/workers.md)."""
