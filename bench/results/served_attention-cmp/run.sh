#!/usr/bin/env bash
# bench/served_attention.py (fot, 8 requests, 1 thread) at 83c8d0f -- before the served HeadsStore and window pool --
# and at the current checkout, alternately, twice: the machine's noise (~10-20% between runs) shows in the pairs.
# Run from the repository root: bash bench/results/served_attention-cmp/run.sh [REV [OUT]]
# (2026-11-28: bash bench/results/served_attention-cmp/run.sh 1cc8fa0 bench/results/served_attention-cmp-1cc8fa0)
set -euo pipefail
rev=${1:-83c8d0f}
root=$PWD out=$PWD/${2:-bench/results/served_attention-cmp} tmp=$(mktemp -d)
mkdir -p "$out"
git worktree add -q "$tmp/old" "$rev"
trap 'git worktree remove --force "$tmp/old"; rm -rf "$tmp"' EXIT
# the old tree imported as lcx (the editable install maps lcx to this checkout)
mkdir "$tmp/pkg" && cp -r "$tmp/old/sdk" "$tmp/pkg/lcx"
for d in plugins adapters integrations; do ln -s "$tmp/old/$d" "$tmp/pkg/lcx/$d"; done
for i in 1 2; do
  (cd "$tmp/old" && PYTHONPATH="$tmp/pkg" "$root/.venv/bin/python" bench/served_attention.py --method fot --out "$out/sa_cmp_before_$i.json" | grep fot: | sed "s/^/$rev /")
  .venv/bin/python bench/served_attention.py --method fot --out "$out/sa_cmp_after_$i.json" | grep fot: | sed 's/^/HEAD /'
done
