#!/usr/bin/env bash
# A short GPU lease, step 3 (the last device call, `bash benchmarks/gpu_lease/final.sh SECONDS`): wait at most
# SECONDS for bg.sh to finish, bringing back what it has made so far ($OUT: results.tgz, bg.log) every few seconds,
# so a call cut short by the lease's end still returns the rows finished before it.
W=/tmp/w; deadline=$(( $(date +%s) + ${1:-300} ))
collect() { (cd $W && tar czf $OUT/results.tgz.part bg.log *.md dmon.log dec-*.log dec-*/metrics.jsonl demo-dali*.log \
             predict-*.log 2>/dev/null; mv $OUT/results.tgz.part $OUT/results.tgz; cp bg.log $OUT/); }
while [ ! -f $W/bg.done ] && [ $(date +%s) -lt $deadline ]; do collect; sleep 5; done
collect
tail -n 40 $W/bg.log
ls -la $OUT
