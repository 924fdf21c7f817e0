"""The job runner: plan shards, run them through Ray Data on shard actors, commit parts and manifests."""
