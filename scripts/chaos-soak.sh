#!/usr/bin/env bash
# A long chaos run (not in CI): the suite's chaos test (tests/tests/chaos.rs)
# sized to last about SECONDS under faults, with a fault schedule that
# follows from SEED: one fault about every 20 s (at least 12), and enough
# synthetic samples for the faulted run to last that long (about 290
# samples a second under faults on 2 cores; the faults' own holds add about
# 2.5 s each to the spacing, so the schedule is sized to end well before
# the run). It first runs the same config without faults (the bit-identity
# reference, about 0.9 x SECONDS more), then prints every fault and its
# recovery, the count and recovery median / max per fault kind, each
# role's memory peak and slope,
# and checks the exactly-once audit and the final weights' identity. The
# faulted run's checkpoints live on a tmpfs of the test's own mount namespace
# (`unshare`, no root; the full-disk fault cuts its size), so the newest 64
# are kept, not all (a checkpoint is about 0.6 MB). The drafter is a group
# of DFLASH_CHAOS_MEMBERS members (default 2; each SIGKILLed member is
# replaced by a new process), and a recovery slower than 10 s has every
# role's log lines around it written to DFLASH_CHAOS_SLOW_LOG (default
# chaos-slow-SEED.log in the current folder).
#   scripts/chaos-soak.sh SECONDS SEED        e.g. scripts/chaos-soak.sh 3600 11
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:?usage: scripts/chaos-soak.sh SECONDS SEED}
seed=${2:?usage: scripts/chaos-soak.sh SECONDS SEED}
faults=$(( seconds / 20 > 12 ? seconds / 20 : 12 ))
# The data is passed over in epochs of at most 100,000 samples: a restarted
# target or coordinator reads and tokenizes it (about 3-5 s per 100,000 on 2
# busy cores), and that load, not the recovery, would set the recovery time.
total=$(( seconds * 250 > 6000 ? seconds * 250 : 6000 ))
epochs=$(( (total + 99999) / 100000 ))
samples=$(( total / epochs ))
make build >/dev/null
members=${DFLASH_CHAOS_MEMBERS:-2}
# The pause between faults (ms): by default the schedule ends at about
# two-thirds of the expected run; DFLASH_CHAOS_SPACING_MS spreads it over
# more of it where the run is known to be slower (seed 18: 14000 at 3900 s).
spacing=${DFLASH_CHAOS_SPACING_MS:-$(( seconds * 1000 / faults * 2 / 3 - 2500 ))}
slow_log=${DFLASH_CHAOS_SLOW_LOG:-$PWD/chaos-slow-$seed.log}
echo "chaos soak: ~${seconds} s, seed ${seed}, ${faults} faults ${spacing} ms apart, ${samples} samples x ${epochs} epoch(s), ${members} drafter member(s)"
DFLASH_CHAOS_MEMBERS=$members DFLASH_CHAOS_SLOW_LOG=$slow_log DFLASH_CHAOS_SEED=$seed DFLASH_CHAOS_FAULTS=$faults DFLASH_CHAOS_SAMPLES=$samples DFLASH_CHAOS_EPOCHS=$epochs \
  DFLASH_CHAOS_SPACING_MS=$spacing DFLASH_CHAOS_KEEP_LAST=64 \
  cargo nextest run --release --profile soak -p dflash-tests --test chaos --no-capture
