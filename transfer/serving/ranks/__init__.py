"""TP rank processes and what runs in them: the control-to-rank protocol and commands, the
rank worker (model shard, arena, transfers), layer-wise streaming's progress words, and the
spec a control process hands its ranks. Imports only the serving root."""
