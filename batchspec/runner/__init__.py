"""The job runner: plan shards, run them on a pool of Ray actors, commit parts and manifests."""
