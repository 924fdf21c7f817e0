#!/usr/bin/env bash
# cron: one batchspec night on a Ray cluster, through the cluster's job server (`ray job submit`).
#
#   # m h dom mon dow  command                     (02:30 UTC: yesterday's partition)
#   30 2 * * *  BATCHSPEC_JOB=/srv/jobs/nightly.yaml RAY_JOB_ADDRESS=http://head:8265 /srv/batchspec/examples/cron_nightly.sh >> /var/log/batchspec-nightly.log 2>&1
#
# The logical date is the first argument, else yesterday in UTC: a backfill is
# `cron_nightly.sh 2026-12-01`. The job file (a spec with {ds} in its paths, as
# examples/nightly.yaml) must be readable on the head node by that path, and batchspec installed
# there: the job's driver runs on the head and joins the cluster itself (Ray sets RAY_ADDRESS for
# it; a cluster with token authentication gives it the token too). No --working-dir: uploading a
# folder that holds a `batchspec/` checkout would shadow the installed package, which batchspec
# refuses (docs/operations.md).
#
# `ray job submit` exits 1 for any failed job, so batchspec's own exit codes (1 failed shards,
# 2 refused, 3 crashed, 143 terminated) do not reach cron through it; this script asks the output
# afterwards (`batchspec status`, which reads the manifests) and exits 0 only when the night is
# complete, else with what `ray job submit` said. Rerunning the script for the same date runs only
# the shards not done.
set -uo pipefail

ds="${1:-$(date -u -d yesterday +%F)}"
job="${BATCHSPEC_JOB:?set BATCHSPEC_JOB to the job spec (a path on the head node)}"
address="${RAY_JOB_ADDRESS:-http://127.0.0.1:8265}"

ray job submit --address "$address" --submission-id "batchspec-$(basename "$job" .yaml)-$ds-$(date -u +%H%M%S)" -- \
    batchspec submit "$job" --param "ds=$ds" --log-format json
submitted=$?

if batchspec status "$job" --param "ds=$ds" --format json > /dev/null; then
    echo "batchspec night $ds: complete"
    exit 0
fi
echo "batchspec night $ds: not complete (ray job submit exited $submitted); \`batchspec status $job --param ds=$ds\` lists the shards not done" >&2
exit $(( submitted == 0 ? 1 : submitted ))
