#!/bin/bash
# the least: the new codec's steps checked bit for bit and timed, then the quick spec, before $1 s
set -u
cd "$(dirname "$0")/../.."
D=${1:-150}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
REAL=$OUT; mkdir -p /tmp/o $REAL/new1
nvidia-smi -L
scripts/gpu-test -q -- true || echo "build failed"
echo "== built at $(el) s"
cuobjdump -sass build/obj/quick_allreduce_bf16.cu.o | awk '
    /Function :/ { f = $3 }
    /^ +\/\*[0-9a-f]+\*\// { if (f !~ /qr_step/) next; op = $2; if (op ~ /^@/) op = $3; sub(/\..*/, "", op); sub(/;/, "", op);
      n[f]++; if (op ~ /^(F2I|I2F|MUFU|PRMT|F2FP|FADD|FMUL|FFMA)$/) c[f, op]++ }
    END { for (g in n) { printf "%s total=%d", g, n[g];
            split("F2I I2F MUFU F2FP PRMT FADD FMUL FFMA", ops, " "); for (i = 1; i <= 8; i++) if (c[g, ops[i]]) printf " %s=%d", ops[i], c[g, ops[i]]; printf "\n" } }' |
    sed -E 's/_ZN[0-9]+_GLOBAL__N__[0-9a-f]+_[0-9]+_[a-z_0-9]+_cu_[0-9a-f]+//' | sort > $REAL/sass-new.txt
grep -E 'reduceI13__nv_bfloat16Li(2|8)ELi[123]ELb0|quantizeI13__nv_bfloat16Li[123]ELb0' $REAL/sass-new.txt | cut -c1-150
echo "== bench at $(el) s"
timeout 75 scripts/gpu-test -q -- luajit scripts/bench-quick-codec.lua --sizes 64,256 --out $REAL/new1 2>&1 | tail -2
grep -E '^\| 256 MiB|Checked first' $REAL/new1/*.md | cut -d'|' -f3-8,10-12 | head -20
left=$(( D - $(el) - 5 ))
echo "== gpu_quick_spec at $(el) s, $left s left"
[ $left -gt 20 ] && OUT=/tmp/o timeout $left scripts/gpu-test -q tests/gpu/gpu_quick_spec.lua 2>&1 | tail -8
echo "== done $(el) s"
