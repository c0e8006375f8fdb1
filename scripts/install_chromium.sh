#!/usr/bin/env bash
# Headless Chromium for tests/profiling/test_report_render.py (opens the HTML report as a user would).
# Debian/Ubuntu package `chromium-headless-shell` (BSD-licensed Chromium); idempotent.
set -euo pipefail
if command -v chromium-headless-shell >/dev/null 2>&1 || command -v chromium >/dev/null 2>&1; then
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
$SUDO apt-get update -q
$SUDO apt-get install -y -q chromium-headless-shell
