#!/usr/bin/env bash
# The main job: stream a dataset larger than its budget and print the profile.
HEADRACE_EXTRAS="${HEADRACE_EXTRAS:-dev}" source "$(dirname "$0")/_venv.sh"
exec headrace demo "$@"
