#!/usr/bin/env bash
# Runs a training command so that a signal sent to this script -- alone (a container runtime's stop, `kill PID`
# of the job) or with its whole process group (Ctrl-C in a terminal, `kill -- -PGID`) -- reaches every rank:
# SIGTERM, SIGUSR1 (and SIGINT, passed on as SIGTERM) go to each rank, which with --exit-signal-handler
# finishes its step, saves to --save and exits 75; DeepSpeed's launcher then exits 75 and so does this
# script, after the save (docs/long_runs.md). Without it a SIGTERM to the `deepspeed` command reaches no
# rank, and one to the whole group ends `deepspeed` at once while the ranks still save.
#   examples/gpt_moe/forward_signals.sh deepspeed --num_gpus 8 examples/gpt_moe/pretrain_gpt_moe.py \
#       --deepspeed_config ds.json --save ckpt --exit-signal-handler ...
#   a container:  ENTRYPOINT ["examples/gpt_moe/forward_signals.sh"]   CMD ["deepspeed", "--num_gpus", "8", ...]
# A multi-node job runs it on each node: one rank's signal stops every rank after the same step.
set -u
if [ "$#" -eq 0 ]; then
    echo "usage: $0 deepspeed ... pretrain_gpt_moe.py ... --save DIR --exit-signal-handler" >&2
    exit 2
fi
setsid "$@" &   # a session and process group of its own: a signal to this script's group reaches this script only
job=$!

forward() {     # $1: the signal, to each of the job's ranks (DeepSpeed's launcher gives them --local_rank=)
    local session
    session=$(ps -o sid= -p "$job" 2>/dev/null | tr -d ' ')
    if [ -n "$session" ]; then
        pkill "-$1" -s "$session" -f -- '--local_rank=' || true
        echo "forward_signals.sh: SIG$1 passed on to the ranks; waiting for them to save and exit" >&2
    fi
}
trap 'forward TERM' TERM
trap 'forward TERM' INT
trap 'forward USR1' USR1

while kill -0 "$job" 2>/dev/null; do
    wait "$job"   # returns early when a trapped signal arrives: then wait again
done
wait "$job"     # the job's own status (75 after a signal and a save)
