"""``preload-gate rollout``: rotate one host's replicas onto a new checkpoint.

Both checkpoints stay resident (one daemon each) while the replicas move one
at a time, each behind its canary, so a failure rolls that replica back onto
the old checkpoint as a cache hit instead of a disk reload. One concern per
module:

- :mod:`harness.rollout.state`: the state file (each replica's checkpoint,
  written atomically before and after every step) and the host lock;
- :mod:`harness.rollout.plan`: what a run is asked to do, checked before
  anything starts;
- :mod:`harness.rollout.evidence`: the gate report a rollout believes, bound
  to the candidate's digest, the deployment settings and the gate's golden;
- :mod:`harness.rollout.residency`: the daemons that hold the checkpoints,
  and the memory budget they must fit;
- :mod:`harness.rollout.replicas`: readiness and load events of a replica,
  and the driver interface; :mod:`harness.rollout.supervised` and
  :mod:`harness.rollout.command`: the two drivers;
- :mod:`harness.rollout.switch`: one replica onto one checkpoint, judged;
- :mod:`harness.rollout.runner`: the whole rotation, resume and rollback;
- :mod:`harness.rollout.report`, :mod:`harness.rollout.metrics`,
  :mod:`harness.rollout.loadgen`: what it tells people and machines.

The package imports nothing: callers import each name from its module.
"""
