"""Recovery times of a `dflash up` run whose drafter and/or target were
SIGKILLed (the device scripts write each kill's Unix time to
OUT/kill-<role>.t): from each kill to the next trained step, with the
drafter's resume and the replacement target's model load in between.

    python3 recovery_times.py RUN.log OUT
"""
import datetime
import re
import sys

log, out = sys.argv[1], sys.argv[2]


def t(line):
    m = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z", line)
    return datetime.datetime.fromisoformat(m.group(1)).replace(tzinfo=datetime.timezone.utc).timestamp() if m else None


lines = open(log, errors="replace").read().splitlines()


def first(after, pred):
    return next(((t(l), l) for l in lines if pred(l) and (t(l) or 0) > after), (None, None))


def step(l):
    return l.startswith("[drafter") and " INFO step " in l


for role in ("drafter", "target"):
    try:
        k = float(open(f"{out}/kill-{role}.t").read())
    except OSError:
        print(f"{role}: not killed")
        continue
    if role == "drafter":
        s, l = first(k, step)
        r, _ = first(k, lambda l: "resum" in l and l.startswith("[drafter"))
        print(f"drafter SIGKILL -> first trained step {s - k:.1f} s" if s else "drafter: no step after the kill",
              f"(resume logged at +{r - k:.1f} s)" if r else "", (l or "")[:140])
    else:
        ready, rl = first(k, lambda l: l.startswith("[target") and "loaded" in l)
        s, l = first(ready or k, step)
        print(f"target SIGKILL -> replacement loaded {ready - k:.1f} s" if ready else "target: no reload seen",
              f"-> next trained step {s - k:.1f} s" if s else "", (rl or "")[:140])
