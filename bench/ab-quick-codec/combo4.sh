#!/bin/bash
# one call: this tree's quick codec against the one before (this tree with before.patch), three rounds
# alternated, then the GPU suite's quick spec
set -u
cd "$(dirname "$0")/../.."
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
REAL=$OUT; NEW=$PWD
mkdir -p /tmp/o $REAL/ab; rm -rf /tmp/o/*
nvidia-smi -L
rm -rf /tmp/old && mkdir -p /tmp/old
tar --exclude=./build --exclude=./.git -cf - . | (cd /tmp/old && tar xf -)
(cd /tmp/old && { git apply bench/ab-quick-codec/before.patch 2>/dev/null || patch -s -p1 < bench/ab-quick-codec/before.patch; }) || { echo "before.patch does not apply"; exit 1; }
(JOBS=8 scripts/gpu-test -q -- true || echo "new build failed") &
(cd /tmp/old && JOBS=8 WEFT_DEPS_DIR=/tmp/deps2 timeout 150 scripts/gpu-test -q -- true) || echo "old build failed"
wait
echo "== built at $(el) s"
bench() {
  local r=$1 d=$NEW; case $r in old*) d=/tmp/old;; esac
  mkdir -p $REAL/ab/$r; echo "== bench $r at $(el) s"
  (cd $d && timeout 90 scripts/gpu-test -q -- luajit scripts/bench-quick-codec.lua --sizes 64,256 --out $REAL/ab/$r) 2>&1 | grep -i "identical\|fail\|error" | head -3
  grep -E '^\| 256 MiB' $REAL/ab/$r/*.md | cut -d'|' -f3-8,10-12 | head -20
}
for i in 1 2 3; do bench new$i; bench old$i; done
echo "== gpu_quick_spec at $(el) s"
OUT=/tmp/o timeout 150 scripts/gpu-test -q tests/gpu/gpu_quick_spec.lua 2>&1 | tail -4
echo "== done $(el) s"
tar -czf $REAL/ab.tgz -C $REAL ab && rm -rf $REAL/ab
