"""Tensor parallelism: the split (`shard`), one rank's collectives (`group`) and the
ranks' processes (`ranks`)."""
