#!/usr/bin/env bash
# The README's quickstart, exactly as the README types it, with the conditions it ran in written above its step lines:
# what experiments/logs/quickstart-<date>.log, its .metrics.jsonl and docs/quickstart-curves.png come from, one run.
#   bash benchmarks/quickstart.sh PREFIX      # writes PREFIX.log and PREFIX.metrics.jsonl; the figure stays in the
#                                             # run's dir (runs/quickstart/curves.png): cp it to docs/ by hand
# Run in the repository root of the tree being measured, in the project's venv; runs/quickstart must not exist.
set -euo pipefail
prefix="$1"
command="$(python - <<'EOF'
import re
text = open("README.md", encoding="utf-8").read()
block = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1)
lines = block.replace("\\\n", " ").splitlines()
print(" ".join([x for x in lines if "pacs.py" in x][0].split()))
EOF
)"
out_dir="$(sed -n 's/.*--out-dir \([^ ]*\).*/\1/p' <<<"$command")"
if [ -e "$out_dir" ]; then echo "quickstart.sh: $out_dir exists; move it away first" >&2; exit 2; fi
loads="$(mktemp)"
( while sleep 30; do cut -d' ' -f1 /proc/loadavg >>"$loads"; done ) &
watcher=$!
start=$(date +%s)
set +e
stdout="$(env $command 2>/dev/null)"
rc=$?
set -e
wall=$(( $(date +%s) - start ))
kill "$watcher" 2>/dev/null || true
cpu="$(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1)"
versions="$(python -c 'import torch, transformers; print(f"torch {torch.__version__}, transformers {transformers.__version__}")')"
{
  echo "# command: $command"
  echo "# commit: $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!experiments/logs' || echo ' (with uncommitted changes)'), in the project's venv ($versions), $(date -u +%F)"
  echo "# cpu: $cpu, $(nproc) cores; ${QUICKSTART_BESIDE:-nothing else said to be running}"
  echo "# threads: 1 (OMP_NUM_THREADS=1)"
  echo "# load average: $(sort -n "$loads" | head -1) to $(sort -n "$loads" | tail -1), /proc/loadavg every 30 s during the run"
  echo "# wall: $wall s ($((wall / 60)) min $((wall % 60)) s), exit $rc; the step lines below are the run's stdout"
  grep '^step ' <<<"$stdout"
} >"$prefix.log"
cp "$out_dir/metrics.jsonl" "$prefix.metrics.jsonl"
rm -f "$loads"
echo "wrote $prefix.log ($(grep -c '^step ' "$prefix.log") step lines) and $prefix.metrics.jsonl; exit $rc"
