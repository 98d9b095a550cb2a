"""The decoder layers of one TP rank's model shard, one file per layer kind."""
