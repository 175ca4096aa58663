#!/bin/sh
# Starts the services the tests need that are not Python packages. Idempotent.
# (S3 and Prefect servers are started by the tests themselves from the venv.)
set -e
here="$(dirname "$0")"
if [ -x "$here/docker-up.sh" ]; then "$here/docker-up.sh"; fi
