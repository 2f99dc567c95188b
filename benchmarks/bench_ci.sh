#!/usr/bin/env bash
# CI time of this checkout's HEAD against earlier revisions, on this machine, in one run (by hand; ~10 min a run):
#   bash benchmarks/bench_ci.sh BASE [REV ...]      e.g. bash benchmarks/bench_ci.sh 3b7dcfd 4902886
# Each revision's own `.ci/run` (its install, its Neo4j, its whole suite) runs in a throw-away worktree, in the
# order BASE, REV..., HEAD, then BASE again, so that a machine whose speed drifts shows it as two BASE figures
# apart. Prints each run's wall time, exit status and pytest's last line, and each revision's time over BASE's
# mean. The CI machine is another machine: its times are not these. At the end the editable install points
# at this checkout again (each `.ci/run` installs its own tree).
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash benchmarks/bench_ci.sh BASE [REV ...]" >&2; exit 2; }
root=$PWD
work=$(mktemp -d)
trap 'for t in "$work"/tree-*; do git -C "$root" worktree remove --force "$t" 2>/dev/null || true; done
      rm -rf "$work"; python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -e "$root[test,ray]"' EXIT

revisions=("$@" HEAD "$1")
for i in "${!revisions[@]}"; do
  rev=$(git rev-parse --short "${revisions[$i]}")
  tree="$work/tree-$i"
  git worktree add --detach --quiet "$tree" "$rev"
  start=$SECONDS
  status=0
  (cd "$tree" && bash .ci/run) > "$work/log-$i" 2>&1 || status=$?
  seconds=$((SECONDS - start))
  echo "$rev $seconds $status" >> "$work/times"
  printf '%-10s %6s s  exit %-3s %s\n' "$rev" "$seconds" "$status" "$(grep -E 'passed|failed' "$work/log-$i" | tail -1)"
  git worktree remove --force "$tree"
done

python3 - "$work/times" "$(git rev-parse --short "$1")" <<'EOF'
import sys
from collections import defaultdict
times = defaultdict(list)
for line in open(sys.argv[1]):
    rev, seconds, _ = line.split()
    times[rev].append(float(seconds))
base = sum(times[sys.argv[2]]) / len(times[sys.argv[2]])
for rev, values in times.items():
    print(f"{rev:<10} {sum(values) / len(values):6.0f} s  {sum(values) / len(values) / base:.2f}x of {sys.argv[2]}")
EOF
