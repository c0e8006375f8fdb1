#!/usr/bin/env bash
# The whole test suite, from a clean clone: venv + every extra, lint, types, tests (parallel).
source "$(dirname "$0")/_venv.sh"
source "$(dirname "$0")/postgres.sh"   # a throwaway PostgreSQL server for tests/sources/test_sql_postgres.py
bash scripts/install_chromium.sh  # the HTML report is tested in a real browser
ruff check src tests benchmarks
mypy
python -m pytest -n "${HEADRACE_TEST_WORKERS:-2}" "$@"
