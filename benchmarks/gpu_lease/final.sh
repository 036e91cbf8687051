#!/usr/bin/env bash
# A short GPU lease, step 3 (the last device call, `bash benchmarks/gpu_lease/final.sh SECONDS`): wait at most
# SECONDS for bg.sh to finish, then bring back what it made ($OUT: results.tgz, bg.log).
W=/tmp/w; deadline=$(( $(date +%s) + ${1:-300} ))
while [ ! -f $W/bg.done ] && [ $(date +%s) -lt $deadline ]; do sleep 2; done
tail -n 40 $W/bg.log
cd $W && tar czf $OUT/results.tgz bg.log *.md dmon.log dec-*.log dec-*/metrics.jsonl demo-dali.log 2>/dev/null; cp bg.log $OUT/
ls -la $OUT
