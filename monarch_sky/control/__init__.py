"""The controller's side: one process drives the whole run.

`controller` starts the hosts, the lighthouse and one slot per replica group; each `slot` drives
its group through the states of `slot_state`, starts its `generations` and recovers it
(`slot_recovery`, `rejoin`, `spares`) when `detection` or Monarch's supervision says it failed.
The run's shared settings live in `context`; `ledger` records the steps, `heal_budget` sizes the
timeouts, `checkpoint_policy` / `checkpoint_loads` / `checkpoint_resume` the last-resort
checkpoints; `shutdown` stops everything and `summary` writes the run's end.
"""
