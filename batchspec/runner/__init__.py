"""The job runner: plan shards, run them on Ray Data actors, commit parts and manifests."""
