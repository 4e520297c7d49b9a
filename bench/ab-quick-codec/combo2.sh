#!/bin/bash
# one call: the codec A/B (this tree against bench/ab-quick-codec/quick_codec.cuh), the eager call, then the whole GPU suite
# in what time is left before $1 s
set -u
cd "$(dirname "$0")/../.."
D=${1:-520}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
REAL=$OUT; NEW=$PWD
mkdir -p /tmp/o $REAL/ab; rm -rf /tmp/o/*
nvidia-smi -L
rm -rf /tmp/old && mkdir -p /tmp/old
tar --exclude=./build --exclude=./.git -cf - . | (cd /tmp/old && tar xf -)
cp bench/ab-quick-codec/quick_codec.cuh /tmp/old/kernels/quick_codec.cuh
(JOBS=8 scripts/gpu-test -q -- true || echo "new build failed") &
(cd /tmp/old && JOBS=8 WEFT_DEPS_DIR=/tmp/deps2 timeout 150 scripts/gpu-test -q -- true) || echo "old build failed"
wait
echo "== built at $(el) s"
sass_counts() {
  cuobjdump -sass "$1" | awk '
    /Function :/ { f = $3 }
    /^ +\/\*[0-9a-f]+\*\// { if (f !~ /qr_step/) next; op = $2; if (op ~ /^@/) op = $3; sub(/\..*/, "", op); sub(/;/, "", op);
      n[f]++; if (op ~ /^(F2I|I2F|MUFU|PRMT|F2FP|FADD|FMUL|FFMA|I2FP|F2IP)$/) c[f, op]++ }
    END { for (g in n) { printf "%s total=%d", g, n[g];
            split("F2I I2F I2FP F2IP MUFU F2FP PRMT FADD FMUL FFMA", ops, " "); for (i = 1; i <= 10; i++) if (c[g, ops[i]]) printf " %s=%d", ops[i], c[g, ops[i]]; printf "\n" } }' |
    sed -E 's/_ZN[0-9]+_GLOBAL__N__[0-9a-f]+_[0-9]+_[a-z_0-9]+_cu_[0-9a-f]+//' | sort
}
sass_counts $NEW/build/obj/quick_allreduce_bf16.cu.o > $REAL/ab/sass-new.txt
sass_counts /tmp/old/build/obj/quick_allreduce_bf16.cu.o > $REAL/ab/sass-old.txt
grep -E 'reduceI13__nv_bfloat16Li(2|8)ELi[123]ELb0|quantizeI13__nv_bfloat16Li[123]ELb0' $REAL/ab/sass-new.txt $REAL/ab/sass-old.txt | sed 's/^.*sass-//' | cut -c1-160
bench() {
  local r=$1 d=$NEW; case $r in old*) d=/tmp/old;; esac
  mkdir -p $REAL/ab/$r; echo "== bench $r at $(el) s"
  (cd $d && timeout 90 scripts/gpu-test -q -- luajit scripts/bench-quick-codec.lua --sizes 64,256 --out $REAL/ab/$r) 2>&1 | tail -2
  grep -E '^\| 256 MiB' $REAL/ab/$r/*.md | cut -d'|' -f3-8,10-12 | head -20
}
bench new1; bench old1
echo "== gpu_quick_spec at $(el) s"
OUT=/tmp/o timeout 150 scripts/gpu-test -q tests/gpu/gpu_quick_spec.lua 2>&1 | tail -8
echo "== eager call at $(el) s"
timeout 40 scripts/gpu-test -q -- scripts/weft-mps -n 2 -- scripts/weft-run -n 2 scripts/bench-eager-call.lua 2>&1 | tail -6
left=$(( D - $(el) - 10 ))
if [ $left -gt 60 ]; then
  echo "== the other GPU specs at $(el) s, $left s left"
  OUT=/tmp/o timeout $left scripts/gpu-test -q $(ls tests/gpu/*_spec.lua | grep -v gpu_quick_spec) 2>&1 | tail -12
  awk '/^== /{f=$2} /successes \//{print f, $1, $4, $7, $10}' /tmp/o/gpu-test.log | head -40
fi
echo "== done $(el) s"
tar czf $REAL/gpu-test-logs.tgz -C /tmp/o . 2>/dev/null
tar -czf $REAL/ab.tgz -C $REAL ab && rm -rf $REAL/ab
