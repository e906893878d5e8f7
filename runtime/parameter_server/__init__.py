"""Parameter-server training on Ray: variable layout, PS shards, workers, the coordinator."""
