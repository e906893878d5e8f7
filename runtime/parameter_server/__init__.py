"""Parameter-server training on Ray: variable placement, PS shards, workers, the coordinator."""
