#!/usr/bin/env bash
# Prints the commit the GPU scripts record for this checkout: RESHARD_COMMIT where set, else HEAD,
# marked "+changes" where the tree differs from it (a copy of a working tree can carry an older
# .git), or "unknown" outside git.
cd "$(dirname "$0")/.." || exit 1
if [[ -n "${RESHARD_COMMIT:-}" ]]; then
  echo "$RESHARD_COMMIT"
elif commit=$(git rev-parse --short HEAD 2>/dev/null); then
  git diff --quiet HEAD -- 2>/dev/null || commit+="+changes"
  echo "$commit"
else
  echo unknown
fi
