"""Injected faults: the `faults.*` settings' spec (`spec`) and the controller's injector, which
decides when each fires and where (`injector`). The fault itself is carried out inside a trainer
process by `monarch_sky.replica.fault_actor`.
"""
