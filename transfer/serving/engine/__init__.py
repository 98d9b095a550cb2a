"""What schedules requests inside a prefill or decode instance (a control process): the
instance, the prefill and decode workers, prefix checkpoints, read planning and layer-wise
streaming, and `ServeOptions`. Each side runs on one engine loop, the only sender of rank
commands: a record per request with its phase (request.py: `Request` on decode, `Prompt`
on prefill), a `CacheManager` (cache_manager.py: admission and the one `release`), and the
`DecodeEngine` or `PrefillEngine` thread. Drives `ranks`; imports nothing above it."""
