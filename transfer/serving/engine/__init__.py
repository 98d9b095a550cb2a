"""What schedules requests inside a prefill or decode instance (a control process): the
instance and its admission, the prefill and decode workers and their batchers, frees,
prefix checkpoints, read planning and layer-wise streaming, and `ServeOptions`. Drives
`ranks`; imports nothing above it."""
